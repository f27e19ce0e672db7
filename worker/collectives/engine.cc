#include "worker/collectives/engine.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/slicing.h"
#include "core/status.h"
#include "worker/collectives/reduce.h"

namespace tessera {
namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

// A byte range of a buffer, cut into chunks of at most kChunkBytes (one empty chunk for an
// empty range, so every range is exactly one or more messages).
struct Range {
  int64_t offset = 0;
  int64_t bytes = 0;
  int chunks() const { return bytes == 0 ? 1 : static_cast<int>((bytes + kChunkBytes - 1) / kChunkBytes); }
  int64_t chunk_offset(int c) const { return offset + c * kChunkBytes; }
  int64_t chunk_bytes(int c) const { return std::min(kChunkBytes, bytes - c * kChunkBytes); }
};

// This device's view of its replica group.
class Group {
 public:
  Group(Transport& transport, const CollectiveRun& run, const std::vector<int>& members, int rank)
      : transport_(transport), run_(run), members_(members), rank_(rank) {}

  int n() const { return static_cast<int>(members_.size()); }
  int rank() const { return rank_; }
  int next() const { return mod(rank_ + 1, n()); }
  int prev() const { return mod(rank_ - 1, n()); }

  absl::Status send(int to, int step, int chunk, const std::byte* data, int64_t bytes) {
    const int device = members_[to];
    return transport_.send(device, run_.peers.at(device), {run_.op, step, chunk}, data, bytes, run_.deadline);
  }

  // Receives one chunk of exactly `bytes` bytes.
  absl::StatusOr<Received> receive(int from, int step, int chunk, int64_t bytes) {
    const int device = members_[from];
    absl::StatusOr<Received> data =
        transport_.receive(device, {run_.op, step, chunk}, run_.start, run_.deadline, run_.cancelled);
    if (!data.ok()) {
      return absl::Status(data.status().code(),
                          absl::StrCat(data.status().message(), " (", run_.peers.at(device), ")"));
    }
    if (data->size() != bytes) {
      return absl::DataLossError(absl::StrCat("device ", device, " sent ", data->size(), " bytes for step ", step,
                                              " chunk ", chunk, ", expected ", bytes));
    }
    return data;
  }

  absl::Status send_range(int to, int step, const std::byte* base, const Range& r) {
    for (int c = 0; c < r.chunks(); ++c) {
      TESSERA_RETURN_IF_ERROR(send(to, step, c, base + r.chunk_offset(c), r.chunk_bytes(c)));
    }
    return absl::OkStatus();
  }

  absl::Status receive_range(int from, int step, std::byte* base, const Range& r) {
    for (int c = 0; c < r.chunks(); ++c) {
      TESSERA_ASSIGN_OR_RETURN(Received data, receive(from, step, c, r.chunk_bytes(c)));
      data.copy_to(base + r.chunk_offset(c));
    }
    return absl::OkStatus();
  }

 private:
  Transport& transport_;
  const CollectiveRun& run_;
  const std::vector<int>& members_;
  const int rank_;
};

// n segments over `elements` elements, as even as integer division allows.
std::vector<Range> even_segments(int64_t elements, int64_t esize, int n) {
  std::vector<Range> out;
  for (int i = 0; i < n; ++i) {
    const int64_t begin = elements * i / n, end = elements * (i + 1) / n;
    out.push_back({begin * esize, (end - begin) * esize});
  }
  return out;
}

// Ring reduce-scatter over `segments` of `buf` (in place): afterwards segment `rank` holds
// the reduction over the group. Steps [0, n-1). When `then_all_gather`, each final chunk is
// forwarded at once as step n-1 of the all-gather ring that follows.
absl::Status ring_reduce_scatter(Group& g, DType dtype, ReduceOp op, std::byte* buf, const std::vector<Range>& seg,
                                 bool then_all_gather) {
  const int n = g.n(), r = g.rank();
  TESSERA_RETURN_IF_ERROR(g.send_range(g.next(), 0, buf, seg[mod(r - 1, n)]));
  for (int k = 0; k <= n - 2; ++k) {
    const Range& s = seg[mod(r - k - 2, n)];
    for (int c = 0; c < s.chunks(); ++c) {
      std::byte* dst = buf + s.chunk_offset(c);
      const int64_t bytes = s.chunk_bytes(c);
      TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(g.prev(), k, c, bytes));
      data.reduce_into(dtype, op, dst);
      if (k < n - 2 || then_all_gather) TESSERA_RETURN_IF_ERROR(g.send(g.next(), k + 1, c, dst, bytes));
    }
  }
  return absl::OkStatus();
}

// Ring all-gather: segment `rank` of `buf` is this device's; afterwards every segment is
// filled. Steps [first_step, first_step + n - 1). Unless `own_sent`, starts by sending its own.
absl::Status ring_all_gather(Group& g, std::byte* buf, const std::vector<Range>& seg, int first_step, bool own_sent) {
  const int n = g.n(), r = g.rank();
  if (!own_sent) TESSERA_RETURN_IF_ERROR(g.send_range(g.next(), first_step, buf, seg[r]));
  for (int k = 0; k <= n - 2; ++k) {
    const Range& s = seg[mod(r - k - 1, n)];
    for (int c = 0; c < s.chunks(); ++c) {
      std::byte* dst = buf + s.chunk_offset(c);
      const int64_t bytes = s.chunk_bytes(c);
      TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(g.prev(), first_step + k, c, bytes));
      data.copy_to(dst);
      if (k < n - 2) TESSERA_RETURN_IF_ERROR(g.send(g.next(), first_step + k + 1, c, dst, bytes));
    }
  }
  return absl::OkStatus();
}

// Direct exchange of one segment per destination: sends seg_out[j] of `out_buf` to rank j;
// calls on_receive(j, data) for each rank's message, in rank order (own included).
template <typename F>
absl::Status direct_exchange(Group& g, const std::byte* out_buf, const std::vector<Range>& seg_out,
                             const std::vector<Range>& seg_in, F&& on_receive) {
  const int n = g.n(), r = g.rank();
  for (int j = 0; j < n; ++j) {
    if (j != r) TESSERA_RETURN_IF_ERROR(g.send_range(j, 0, out_buf, seg_out[j]));
  }
  for (int j = 0; j < n; ++j) {
    if (j == r) {
      TESSERA_RETURN_IF_ERROR(on_receive(j, out_buf + seg_out[r].offset));
      continue;
    }
    std::string whole(static_cast<size_t>(seg_in[j].bytes), '\0');
    Range local{0, seg_in[j].bytes};
    TESSERA_RETURN_IF_ERROR(g.receive_range(j, 0, reinterpret_cast<std::byte*>(whole.data()), local));
    TESSERA_RETURN_IF_ERROR(on_receive(j, reinterpret_cast<const std::byte*>(whole.data())));
  }
  return absl::OkStatus();
}

// The n blocks of `shape` along `dim`, as indices.
std::vector<Index> blocks_along(const Shape& shape, int dim, int n) {
  std::vector<Index> out;
  for (int i = 0; i < n; ++i) {
    Index index;
    for (size_t d = 0; d < shape.size(); ++d) index.push_back({0, shape[d]});
    const int64_t size = shape[dim] / n;
    index[dim] = {i * size, (i + 1) * size};
    out.push_back(index);
  }
  return out;
}

// Copies `input` into n contiguous blocks along `dim` (block i = slice i), back to back.
HostArray pack_blocks(const HostArray& input, int dim, int n) {
  HostArray packed(input.dtype(), {input.size()});
  const int64_t block_bytes = input.nbytes() / std::max(n, 1);
  std::vector<Index> blocks = blocks_along(input.shape(), dim, n);
  for (int i = 0; i < n; ++i) {
    copy_block_out(input.data(), input.shape(), dtype_size(input.dtype()), blocks[i], packed.data() + i * block_bytes);
  }
  return packed;
}

// The inverse of pack_blocks into an array of `shape`: block i of `packed` goes to slice i
// along `dim`. When those blocks are contiguous in `shape` (dim 0, or only 1s before it), the
// packed buffer already is the array: it is reused, not copied.
HostArray unpack_blocks(HostArray packed, const Shape& shape, int dim, int n) {
  if (n == 1 || contiguous_block_offset(shape, blocks_along(shape, dim, n)[1]) >= 0) {
    return std::move(packed).reshaped(shape);
  }
  const DType dtype = packed.dtype();
  HostArray out(dtype, shape);
  const int64_t block_bytes = out.nbytes() / std::max(n, 1);
  std::vector<Index> blocks = blocks_along(shape, dim, n);
  for (int i = 0; i < n; ++i) {
    copy_block_in(packed.data() + i * block_bytes, shape, dtype_size(dtype), blocks[i], out.data());
  }
  return out;
}

std::vector<Range> equal_blocks(int64_t block_bytes, int n) {
  std::vector<Range> out;
  for (int i = 0; i < n; ++i) out.push_back({i * block_bytes, block_bytes});
  return out;
}

absl::StatusOr<HostArray> all_reduce(Group& g, ReduceOp op, const HostArray& in) {
  const int64_t esize = dtype_size(in.dtype());
  HostArray out = in.clone();
  if (g.n() == 1) return out;
  const bool power_of_two = (g.n() & (g.n() - 1)) == 0;
  if (in.nbytes() <= kSmallBytes && power_of_two) {
    // Recursive doubling: log2(n) rounds, one message each way per round. In round k the
    // partners hold the same partial sums of their halves and both combine lower half first,
    // so every device ends with bitwise the same result.
    HostArray partner(in.dtype(), in.shape());
    for (int k = 0, dist = 1; dist < g.n(); ++k, dist *= 2) {
      const int other = g.rank() ^ dist;
      TESSERA_RETURN_IF_ERROR(g.send(other, k, 0, out.data(), in.nbytes()));
      TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(other, k, 0, in.nbytes()));
      if (other < g.rank()) {
        data.copy_to(partner.data());
        reduce_into(in.dtype(), op, partner.data(), out.data(), in.size());
        std::swap(partner, out);
      } else {
        data.reduce_into(in.dtype(), op, out.data());
      }
    }
    return out;
  }
  if (in.nbytes() <= kSmallBytes) {
    // Everyone reduces the same contributions in rank order: identical results everywhere.
    std::vector<Range> whole(g.n(), Range{0, in.nbytes()});
    TESSERA_RETURN_IF_ERROR(direct_exchange(g, in.data(), whole, whole, [&](int j, const std::byte* data) {
      if (j == 0) {
        std::memcpy(out.data(), data, static_cast<size_t>(in.nbytes()));
      } else {
        reduce_into(in.dtype(), op, out.data(), data, in.size());
      }
      return absl::OkStatus();
    }));
    return out;
  }
  const std::vector<Range> seg = even_segments(in.size(), esize, g.n());
  TESSERA_RETURN_IF_ERROR(ring_reduce_scatter(g, in.dtype(), op, out.data(), seg, /*then_all_gather=*/true));
  TESSERA_RETURN_IF_ERROR(ring_all_gather(g, out.data(), seg, g.n() - 1, /*own_sent=*/true));
  return out;
}

absl::StatusOr<HostArray> reduce_scatter(Group& g, ReduceOp op, int dim, const HostArray& in, const Shape& out_shape) {
  const int n = g.n(), r = g.rank();
  HostArray packed = pack_blocks(in, dim, n);
  const int64_t block_bytes = in.nbytes() / n;
  const std::vector<Range> seg = equal_blocks(block_bytes, n);
  HostArray out(in.dtype(), out_shape);
  if (n > 1 && in.nbytes() <= kSmallBytes) {
    TESSERA_RETURN_IF_ERROR(direct_exchange(g, packed.data(), seg, std::vector<Range>(n, Range{0, block_bytes}),
                                            [&](int j, const std::byte* data) {
                                              if (j == 0) {
                                                std::memcpy(out.data(), data, static_cast<size_t>(block_bytes));
                                              } else {
                                                reduce_into(in.dtype(), op, out.data(), data, out.size());
                                              }
                                              return absl::OkStatus();
                                            }));
    return out;
  }
  if (n > 1) TESSERA_RETURN_IF_ERROR(ring_reduce_scatter(g, in.dtype(), op, packed.data(), seg, false));
  std::memcpy(out.data(), packed.data() + seg[r].offset, static_cast<size_t>(block_bytes));
  return out;
}

absl::StatusOr<HostArray> all_gather(Group& g, int dim, const HostArray& in, const Shape& out_shape) {
  const int n = g.n(), r = g.rank();
  const std::vector<Range> seg = equal_blocks(in.nbytes(), n);
  HostArray packed(in.dtype(), {in.size() * n});
  std::memcpy(packed.data() + seg[r].offset, in.data(), static_cast<size_t>(in.nbytes()));
  if (n > 1 && in.nbytes() * n <= kSmallBytes) {
    TESSERA_RETURN_IF_ERROR(
        direct_exchange(g, packed.data(), std::vector<Range>(n, seg[r]), seg, [&](int j, const std::byte* data) {
          if (j != r) std::memcpy(packed.data() + seg[j].offset, data, seg[j].bytes);
          return absl::OkStatus();
        }));
  } else if (n > 1) {
    TESSERA_RETURN_IF_ERROR(ring_all_gather(g, packed.data(), seg, 0, /*own_sent=*/false));
  }
  return unpack_blocks(std::move(packed), out_shape, dim, n);
}

absl::StatusOr<HostArray> all_to_all(Group& g, int split, int concat, const HostArray& in, const Shape& out_shape) {
  const int n = g.n();
  HostArray packed = pack_blocks(in, split, n);
  const int64_t block_bytes = in.nbytes() / n;
  const std::vector<Range> seg = equal_blocks(block_bytes, n);
  HostArray received(in.dtype(), {in.size()});
  TESSERA_RETURN_IF_ERROR(direct_exchange(g, packed.data(), seg, std::vector<Range>(n, Range{0, block_bytes}),
                                          [&](int j, const std::byte* data) {
                                            std::memcpy(received.data() + j * block_bytes, data, block_bytes);
                                            return absl::OkStatus();
                                          }));
  return unpack_blocks(std::move(received), out_shape, concat, n);
}

absl::StatusOr<HostArray> collective_permute(Group& g, const CollectiveRun& run, const std::vector<int>& members,
                                             const HostArray& in) {
  HostArray out = HostArray::zeros(in.dtype(), in.shape());
  const Range whole{0, in.nbytes()};
  auto rank_of = [&](int device) {
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == device) return static_cast<int>(i);
    }
    return -1;
  };
  for (const auto& [source, target] : run.spec.pairs) {
    if (source == run.self && target != run.self)
      TESSERA_RETURN_IF_ERROR(g.send_range(rank_of(target), 0, in.data(), whole));
  }
  for (const auto& [source, target] : run.spec.pairs) {
    if (target != run.self) continue;
    if (source == run.self) {
      std::memcpy(out.data(), in.data(), static_cast<size_t>(in.nbytes()));
    } else {
      TESSERA_RETURN_IF_ERROR(g.receive_range(rank_of(source), 0, out.data(), whole));
    }
  }
  return out;
}

absl::StatusOr<HostArray> broadcast(Group& g, int root, const HostArray& in) {
  const int n = g.n(), r = g.rank();
  HostArray out = in.clone();
  if (n == 1) return out;
  const Range whole{0, in.nbytes()};
  if (in.nbytes() <= kSmallBytes) {
    if (r == root) {
      for (int j = 0; j < n; ++j) {
        if (j != r) TESSERA_RETURN_IF_ERROR(g.send_range(j, 0, in.data(), whole));
      }
    } else {
      TESSERA_RETURN_IF_ERROR(g.receive_range(root, 0, out.data(), whole));
    }
    return out;
  }
  // A chain root -> root+1 -> ... pipelined per chunk.
  if (r == root) {
    TESSERA_RETURN_IF_ERROR(g.send_range(g.next(), 0, in.data(), whole));
    return out;
  }
  const bool forward = g.next() != root;
  for (int c = 0; c < whole.chunks(); ++c) {
    TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(g.prev(), 0, c, whole.chunk_bytes(c)));
    data.copy_to(out.data() + whole.chunk_offset(c));
    if (forward) TESSERA_RETURN_IF_ERROR(g.send(g.next(), 0, c, out.data() + whole.chunk_offset(c), data.size()));
  }
  return out;
}

}  // namespace

absl::StatusOr<HostArray> run_collective(Transport& transport, const CollectiveRun& run, const HostArray& input) {
  const auto [group_index, rank] = find_in_groups(run.spec, run.self);
  if (group_index < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device ", run.self, " is in none of the replica groups"));
  }
  const std::vector<int>& members = run.spec.groups[group_index];
  for (int d : members) {
    if (run.peers.count(d) == 0) return absl::InvalidArgumentError(absl::StrCat("no address for device ", d));
  }
  TESSERA_ASSIGN_OR_RETURN(Shape out_shape, collective_output_shape(run.spec, input.shape()));
  Group g(transport, run, members, rank);
  switch (run.spec.kind) {
    case CollectiveKind::kAllReduce:
      return all_reduce(g, run.spec.reduce_op, input);
    case CollectiveKind::kReduceScatter:
      return reduce_scatter(g, run.spec.reduce_op, run.spec.dimension, input, out_shape);
    case CollectiveKind::kAllGather:
      return all_gather(g, run.spec.dimension, input, out_shape);
    case CollectiveKind::kAllToAll:
      return all_to_all(g, run.spec.split_dimension, run.spec.concat_dimension, input, out_shape);
    case CollectiveKind::kCollectivePermute:
      return collective_permute(g, run, members, input);
    case CollectiveKind::kBroadcast:
      return broadcast(g, run.spec.root, input);
  }
  return absl::InvalidArgumentError("unknown collective");
}

}  // namespace tessera
