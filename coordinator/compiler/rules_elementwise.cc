// Sharding rules of the elementwise ops (and of constant, iota and random_bits, which their
// users decide), and the partition handlers of iota and random_bits.
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "coordinator/compiler/rules.h"
#include "core/status.h"

namespace tessera::internal {
namespace {

// Unary, binary, compare, select, convert: operands and result share one layout; the result
// takes each dimension's axes from the first operand that splits it.
absl::Status elementwise(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const size_t rank = n.shape.size();
  std::vector<std::optional<ValueSharding>> in;
  for (int o : n.operands) in.push_back(c.of(o));
  // A partial sum passes through a linear op (neg), through add/sub of two equally partial
  // operands, through select between two equally partial cases by a whole predicate, and
  // through mul (or the numerator of div) by a whole operand.
  auto same_partial = [&](size_t i, size_t j) {
    return in[i] && in[j] && in[i]->is_partial() && same_axes(in[i]->partial, in[j]->partial) &&
           in[i]->partial_op == ReduceOp::kSum && in[j]->partial_op == ReduceOp::kSum;
  };
  std::vector<std::string> partial;
  std::vector<bool> keep_partial(in.size(), false);
  if (has_trait(n.op, kLinear) && in[0] && in[0]->partial_op == ReduceOp::kSum) {
    partial = in[0]->partial;
    keep_partial[0] = true;
  } else if ((n.op == Op::kAdd || n.op == Op::kSub) && same_partial(0, 1)) {
    partial = in[0]->partial;
    keep_partial = {true, true};
  } else if (n.op == Op::kSelect && same_partial(1, 2) && !(in[0] && in[0]->is_partial())) {
    partial = in[1]->partial;  // each device picks between its terms by the whole predicate
    keep_partial = {false, true, true};
  } else if (n.op == Op::kMul || n.op == Op::kDiv) {
    // An operand not decided yet (a constant) is whole.
    const bool p0 = in[0] && in[0]->is_partial(), p1 = in[1] && in[1]->is_partial();
    if (p0 && !p1 && in[0]->partial_op == ReduceOp::kSum) {
      partial = in[0]->partial;
      keep_partial[0] = true;
    } else if (n.op == Op::kMul && p1 && !p0 && in[1]->partial_op == ReduceOp::kSum) {
      partial = in[1]->partial;
      keep_partial[1] = true;
    }
  } else if (n.op == Op::kConvert && in[0] && in[0]->partial_op == ReduceOp::kSum && is_floating(n.dtype) &&
             !is_half(n.dtype) && is_floating(c.graph().node(n.operands[0]).dtype)) {
    // (A sum resolves before a rounding to bfloat16/float16, not in the half after it.)
    partial = in[0]->partial;
    keep_partial[0] = true;
  }
  std::set<std::string> taken(partial.begin(), partial.end());
  Dims d(rank);
  for (size_t dim = 0; dim < rank; ++dim) {
    for (const auto& s : in) {
      if (s && d[dim].empty() && !s->dims[dim].empty()) d[dim] = c.usable(s->dims[dim], n.shape[dim], &taken);
    }
  }
  std::vector<ValueSharding>& req = c.needs(id);
  req.clear();
  for (size_t i = 0; i < in.size(); ++i) {
    req.push_back(ValueSharding{d, keep_partial[i] ? partial : std::vector<std::string>{}, ReduceOp::kSum});
  }
  c.set(id, d, partial);
  return absl::OkStatus();
}

// Constants and iota: decided by their users (the backward pass), replicated until then.
absl::Status source(ShardingContext&, int) { return absl::OkStatus(); }

// An iota is built at its local shape. Split dimensions other than its counting one hold the
// same values on every device; when the counting dimension is split, each device adds its
// offset: its position along that dimension's axes (axis_index, which each device resolves)
// times the block's extent. So no device holds more than its block, whatever the global shape.
absl::Status partition_iota(PartitionContext& c, int id) {
  const Node& n = c.graph().node(id);
  const int64_t dimension = n.attrs<IotaAttrs>().dimension;
  const Axes& axes = c.propagation().result[id].dims[dimension];
  Instruction local = c.local_kernel(id, {});
  const Shape block = local.node.shape;
  const int counted = c.emit(std::move(local));
  if (axes.empty()) {
    c.bind(id, counted);
    return absl::OkStatus();
  }
  const int offset = emit_kernel(c, id, Op::kBroadcastInDim, n.dtype, block,
                                 {emit_block_start(c, id, axes, block[dimension], n.dtype)},
                                 BroadcastAttrs{});  // of a scalar: no dims
  c.bind(id, emit_kernel(c, id, Op::kAdd, n.dtype, block, {counted, offset}));
  return absl::OkStatus();
}

// The number of leading batch dimensions of random_bits node `n` (its keys' batch).
size_t key_batch_rank(const Graph& g, const Node& n) { return g.node(n.operands[0]).shape.size() - 1; }

// random_bits: decided by its users, as iota; the key and the counter stay whole. A batch of
// keys splits the result's batch dimensions as the keys (or their counters) are split, the
// counted dimensions whole, as JAX's random_bits_p (its keys' spec, then None for each counted
// dimension: jax/_src/random/prng.py); an unsplit batch is left to the users too.
absl::Status random_source(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const size_t b = key_batch_rank(c.graph(), n);
  Dims d(n.shape.size());
  std::set<std::string> taken;
  bool split = false;
  for (size_t dim = 0; dim < b; ++dim) {
    for (int o : n.operands) {
      const std::optional<ValueSharding> s = c.of(o);
      if (s && d[dim].empty() && !s->dims[dim].empty()) d[dim] = c.usable(s->dims[dim], n.shape[dim], &taken);
    }
    split = split || !d[dim].empty();
  }
  std::vector<ValueSharding>& req = c.needs(id);
  req.clear();
  Dims key(d.begin(), d.begin() + static_cast<int64_t>(b)), counter = key;
  key.emplace_back();
  req.push_back(ValueSharding{std::move(key), {}, ReduceOp::kSum});
  req.push_back(ValueSharding{std::move(counter), {}, ReduceOp::kSum});
  if (split) c.set(id, std::move(d));
  return absl::OkStatus();
}

// The result's dimensions follow its users; the words dimension stays whole; the keys' and
// the counters' batch dimensions follow the result's.
DimMap random_map(const Graph& g, const Node& n) {
  const int b = static_cast<int>(key_batch_rank(g, n));
  DimMap m{{{}, {}}, std::vector<bool>(n.shape.size(), true)};
  for (int d = 0; d < b; ++d) {
    m.follow[0].push_back(d);
    m.follow[1].push_back(d);
  }
  m.follow[0].push_back(-1);
  if (n.attrs<RandomBitsAttrs>().words) m.free.back() = false;
  return m;
}

// Random bits are generated where they live, as an iota is: each device runs the kernel on its
// block with the counter moved to its block's first element, the sum over split dimensions d of
// axis_index(d's axes) * block[d] * stride[d] (row-major strides of the whole shape). Nothing
// moves between devices, and every bit equals the unsharded result's (JAX's partitionable
// threefry). A batch of keys is split as the keys are: each device runs its own keys, each
// counter moved the same.
absl::Status partition_random_bits(PartitionContext& c, int id) {
  const Node& n = c.graph().node(id);
  const RandomBitsAttrs& a = n.attrs<RandomBitsAttrs>();
  const Dims& dims = c.propagation().result[id].dims;
  if (a.words && !dims.back().empty()) {
    return absl::InternalError(absl::StrCat("random_bits %", id, ": its words dimension is split"));
  }
  const int64_t b = static_cast<int64_t>(key_batch_rank(c.graph(), n));
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  const Shape block = c.local_kernel(id, in).node.shape;
  const Shape counters(block.begin(), block.begin() + b);
  int64_t stride = 1;
  for (int64_t d = static_cast<int64_t>(a.shape.size()) - 1; d >= 0; --d) {
    if (!dims[b + d].empty()) {
      int start = emit_block_start(c, id, dims[b + d], block[b + d] * stride, DType::kI64);
      if (b > 0) start = emit_kernel(c, id, Op::kBroadcastInDim, DType::kI64, counters, {start}, BroadcastAttrs{});
      in[1] = emit_kernel(c, id, Op::kAdd, DType::kI64, counters, {in[1], start});
    }
    stride *= a.shape[d];
  }
  c.bind(id, c.emit(c.local_kernel(id, in)));
  return absl::OkStatus();
}

constexpr ShardingRule kElementwise = {elementwise, identity_map};
constexpr ShardingRule kSource = {source, identity_map};
constexpr ShardingRule kIota = {source, identity_map, false, partition_iota};
constexpr ShardingRule kRandomBits = {random_source, random_map, false, partition_random_bits};

}  // namespace

absl::Span<const ShardingRuleEntry> elementwise_rules() {
  // Rows are appended one per line, the table above them kept as it is.
  // clang-format off
  static constexpr ShardingRuleEntry kRules[] = {
      {Op::kConstant, kSource},     {Op::kIota, kIota},
      {Op::kNeg, kElementwise},     {Op::kAbs, kElementwise},
      {Op::kExp, kElementwise},     {Op::kLog, kElementwise},
      {Op::kTanh, kElementwise},    {Op::kLogistic, kElementwise},
      {Op::kSqrt, kElementwise},    {Op::kRsqrt, kElementwise},
      {Op::kSin, kElementwise},     {Op::kCos, kElementwise},
      {Op::kFloor, kElementwise},   {Op::kCeil, kElementwise},
      {Op::kSign, kElementwise},    {Op::kNot, kElementwise},
      {Op::kAdd, kElementwise},     {Op::kSub, kElementwise},
      {Op::kMul, kElementwise},     {Op::kDiv, kElementwise},
      {Op::kPow, kElementwise},     {Op::kMax, kElementwise},
      {Op::kMin, kElementwise},     {Op::kAnd, kElementwise},
      {Op::kOr, kElementwise},      {Op::kEq, kElementwise},
      {Op::kNe, kElementwise},      {Op::kLt, kElementwise},
      {Op::kLe, kElementwise},      {Op::kGt, kElementwise},
      {Op::kGe, kElementwise},      {Op::kSelect, kElementwise},
      {Op::kConvert, kElementwise}, {Op::kErf, kElementwise},
      {Op::kRem, kElementwise},     {Op::kStopGradient, kElementwise},
      {Op::kRandomBits, kRandomBits},
      {Op::kShiftRightLogical, kElementwise},
      {Op::kErfInv, kElementwise},
  };
  // clang-format on
  return kRules;
}

}  // namespace tessera::internal
