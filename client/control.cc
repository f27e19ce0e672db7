// Control flow: scan, traced into a body sub-graph (core/op_attrs.h's ScanAttrs).
#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/trace_state.h"
#include "tessera/trace.h"

namespace tessera {

using internal::TraceState;

namespace {

// The trace the operands belong to (the current one when there are none), or null.
TraceState* trace_of(const std::vector<Value>& a, const std::vector<Value>& b) {
  TraceState* t = nullptr;
  for (const std::vector<Value>* list : {&a, &b}) {
    for (const Value& v : *list) {
      if (!v.ok()) return nullptr;
      if (t == nullptr) t = TraceState::of(v);
      if (TraceState::of(v) != t) {
        t->fail(absl::InvalidArgumentError("scan: the carries and xs come from different traces"));
        return nullptr;
      }
    }
  }
  if (t == nullptr) t = TraceState::current;
  return t != nullptr && t->error.ok() ? t : nullptr;
}

}  // namespace

ScanResult scan(const ScanFunction& f, const std::vector<Value>& init, const std::vector<Value>& xs,
                std::optional<int64_t> length, bool reverse) {
  ScanResult failed{std::vector<Value>(init.size()), {}};
  TraceState* t = trace_of(init, xs);
  if (t == nullptr) return failed;
  auto fail = [&](const std::string& message) {
    t->fail(absl::InvalidArgumentError(absl::StrCat("scan: ", message)));
    return failed;
  };
  std::vector<ArrayType> types;
  for (const Value& c : init) types.push_back({c.dtype(), c.shape()});
  for (size_t k = 0; k < xs.size(); ++k) {
    Shape row = xs[k].shape();
    if (row.empty()) return fail(absl::StrCat("xs ", k, " is a scalar; scan needs a leading dimension to scan over"));
    if (!length.has_value()) length = row[0];
    if (row[0] != *length) {
      return fail(absl::StrCat("xs ", k, " has ", row[0], " rows, but the length is ", *length,
                               " (every xs needs the same leading dimension)"));
    }
    row.erase(row.begin());
    types.push_back({xs[k].dtype(), row});
  }
  if (!length.has_value()) return fail("with no xs, the length must be given");
  const size_t carries = init.size();
  size_t returned = carries;  // how many carries the body gave back
  absl::StatusOr<Graph> body = trace(
      [&](const std::vector<Value>& in) {
        std::vector<Value> carry(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(carries));
        std::vector<Value> x(in.begin() + static_cast<std::ptrdiff_t>(carries), in.end());
        ScanStep step = f(carry, x);
        returned = step.carry.size();
        std::vector<Value> out = std::move(step.carry);
        out.insert(out.end(), step.ys.begin(), step.ys.end());
        return out;
      },
      types);
  if (!t->error.ok()) return failed;  // the body mixed in a value of this trace, say
  if (returned != carries) {
    return fail(absl::StrCat("the body returned ", returned, " carries for ", carries, " initial ones"));
  }
  if (!body.ok()) {
    return fail(absl::StrCat("its body: ", body.status().message(),
                             " (the body may read only its carries and xs: pass other values in them)"));
  }
  auto shared = std::make_shared<const Graph>(*std::move(body));
  std::vector<int> operands;
  for (const Value& c : init) operands.push_back(TraceState::id(c));
  for (const Value& x : xs) operands.push_back(TraceState::id(x));
  ScanResult out;
  for (size_t j = 0; j < shared->outputs().size(); ++j) {
    Node n;
    n.op = Op::kScan;
    n.operands = operands;
    n.attributes = ScanAttrs{shared, *length, reverse, static_cast<int64_t>(carries), static_cast<int64_t>(j)};
    Value v = t->make(t->graph.add_node(std::move(n)));
    if (!v.ok()) return failed;
    (j < carries ? out.carry : out.ys).push_back(v);
  }
  return out;
}

std::vector<Value> fori_loop(int64_t lower, int64_t upper, const ForiBody& body, const std::vector<Value>& init) {
  TraceState* t = trace_of(init, {});
  if (t == nullptr) return std::vector<Value>(init.size());
  TraceState* outer = TraceState::current;
  TraceState::current = t;  // the counter's constant goes into the operands' trace
  const Value i0 = full({}, static_cast<double>(lower), DType::kI32);
  TraceState::current = outer;
  std::vector<Value> carry = {i0};
  carry.insert(carry.end(), init.begin(), init.end());
  ScanResult r = scan(
      [&body](const std::vector<Value>& c, const std::vector<Value>&) {
        std::vector<Value> rest(c.begin() + 1, c.end());
        std::vector<Value> next = {c[0] + 1};
        std::vector<Value> out = body(c[0], rest);
        next.insert(next.end(), out.begin(), out.end());
        return ScanStep{next, {}};
      },
      carry, {}, std::max<int64_t>(0, upper - lower));
  return std::vector<Value>(r.carry.begin() + 1, r.carry.end());
}

}  // namespace tessera
