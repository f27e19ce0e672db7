#include "worker/collectives/engine.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/graph.h"
#include "core/slicing.h"
#include "core/status.h"
#include "proto/in_process.h"
#include "worker/collectives/algorithms.h"
#include "worker/collectives/reduce.h"
#include "worker/kernels/internal.h"

namespace tessera {
namespace {

int mod(int a, int n) { return ((a % n) + n) % n; }

// A byte range of a buffer, cut into chunks of at most `chunk` bytes (one empty chunk for an
// empty range, so every range is exactly one or more messages).
struct Range {
  int64_t offset = 0;
  int64_t bytes = 0;
  int64_t chunk = kChunkBytes;  // the rings': ring_chunk_bytes(path)
  int chunks() const { return bytes == 0 ? 1 : static_cast<int>((bytes + chunk - 1) / chunk); }
  int64_t chunk_offset(int c) const { return offset + c * chunk; }
  int64_t chunk_bytes(int c) const { return std::min(chunk, bytes - c * chunk); }
};

// A sender's window on one receiver for one op: at most `chunks` chunks sent and not yet taken
// there, known from acknowledgements (empty messages) that the receiver sends every `ack_every`
// chunks it took, and only those the sender will wait for. The sender of chunk c with
// c >= chunks and (c - chunks) % ack_every == 0 first waits for acknowledgement
// (c - chunks) / ack_every, which says chunks [0, c - chunks + ack_every) were taken.
struct Window {
  int chunks;
  int ack_every;
  bool waits_before(int c) const { return c >= chunks && (c - chunks) % ack_every == 0; }
  int ack_before(int c) const { return (c - chunks) / ack_every; }
  // Whether acknowledgement k is waited for (and so sent) on a range of `total` chunks.
  bool ack_needed(int k, int total) const { return k * ack_every + chunks < total; }
  // The acknowledgement the receiver owes once it took chunk c of `total`, or -1.
  int ack_after(int c, int total) const {
    const int k = c / ack_every;
    return c % ack_every == ack_every - 1 && ack_needed(k, total) ? k : -1;
  }
  // How far an exchange's sends run ahead of its receives: chunk c + lead() - 1 goes before
  // chunk c is taken, so the acknowledgement a send waits for covers only chunks the receiver
  // took in earlier rounds (and at most `chunks` are outstanding).
  int lead() const { return chunks - ack_every + 1; }
};

// The window of an exchange's sender on each receiver: the chunks (with their bookkeeping in the
// mailbox) that fit both in the receiver's share of its mailbox (`share`, --mailbox_bytes_per_peer,
// the same on every worker of a cluster) and in the link's queue (Transport::kMaxQueuedBytes),
// at least one: what the receiver files without pausing the stream or ring, and what the sender
// queues without waiting for room. A peer's share also holds its acknowledgements of what the
// other end sent it (an all_to_all goes both ways): room for 16 is kept (at most
// lead / ack_every + 1 wait at once). 31 chunks (15.5 MiB) at the default share of 64 MiB.
Window exchange_window(int64_t share) {
  const int64_t room = std::min(share, Transport::kMaxQueuedBytes) - 16 * Transport::kHeldMessageBytes;
  const int chunks = static_cast<int>(std::max<int64_t>(1, room / (kChunkBytes + Transport::kHeldMessageBytes)));
  return {chunks, std::max(1, chunks / 4)};
}

// This device's view of its replica group.
class Group {
 public:
  Group(Transport& transport, const CollectiveRun& run, const std::vector<int>& members, int rank)
      : transport_(transport), run_(run), members_(members), rank_(rank) {}

  int n() const { return static_cast<int>(members_.size()); }
  // The algorithm for `kind` over `bytes` here (see algorithms.h); a forced small all_reduce
  // algorithm applies up to one chunk (bigger single messages would exceed the wire's limit).
  Algorithm choose(CollectiveKind kind, int64_t bytes) const {
    const std::optional<Algorithm> forced = transport_.forced_all_reduce();
    if (kind == CollectiveKind::kAllReduce && forced.has_value() && n() > 1 && bytes <= kChunkBytes) {
      return chosen_ = *forced;
    }
    return chosen_ = choose_algorithm(kind, bytes, n(), path());
  }
  // The path whose threshold table chooses (algorithms.h), and the last choice (for metrics;
  // direct when nothing chose: all_to_all, collective_permute).
  Path path() const {
    if (transport_.in_process()) return Path::kInProcess;
    return transport_.shm_enabled() ? Path::kShm : Path::kGrpc;
  }
  Algorithm chosen() const { return chosen_; }
  // The chunk size of the rings here (engine.h).
  int64_t ring_chunk() const { return ring_chunk_bytes(path()); }
  // This device's window on each receiver of an exchange (see exchange_window).
  Window window() const { return exchange_window(transport_.mailbox_bytes_per_peer()); }
  int rank() const { return rank_; }
  int device(int rank) const { return members_[rank]; }
  int next() const { return mod(rank_ + 1, n()); }
  int prev() const { return mod(rank_ - 1, n()); }

  // See Transport::send for `owner`: with one, the bytes must never change afterwards.
  // `stall`: as for receive, the wait for room in the link.
  absl::Status send(int to, int step, int chunk, const std::byte* data, int64_t bytes,
                    std::shared_ptr<const void> owner, bool stall = false) {
    const int device = members_[to];
    const absl::Time stalled_at = stall ? absl::Now() + run_.stall_timeout : absl::InfiniteFuture();
    return stalled(transport_.send(device, run_.peers.at(device), {run_.op, step, chunk, run_.run_tag}, data, bytes,
                                   std::min(run_.deadline, stalled_at), std::move(owner), run_.cancelled),
                   stalled_at);
  }

  // Receives one chunk of exactly `bytes` bytes. `stall`: the wait ends at the run's stall
  // deadline from now too (CollectiveRun::stall_timeout), saying so.
  absl::StatusOr<Received> receive(int from, int step, int chunk, int64_t bytes, bool stall = false) {
    const int device = members_[from];
    const absl::Time stalled_at = stall ? absl::Now() + run_.stall_timeout : absl::InfiniteFuture();
    absl::StatusOr<Received> data =
        transport_.receive(device, run_.peers.at(device), {run_.op, step, chunk, run_.run_tag}, run_.start,
                           std::min(run_.deadline, stalled_at), run_.cancelled);
    if (!data.ok()) return stalled(data.status(), stalled_at);
    if (data->size() != bytes) {
      return absl::DataLossError(absl::StrCat("device ", device, " sent ", data->size(), " bytes for step ", step,
                                              " chunk ", chunk, ", expected ", bytes));
    }
    return data;
  }

  // The chunk (step, chunk) from `from`, of `bytes` bytes, is to be read straight to `dst` if
  // it comes through shared memory (Transport::expect_at); `owner` keeps `dst` alive.
  void expect(int from, int step, int chunk, std::byte* dst, int64_t bytes, const std::shared_ptr<const void>& owner) {
    transport_.expect_at(members_[from], {run_.op, step, chunk, run_.run_tag}, dst, bytes, owner);
  }
  void forget_expected() { transport_.forget_expected(run_.op); }

  // Instead of receive(from, step, chunk) when it would wait: see Transport::park.
  bool park(const ParkFn& park, int from, int step, int chunk) const {
    return park && park(members_[from], {run_.op, step, chunk, run_.run_tag}, run_.start);
  }

  // A wait that failed at the stall deadline `stalled_at` says so (the transport's message
  // names the member).
  absl::Status stalled(absl::Status status, absl::Time stalled_at) const {
    if (status.code() != absl::StatusCode::kDeadlineExceeded || stalled_at >= run_.deadline ||
        absl::Now() < stalled_at) {
      return status;
    }
    return absl::DeadlineExceededError(absl::StrCat(status.message(), ": no progress for ",
                                                    absl::FormatDuration(run_.stall_timeout),
                                                    ", the stall deadline (--put_stall_ms)"));
  }

  absl::Status send_range(int to, int step, const std::byte* base, const Range& r,
                          const std::shared_ptr<const void>& owner) {
    for (int c = 0; c < r.chunks(); ++c) {
      TESSERA_RETURN_IF_ERROR(send(to, step, c, base + r.chunk_offset(c), r.chunk_bytes(c), owner));
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
  mutable Algorithm chosen_ = Algorithm::kDirect;
  const CollectiveRun& run_;
  const std::vector<int>& members_;
  const int rank_;
};

// n segments over `elements` elements, as even as integer division allows, in chunks of `chunk`.
std::vector<Range> even_segments(int64_t elements, int64_t esize, int n, int64_t chunk) {
  std::vector<Range> out;
  for (int i = 0; i < n; ++i) {
    const int64_t begin = elements * i / n, end = elements * (i + 1) / n;
    out.push_back({begin * esize, (end - begin) * esize, chunk});
  }
  return out;
}

// Ring reduce-scatter over `segments`: afterwards segment `rank` of `dst` holds the
// reduction over the group of every member's `src` (`dst` may be `src`; only the segments
// this device reduces are written). Steps [0, n-1). When `then_all_gather`, each final chunk
// is forwarded at once as step n-1 of the all-gather ring that follows.
//
// Sends are zero-copy: a chunk of `dst` is sent once reduced and changes again only when the
// all-gather that follows overwrites it with the final value, which cannot arrive before the
// next device has received (and so gRPC has sent) the partial one.
absl::Status ring_reduce_scatter(Group& g, DType dtype, ReduceOp op, const std::shared_ptr<const HostArray>& src,
                                 const std::shared_ptr<HostArray>& dst, const std::vector<Range>& seg,
                                 bool then_all_gather) {
  const int n = g.n(), r = g.rank();
  TESSERA_RETURN_IF_ERROR(g.send_range(g.next(), 0, src->data(), seg[mod(r - 1, n)], src));
  for (int k = 0; k <= n - 2; ++k) {
    const Range& s = seg[mod(r - k - 2, n)];
    for (int c = 0; c < s.chunks(); ++c) {
      std::byte* out = dst->data() + s.chunk_offset(c);
      const int64_t bytes = s.chunk_bytes(c);
      TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(g.prev(), k, c, bytes));
      data.reduce(dtype, op, src->data() + s.chunk_offset(c), out);
      if (k < n - 2 || then_all_gather) TESSERA_RETURN_IF_ERROR(g.send(g.next(), k + 1, c, out, bytes, dst));
    }
  }
  return absl::OkStatus();
}

// The chunks a ring all-gather receives here, in order: at step k (0 .. n - 2) chunk c of
// segment rank - k - 1 from the previous device; f(k, segment, c) for each, stopping at the
// first error. ring_all_gather receives them and ExpectAllGather expects them, so both walk
// the same chunks.
template <typename F>
absl::Status for_each_gathered_chunk(Group& g, const std::vector<Range>& seg, F&& f) {
  const int n = g.n(), r = g.rank();
  for (int k = 0; k <= n - 2; ++k) {
    const Range& s = seg[mod(r - k - 1, n)];
    for (int c = 0; c < s.chunks(); ++c) TESSERA_RETURN_IF_ERROR(f(k, s, c));
  }
  return absl::OkStatus();
}

// On shared memory, every chunk a ring all-gather (steps [first_step, first_step + n - 1) into
// `buf`) will receive is expected at its place in `buf` (Transport::expect_at) while this lives:
// the ring's reader copies it there, not into a buffer of its own that the receive copies from
// again (of the three copies a chunk took, ring in, ring out and into `buf`, two are left); what
// is left is forgotten when it goes. Those places are not written here before their chunk comes,
// and a ring all_reduce's partial sums there have been sent (copied into the ring) before the
// final value can arrive (see ring_reduce_scatter): it is made before the reduce-scatter, so
// that the final values that come during it go in place too.
class ExpectAllGather {
 public:
  ExpectAllGather(Group& g, const std::shared_ptr<HostArray>& buf, const std::vector<Range>& seg, int first_step)
      : g_(g.path() == Path::kShm ? &g : nullptr) {
    if (g_ == nullptr) return;
    for_each_gathered_chunk(g, seg, [&](int k, const Range& s, int c) {
      g.expect(g.prev(), first_step + k, c, buf->data() + s.chunk_offset(c), s.chunk_bytes(c), buf);
      return absl::OkStatus();
    }).IgnoreError();  // expect() cannot fail
  }
  ~ExpectAllGather() {
    if (g_ != nullptr) g_->forget_expected();
  }
  ExpectAllGather(const ExpectAllGather&) = delete;
  ExpectAllGather& operator=(const ExpectAllGather&) = delete;

 private:
  Group* const g_;
};

// Ring all-gather: segment `rank` of `buf` is this device's; afterwards every segment is
// filled. Steps [first_step, first_step + n - 1). Unless `own_sent`, starts by sending its own.
// Sends are zero-copy: no segment changes once it is complete. The caller holds an
// ExpectAllGather of the same steps.
absl::Status ring_all_gather(Group& g, const std::shared_ptr<HostArray>& buf, const std::vector<Range>& seg,
                             int first_step, bool own_sent) {
  if (!own_sent) TESSERA_RETURN_IF_ERROR(g.send_range(g.next(), first_step, buf->data(), seg[g.rank()], buf));
  return for_each_gathered_chunk(g, seg, [&](int k, const Range& s, int c) -> absl::Status {
    std::byte* dst = buf->data() + s.chunk_offset(c);
    const int64_t bytes = s.chunk_bytes(c);
    TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(g.prev(), first_step + k, c, bytes));
    data.copy_to(dst);
    if (k < g.n() - 2) TESSERA_RETURN_IF_ERROR(g.send(g.next(), first_step + k + 1, c, dst, bytes, buf));
    return absl::OkStatus();
  });
}

// One member's part of an exchange: a range of chunks to or from the member at `rank`.
struct Flow {
  int rank;
  Range range;
};

// Sends `sends` (ranges of `out`, zero-copy: it must not change) and takes `receives` in
// rounds: round c takes chunk c of each range of `receives` in order (on_chunk(rank, offset in
// the range, data); this device's own rank is on_own(offset, bytes) in its place), after sending
// each range of `sends` up to chunk c + lead - 1. A receiver has at most a window of the op's
// chunks from this sender outstanding (acknowledged in step `step` + 1, data in `step`), so on a
// cycle of members that each send before they receive (a shifted permute, an all_to_all) no send
// waits for a receiver that is itself waiting to send, whatever the size: a send in round c
// waits only for chunks its receiver took in rounds before c, and a receive in round c only for
// sends of round c or before. Sender and receiver see one range at both ends.
// On a range of more than one chunk both ends first tell the other their window (exchange_window
// of their own share; a message of step `step` + 2, chunk 0 from the sender, chunk 1 from the
// receiver, neither waiting for anything) and both use the smaller: members whose shares differ
// agree on the acknowledgements, and no sender passes its receiver's share (which would pause the
// stream that carries the sender's acknowledgements of the receiver's own data).
template <typename Own, typename Chunk>
absl::Status exchange_in_windows(Group& g, int step, const std::shared_ptr<const HostArray>& out,
                                 const std::vector<Flow>& sends, const std::vector<Flow>& receives, Own&& on_own,
                                 Chunk&& on_chunk) {
  const Window mine = g.window();
  const int lead = mine.lead();  // the largest of any agreed window
  auto send_window = [&](int rank, int chunk) {
    const int32_t w = mine.chunks;
    return g.send(rank, step + 2, chunk, reinterpret_cast<const std::byte*>(&w), sizeof(w), nullptr);
  };
  auto agree = [&](int rank, int chunk) -> absl::StatusOr<Window> {
    int32_t w = 0;
    TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(rank, step + 2, chunk, sizeof(w)));
    data.copy_to(reinterpret_cast<std::byte*>(&w));
    if (w < 1) return absl::DataLossError(absl::StrCat("device ", g.device(rank), " sent a window of ", w, " chunks"));
    const int chunks = std::min(mine.chunks, static_cast<int>(w));
    return Window{chunks, std::max(1, chunks / 4)};
  };
  int rounds = 0;
  for (const Flow& f : receives) {
    rounds = std::max(rounds, f.range.chunks());
    if (f.rank != g.rank() && f.range.chunks() > 1) TESSERA_RETURN_IF_ERROR(send_window(f.rank, 1));
  }
  for (const Flow& f : sends) rounds = std::max(rounds, f.range.chunks());
  std::vector<Window> to(sends.size(), mine), from(receives.size(), mine);  // agreed windows
  std::vector<int> sent(sends.size(), 0);
  std::vector<bool> agreed(sends.size(), false);
  for (int c = 1 - lead; c < rounds; ++c) {
    for (size_t i = 0; i < sends.size(); ++i) {
      const Flow& f = sends[i];
      for (int& s = sent[i]; s < f.range.chunks() && s <= c + lead - 1; ++s) {
        if (s == 0 && f.range.chunks() > 1) TESSERA_RETURN_IF_ERROR(send_window(f.rank, 0));
        if (s == 1 && !agreed[i]) {
          TESSERA_ASSIGN_OR_RETURN(to[i], agree(f.rank, 1));
          agreed[i] = true;
        }
        if (s > c + to[i].lead() - 1) break;
        if (to[i].waits_before(s)) {
          TESSERA_RETURN_IF_ERROR(g.receive(f.rank, step + 1, to[i].ack_before(s), 0).status());
        }
        TESSERA_RETURN_IF_ERROR(
            g.send(f.rank, step, s, out->data() + f.range.chunk_offset(s), f.range.chunk_bytes(s), out));
      }
    }
    for (size_t i = 0; i < receives.size(); ++i) {
      const Flow& f = receives[i];
      if (c < 0 || c >= f.range.chunks()) continue;
      const int64_t offset = f.range.chunk_offset(c) - f.range.offset, bytes = f.range.chunk_bytes(c);
      if (f.rank == g.rank()) {
        on_own(offset, bytes);
        continue;
      }
      if (c == 0 && f.range.chunks() > 1) {
        TESSERA_ASSIGN_OR_RETURN(from[i], agree(f.rank, 0));
      }
      TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(f.rank, step, c, bytes));
      on_chunk(f.rank, offset, data);
      if (const int k = from[i].ack_after(c, f.range.chunks()); k >= 0) {
        static constexpr std::byte kNothing{};
        TESSERA_RETURN_IF_ERROR(g.send(f.rank, step + 1, k, &kNothing, 0, nullptr));
      }
    }
  }
  return absl::OkStatus();
}

// Direct exchange of one segment per member (exchange_in_windows): sends seg_out[j] of `out`
// (zero-copy; it must not change) to rank j and takes seg_in[j] from it, chunk by chunk in
// rank order: on_own(offset, bytes) for this device's own part of seg_in, on_chunk(j, offset
// in seg_in[j], data) for each chunk from rank j. Steps `step` to `step` + 2.
template <typename Own, typename Chunk>
absl::Status direct_exchange(Group& g, const std::shared_ptr<const HostArray>& out, const std::vector<Range>& seg_out,
                             const std::vector<Range>& seg_in, Own&& on_own, Chunk&& on_chunk, int step = 0) {
  const int n = g.n(), r = g.rank();
  std::vector<Flow> sends, receives;
  for (int j = 0; j < n; ++j) {
    if (j != r) sends.push_back({j, seg_out[j]});
    receives.push_back({j, seg_in[j]});
  }
  return exchange_in_windows(g, step, out, sends, receives, std::forward<Own>(on_own), std::forward<Chunk>(on_chunk));
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
// packed buffer already is the array: it is reused (same memory, so zero-copy sends from it
// stay valid), not copied.
std::shared_ptr<const HostArray> unpack_blocks(const std::shared_ptr<HostArray>& packed, const Shape& shape, int dim,
                                               int n) {
  if (n == 1 || contiguous_block_offset(shape, blocks_along(shape, dim, n)[1]) >= 0) {
    *packed = std::move(*packed).reshaped(shape);
    return packed;
  }
  const DType dtype = packed->dtype();
  auto out = std::make_shared<HostArray>(dtype, shape);
  const int64_t block_bytes = out->nbytes() / std::max(n, 1);
  std::vector<Index> blocks = blocks_along(shape, dim, n);
  for (int i = 0; i < n; ++i) {
    copy_block_in(packed->data() + i * block_bytes, shape, dtype_size(dtype), blocks[i], out->data());
  }
  return out;
}

// n blocks of `block_bytes` back to back, in chunks of `chunk`.
std::vector<Range> equal_blocks(int64_t block_bytes, int n, int64_t chunk = kChunkBytes) {
  std::vector<Range> out;
  for (int i = 0; i < n; ++i) out.push_back({i * block_bytes, block_bytes, chunk});
  return out;
}

using ArrayPtr = std::shared_ptr<const HostArray>;

// Each algorithm's messages use steps of their own (see algorithms.h); the tree's are below 100.
constexpr int kRecursiveDoublingStep = 100;
constexpr int kDirectAllReduceStep = 200;

// Recursive doubling: the p = 2^floor(log2 n) first ranks exchange whole buffers with the
// rank that differs in bit k, for each bit (log2 p rounds, one message each way per round);
// the n - p others first hand theirs to rank r - p and get the result back from it. Both
// partners of a round combine the same two values, and the ops commute exactly, so every
// member ends with bitwise the same bytes. Sends copy (`out` changes afterwards).
absl::StatusOr<ArrayPtr> recursive_doubling_all_reduce(Group& g, ReduceOp op, const ArrayPtr& in) {
  const DType dtype = in->dtype();
  const int64_t bytes = in->nbytes();
  const int n = g.n(), r = g.rank();
  int p = 1;
  while (p * 2 <= n) p *= 2;
  constexpr int kFold = kRecursiveDoublingStep, kUnfold = kRecursiveDoublingStep + 63;
  auto out = std::make_shared<HostArray>(in->clone());
  if (r >= p) {
    TESSERA_RETURN_IF_ERROR(g.send(r - p, kFold, 0, out->data(), bytes, nullptr));
    TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(r - p, kUnfold, 0, bytes));
    data.copy_to(out->data());
    return out;
  }
  if (r + p < n) {
    TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(r + p, kFold, 0, bytes));
    data.reduce_into(dtype, op, out->data());
  }
  for (int k = 0, bit = 1; bit < p; ++k, bit *= 2) {
    TESSERA_RETURN_IF_ERROR(g.send(r ^ bit, kFold + 1 + k, 0, out->data(), bytes, nullptr));
    TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(r ^ bit, kFold + 1 + k, 0, bytes));
    data.reduce_into(dtype, op, out->data());
  }
  if (r + p < n) TESSERA_RETURN_IF_ERROR(g.send(r + p, kUnfold, 0, out->data(), bytes, nullptr));
  return out;
}

// Direct: every member sends its buffer to every other (one round, n(n-1) messages) and
// reduces the n buffers in rank order, so every member gets bitwise the same bytes.
absl::StatusOr<ArrayPtr> direct_all_reduce(Group& g, ReduceOp op, const ArrayPtr& in) {
  const DType dtype = in->dtype();
  const int64_t bytes = in->nbytes();
  auto out = std::make_shared<HostArray>(dtype, in->shape());
  const std::vector<Range> whole(g.n(), Range{0, bytes});
  TESSERA_RETURN_IF_ERROR(direct_exchange(
      g, in, whole, whole,
      [&](int64_t offset, int64_t size) {
        if (g.rank() == 0) {
          std::memcpy(out->data() + offset, in->data() + offset, static_cast<size_t>(size));
        } else {
          reduce_into(dtype, op, out->data() + offset, in->data() + offset, size / dtype_size(dtype));
        }
      },
      [&](int j, int64_t offset, const Received& data) {
        if (j == 0) {
          data.copy_to(out->data() + offset);
        } else {
          data.reduce(dtype, op, out->data() + offset, out->data() + offset);
        }
      },
      kDirectAllReduceStep));
  return out;
}

// Binomial tree: reduce to rank 0 in ceil(log2 n) rounds, then broadcast back down the same
// tree: 2(n-1) messages, where recursive doubling sends n log2 n (14 against 24 on 8 devices).
// Small messages cost CPU (syscalls, gRPC, thread wake-ups) rather than wire time, and on a
// host running several workers per core the fewer messages win. Everyone gets rank 0's bytes:
// bitwise the same result. Sends copy (`out` changes afterwards).
// Kept as a state (the next reduce round, or the broadcast) so that a run can park at a
// receive and continue later from there (SteppedCollective); without `park` it waits.
class TreeAllReduce {
 public:
  TreeAllReduce(ReduceOp op, const ArrayPtr& in) : op_(op), out_(std::make_shared<HostArray>(in->clone())) {}

  // The result, or nullptr when it parked at a receive (advance again once resumed).
  absl::StatusOr<ArrayPtr> advance(Group& g, const ParkFn& park) {
    const int n = g.n(), r = g.rank();
    const int64_t bytes = out_->nbytes();
    for (int dist = 1 << round_; !broadcasting_ && dist < n; ++round_, dist *= 2) {
      if (r % (2 * dist) != 0) {
        TESSERA_RETURN_IF_ERROR(g.send(r - dist, round_, 0, out_->data(), bytes, nullptr));
        break;
      }
      if (r + dist < n) {
        if (g.park(park, r + dist, round_, 0)) return nullptr;
        TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(r + dist, round_, 0, bytes));
        data.reduce_into(out_->dtype(), op_, out_->data());
      }
    }
    broadcasting_ = true;
    constexpr int kBroadcastStep = 64;  // after every reduce step (n < 2^64)
    int below = 1;                      // children are r + d for powers of two d < below
    if (r == 0) {
      while (below < n) below *= 2;
    } else {
      below = r & -r;
      if (g.park(park, r - below, kBroadcastStep, 0)) return nullptr;
      TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(r - below, kBroadcastStep, 0, bytes));
      data.copy_to(out_->data());
    }
    for (int d = below / 2; d >= 1; d /= 2) {
      if (r + d < n) TESSERA_RETURN_IF_ERROR(g.send(r + d, kBroadcastStep, 0, out_->data(), bytes, nullptr));
    }
    return ArrayPtr(out_);
  }

 private:
  const ReduceOp op_;
  const std::shared_ptr<HostArray> out_;
  int round_ = 0;  // the reduce round to do next
  bool broadcasting_ = false;
};

absl::StatusOr<ArrayPtr> all_reduce(Group& g, ReduceOp op, const ArrayPtr& in) {
  const DType dtype = in->dtype();
  const int64_t bytes = in->nbytes();
  if (g.n() == 1) return in;
  const Algorithm algorithm = g.choose(CollectiveKind::kAllReduce, bytes);
  if (algorithm == Algorithm::kRecursiveDoubling) return recursive_doubling_all_reduce(g, op, in);
  if (algorithm == Algorithm::kDirect) return direct_all_reduce(g, op, in);
  if (algorithm == Algorithm::kTree) return TreeAllReduce(op, in).advance(g, nullptr);
  auto out = std::make_shared<HostArray>(dtype, in->shape());
  // The ring reads this device's contributions from `in` and writes every byte of `out`.
  const std::vector<Range> seg = even_segments(in->size(), dtype_size(dtype), g.n(), g.ring_chunk());
  const ExpectAllGather expect(g, out, seg, g.n() - 1);
  TESSERA_RETURN_IF_ERROR(ring_reduce_scatter(g, dtype, op, in, out, seg, /*then_all_gather=*/true));
  TESSERA_RETURN_IF_ERROR(ring_all_gather(g, out, seg, g.n() - 1, /*own_sent=*/true));
  return out;
}

absl::StatusOr<ArrayPtr> reduce_scatter(Group& g, ReduceOp op, int dim, const ArrayPtr& in, const Shape& out_shape) {
  const int n = g.n(), r = g.rank();
  const DType dtype = in->dtype();
  auto packed = std::make_shared<HostArray>(pack_blocks(*in, dim, n));
  const int64_t block_bytes = in->nbytes() / n;
  const bool direct = n > 1 && g.choose(CollectiveKind::kReduceScatter, in->nbytes()) == Algorithm::kDirect;
  const std::vector<Range> seg = equal_blocks(block_bytes, n, direct ? kChunkBytes : g.ring_chunk());
  auto out = std::make_shared<HostArray>(dtype, out_shape);
  if (direct) {
    TESSERA_RETURN_IF_ERROR(direct_exchange(
        g, packed, seg, std::vector<Range>(n, Range{0, block_bytes}),
        [&](int64_t offset, int64_t size) {
          const std::byte* own = packed->data() + seg[r].offset + offset;
          if (r == 0) {
            std::memcpy(out->data() + offset, own, static_cast<size_t>(size));
          } else {
            reduce_into(dtype, op, out->data() + offset, own, size / dtype_size(dtype));
          }
        },
        [&](int j, int64_t offset, const Received& data) {
          if (j == 0) {
            data.copy_to(out->data() + offset);
          } else {
            data.reduce(dtype, op, out->data() + offset, out->data() + offset);
          }
        }));
    return out;
  }
  if (n > 1) TESSERA_RETURN_IF_ERROR(ring_reduce_scatter(g, dtype, op, packed, packed, seg, false));
  std::memcpy(out->data(), packed->data() + seg[r].offset, static_cast<size_t>(block_bytes));
  return out;
}

absl::StatusOr<ArrayPtr> all_gather(Group& g, int dim, const ArrayPtr& in, const Shape& out_shape) {
  const int n = g.n(), r = g.rank();
  const bool direct = n > 1 && g.choose(CollectiveKind::kAllGather, in->nbytes() * n) == Algorithm::kDirect;
  const std::vector<Range> seg = equal_blocks(in->nbytes(), n, direct ? kChunkBytes : g.ring_chunk());
  auto packed = std::make_shared<HostArray>(in->dtype(), Shape{in->size() * n});
  std::memcpy(packed->data() + seg[r].offset, in->data(), static_cast<size_t>(in->nbytes()));
  if (direct) {
    TESSERA_RETURN_IF_ERROR(direct_exchange(
        g, in, std::vector<Range>(n, Range{0, in->nbytes()}), seg, [](int64_t, int64_t) {},
        [&](int j, int64_t offset, const Received& data) { data.copy_to(packed->data() + seg[j].offset + offset); }));
  } else if (n > 1) {
    const ExpectAllGather expect(g, packed, seg, 0);
    TESSERA_RETURN_IF_ERROR(ring_all_gather(g, packed, seg, 0, /*own_sent=*/false));
  }
  return unpack_blocks(packed, out_shape, dim, n);
}

absl::StatusOr<ArrayPtr> all_to_all(Group& g, int split, int concat, const ArrayPtr& in, const Shape& out_shape) {
  const int n = g.n(), r = g.rank();
  auto packed = std::make_shared<const HostArray>(pack_blocks(*in, split, n));
  const int64_t block_bytes = in->nbytes() / n;
  const std::vector<Range> seg = equal_blocks(block_bytes, n);
  auto received = std::make_shared<HostArray>(in->dtype(), Shape{in->size()});
  TESSERA_RETURN_IF_ERROR(direct_exchange(
      g, packed, seg, std::vector<Range>(n, Range{0, block_bytes}),
      [&](int64_t offset, int64_t size) {
        std::memcpy(received->data() + r * block_bytes + offset, packed->data() + seg[r].offset + offset,
                    static_cast<size_t>(size));
      },
      [&](int j, int64_t offset, const Received& data) { data.copy_to(received->data() + j * block_bytes + offset); }));
  return unpack_blocks(received, out_shape, concat, n);
}

// ragged_all_to_all's index arrays' values, as int64 (the type rule admits any integer dtype).
std::vector<int64_t> integers(const HostArray& a) {
  return internal::visit_dtype(a.dtype(), [&a](auto zero) {
    using T = decltype(zero);
    std::vector<int64_t> out;
    if constexpr (internal::kIsInt<T>) {
      for (T v : a.values<T>()) out.push_back(static_cast<int64_t>(v));
    }
    return out;
  });
}

// lax.ragged_all_to_all (core/op.h), as jax/_src/lax/parallel.py's docstring defines it: slice
// i = rows [input_offsets[i], +send_sizes[i]) of `operand` goes to the member at rank
// i / (K / n), which writes it at rows [output_offsets[i], +send_sizes[i]) (the sender's
// offsets) of its copy of `output`; the receiver's recv_sizes must be the sizes it gets. Each
// peer gets two messages: step 0 the (output offset, rows) of its K / n slices as int64 pairs,
// step 1 their rows back to back. Writes apply in the docstring's order (sender rank, then
// slice), so a later slice wins where two overlap.
//
// Every offset and size is checked before anything is sent or written: a slice outside the
// operand, or outside the output it is written to (every device's output has one shape), fails
// this device naming it, the slice, the values and the rule; so does a received header that
// disagrees with recv_sizes or (from the wire) falls outside the output.
absl::StatusOr<ArrayPtr> ragged_all_to_all(Group& g, const ArrayPtr& operand, const std::vector<ArrayPtr>& more) {
  const int n = g.n(), r = g.rank();
  const std::string here = absl::StrCat("ragged_all_to_all on device ", g.device(r));
  if (more.size() != 5) {
    return absl::InvalidArgumentError(absl::StrCat(
        here, ": takes six operands (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes), got ",
        more.size() + 1, "; it runs only as a shard_map body's instruction"));
  }
  const HostArray& output = *more[0];
  const Shape &in_shape = operand->shape(), &out_shape = output.shape();
  if (operand->dtype() != output.dtype() || in_shape.empty() || in_shape.size() != out_shape.size() ||
      !std::equal(in_shape.begin() + 1, in_shape.end(), out_shape.begin() + 1)) {
    return absl::InvalidArgumentError(absl::StrCat(here, ": operand ", type_to_string(operand->dtype(), in_shape),
                                                   " and output ", type_to_string(output.dtype(), out_shape),
                                                   " must have one dtype and the same dimensions after the first"));
  }
  static constexpr const char* kNames[] = {"input_offsets", "send_sizes", "output_offsets", "recv_sizes"};
  std::vector<std::vector<int64_t>> index;
  for (int k = 0; k < 4; ++k) {
    const HostArray& a = *more[1 + k];
    if (is_floating(a.dtype()) || a.dtype() == DType::kBool || a.shape().size() != 1 || a.shape() != more[1]->shape() ||
        a.size() == 0 || a.size() % n != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          here, ": ", kNames[k], " is ", type_to_string(a.dtype(), a.shape()),
          "; the four index arrays must be integer vectors of one positive length divisible by the group's ", n,
          " devices"));
    }
    index.push_back(integers(a));
  }
  const std::vector<int64_t>&input_offsets = index[0], &send_sizes = index[1], &output_offsets = index[2],
        &recv_sizes = index[3];
  const int64_t slices = static_cast<int64_t>(input_offsets.size()) / n;  // per peer
  const int64_t rows_in = in_shape[0], rows_out = out_shape[0];
  int64_t row = dtype_size(operand->dtype());  // bytes per row
  for (size_t d = 1; d < in_shape.size(); ++d) row *= in_shape[d];
  for (size_t i = 0; i < input_offsets.size(); ++i) {
    const int64_t in = input_offsets[i], size = send_sizes[i], at = output_offsets[i];
    const int to = g.device(static_cast<int>(static_cast<int64_t>(i) / slices));
    if (size < 0 || in < 0 || in > rows_in - size) {
      return absl::InvalidArgumentError(
          absl::StrCat(here, ": slice ", i, " (to device ", to, ") is input_offsets[", i, "] = ", in, ", send_sizes[",
                       i, "] = ", size, ": rows [", in, ", ", in + size, ") of the operand's ", rows_in,
                       " must be a range inside it (offset >= 0, size >= 0, offset + size <= ", rows_in, ")"));
    }
    if (at < 0 || at > rows_out - size) {
      return absl::InvalidArgumentError(absl::StrCat(
          here, ": slice ", i, " (to device ", to, ") is output_offsets[", i, "] = ", at, ", send_sizes[", i,
          "] = ", size, ": rows [", at, ", ", at + size, ") of device ", to, "'s output must be a range inside its ",
          rows_out, " rows (offset >= 0, offset + size <= ", rows_out, ")"));
    }
    if (recv_sizes[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(here, ": recv_sizes[", i, "] = ", recv_sizes[i], " must be >= 0"));
    }
  }
  // What goes to member j: its slices' headers and rows.
  auto slice_range = [&](int j) { return std::pair<int64_t, int64_t>{j * slices, (j + 1) * slices}; };
  for (int j = 0; j < n; ++j) {
    if (j == r) continue;
    const auto [begin, end] = slice_range(j);
    auto header = std::make_shared<HostArray>(DType::kI64, Shape{2 * slices});
    absl::Span<int64_t> h = header->mutable_values<int64_t>();
    int64_t rows = 0;
    for (int64_t i = begin; i < end; ++i) {
      h[2 * (i - begin)] = output_offsets[i];
      h[2 * (i - begin) + 1] = send_sizes[i];
      rows += send_sizes[i];
    }
    auto data = std::make_shared<HostArray>(DType::kU8, Shape{rows * row});
    int64_t at = 0;
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(data->data() + at, operand->data() + input_offsets[i] * row,
                  static_cast<size_t>(send_sizes[i] * row));
      at += send_sizes[i] * row;
    }
    TESSERA_RETURN_IF_ERROR(g.send_range(j, 0, header->data(), Range{0, header->nbytes()}, header));
    TESSERA_RETURN_IF_ERROR(g.send_range(j, 1, data->data(), Range{0, data->nbytes()}, data));
  }
  auto result = std::make_shared<HostArray>(output.clone());
  // The received slices of each member, in rank order: (output offset, rows, bytes).
  struct Slice {
    int64_t at, rows;
    const std::byte* bytes;
  };
  std::vector<std::vector<std::byte>> received(n);
  std::vector<std::vector<Slice>> from(n);
  for (int j = 0; j < n; ++j) {
    const auto [begin, end] = slice_range(j);
    if (j == r) {
      for (int64_t i = begin; i < end; ++i) {
        from[j].push_back({output_offsets[i], send_sizes[i], operand->data() + input_offsets[i] * row});
      }
      continue;
    }
    std::vector<int64_t> header(static_cast<size_t>(2 * slices));
    TESSERA_RETURN_IF_ERROR(g.receive_range(j, 0, reinterpret_cast<std::byte*>(header.data()),
                                            Range{0, static_cast<int64_t>(header.size() * sizeof(int64_t))}));
    int64_t rows = 0;
    for (int64_t s = 0; s < slices; ++s) {
      const int64_t at = header[2 * s], size = header[2 * s + 1], i = begin + s;
      if (size != recv_sizes[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat(here, ": device ", g.device(j), " sends ", size, " rows as its slice ", r * slices + s,
                         " but recv_sizes[", i, "] here is ", recv_sizes[i],
                         ": each device's send_sizes must equal all_to_all(recv_sizes, axis_name, 0, 0, tiled=True)"));
      }
      if (size < 0 || at < 0 || at > rows_out - size) {
        return absl::InvalidArgumentError(absl::StrCat(here, ": device ", g.device(j), " sends rows [", at, ", ",
                                                       at + size, ") for an output of ", rows_out, " rows"));
      }
      rows += size;
    }
    received[j].resize(static_cast<size_t>(rows * row));
    TESSERA_RETURN_IF_ERROR(g.receive_range(j, 1, received[j].data(), Range{0, rows * row}));
    int64_t offset = 0;
    for (int64_t s = 0; s < slices; ++s) {
      from[j].push_back({header[2 * s], header[2 * s + 1], received[j].data() + offset});
      offset += header[2 * s + 1] * row;
    }
  }
  for (int j = 0; j < n; ++j) {
    for (const Slice& s : from[j]) {
      std::memcpy(result->data() + s.at * row, s.bytes, static_cast<size_t>(s.rows * row));
    }
  }
  return result;
}

// Each device sends its buffer to its targets and takes its source's, in windows
// (exchange_in_windows): a shifted permute is a cycle, whose members all send before they receive.
absl::StatusOr<ArrayPtr> collective_permute(Group& g, const CollectiveRun& run, const std::vector<int>& members,
                                            const ArrayPtr& in) {
  const Range whole{0, in->nbytes()};
  auto rank_of = [&](int device) {
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == device) return static_cast<int>(i);
    }
    return -1;
  };
  std::vector<Flow> sends, receives;
  bool own = false;
  for (const auto& [source, target] : run.spec.pairs) {
    if (source == run.self && target != run.self) sends.push_back({rank_of(target), whole});
    if (target == run.self && receives.empty() && !own) {
      if (source == run.self) {
        own = true;
      } else {
        receives.push_back({rank_of(source), whole});
      }
    }
  }
  std::shared_ptr<HostArray> out;
  if (!receives.empty()) out = std::make_shared<HostArray>(in->dtype(), in->shape());
  TESSERA_RETURN_IF_ERROR(exchange_in_windows(
      g, 0, in, sends, receives, [](int64_t, int64_t) {},
      [&](int, int64_t offset, const Received& data) { data.copy_to(out->data() + offset); }));
  if (own) return in;
  if (out != nullptr) return ArrayPtr(out);
  return std::make_shared<const HostArray>(HostArray::zeros(in->dtype(), in->shape()));
}

// The chain's flow control. Each member forwards chunk c only once its successor acknowledged
// every chunk before c - kChainWindow + 1, so at most kChainWindow chunks (16 MiB) of one op
// wait in a member's mailbox whatever the speed downstream: without it, a member held up by a
// slow successor kept receiving (the shared-memory reader drains its ring into the mailbox)
// until the mailbox's share of its predecessor overflowed (a 256 MiB broadcast, or a put's
// fan-out, failed RESOURCE_EXHAUSTED). An acknowledgement is an empty message of step
// kChainAckStep every 8 chunks, sent only when the predecessor will wait for it (Window).
constexpr Window kChainWindow{32, 8};
constexpr int kChainAckStep = 1;

// Both waits are on the successor's progress: each ends at the run's stall deadline too.
absl::Status chain_send(Group& g, int c, const std::byte* data, int64_t bytes, std::shared_ptr<const void> owner) {
  if (kChainWindow.waits_before(c)) {
    TESSERA_RETURN_IF_ERROR(g.receive(g.next(), kChainAckStep, kChainWindow.ack_before(c), 0, /*stall=*/true).status());
  }
  return g.send(g.next(), 0, c, data, bytes, std::move(owner), /*stall=*/true);
}

// The root sends each chunk once input_ready (CollectiveRun::input_ready, if set) says its bytes
// are in, so that a chain forwards the start of a put while the rest is still arriving.
absl::StatusOr<ArrayPtr> broadcast(Group& g, int root, const ArrayPtr& in, std::shared_ptr<HostArray> into,
                                   const std::function<absl::Status(int64_t)>& input_ready) {
  const int n = g.n(), r = g.rank();
  const Range whole{0, in->nbytes()};
  const int chunks = whole.chunks();
  if (n == 1) {
    if (input_ready) TESSERA_RETURN_IF_ERROR(input_ready(whole.bytes));
    return in;
  }
  const bool direct = g.choose(CollectiveKind::kBroadcast, in->nbytes()) == Algorithm::kDirect;
  if (r == root) {
    for (int c = 0; c < chunks; ++c) {
      const int64_t offset = whole.chunk_offset(c), bytes = whole.chunk_bytes(c);
      if (input_ready) TESSERA_RETURN_IF_ERROR(input_ready(offset + bytes));
      if (!direct) {
        // A chain root -> root+1 -> ... pipelined per chunk.
        TESSERA_RETURN_IF_ERROR(chain_send(g, c, in->data() + offset, bytes, in));
        continue;
      }
      for (int j = 0; j < n; ++j) {
        if (j != r) TESSERA_RETURN_IF_ERROR(g.send(j, 0, c, in->data() + offset, bytes, in, /*stall=*/true));
      }
    }
    return in;
  }
  std::shared_ptr<HostArray> out =
      into != nullptr ? std::move(into) : std::make_shared<HostArray>(in->dtype(), in->shape());
  if (direct) {
    TESSERA_RETURN_IF_ERROR(g.receive_range(root, 0, out->data(), whole));
    return out;
  }
  const bool forward = g.next() != root;
  for (int c = 0; c < chunks; ++c) {
    std::byte* dst = out->data() + whole.chunk_offset(c);
    TESSERA_ASSIGN_OR_RETURN(Received data, g.receive(g.prev(), 0, c, whole.chunk_bytes(c)));
    data.copy_to(dst);
    if (forward) TESSERA_RETURN_IF_ERROR(chain_send(g, c, dst, data.size(), out));
    if (const int k = kChainWindow.ack_after(c, chunks); k >= 0) {
      static constexpr std::byte kNothing{};
      TESSERA_RETURN_IF_ERROR(g.send(g.prev(), kChainAckStep, k, &kNothing, 0, nullptr));
    }
  }
  return out;
}

// The replica group of `run.self` and its rank there; INVALID_ARGUMENT if it is in none, or a
// member has no address.
absl::StatusOr<std::pair<const std::vector<int>*, int>> group_of(const CollectiveRun& run) {
  const auto [group_index, rank] = find_in_groups(run.spec, run.self);
  if (group_index < 0) {
    return absl::InvalidArgumentError(absl::StrCat("device ", run.self, " is in none of the replica groups"));
  }
  const std::vector<int>& members = run.spec.groups[group_index];
  for (int d : members) {
    if (run.peers.count(d) == 0) return absl::InvalidArgumentError(absl::StrCat("no address for device ", d));
  }
  return std::make_pair(&members, rank);
}

}  // namespace

struct SteppedCollective::State {
  State(Transport& t, CollectiveRun r, std::vector<int> m, int rank, const ArrayPtr& input)
      : transport(t),
        run(std::move(r)),
        members(std::move(m)),
        group(t, run, members, rank),
        tree(run.spec.reduce_op, input),
        start(absl::Now()),
        bytes(input->nbytes()) {}
  Transport& transport;
  const CollectiveRun run;
  const std::vector<int> members;
  Group group;  // refers to run and members
  TreeAllReduce tree;
  const absl::Time start;
  const int64_t bytes;
};

absl::StatusOr<std::unique_ptr<SteppedCollective>> SteppedCollective::start(Transport& transport, CollectiveRun run,
                                                                            std::shared_ptr<const HostArray> input) {
  // Profiled runs keep run_collective's span, which lasts on one thread.
  if (run.spec.kind != CollectiveKind::kAllReduce || transport.profile().on()) return nullptr;
  TESSERA_ASSIGN_OR_RETURN(auto group, group_of(run));
  TESSERA_RETURN_IF_ERROR(collective_output_shape(run.spec, input->shape()).status());
  // Only sends filed straight into a peer's mailbox never wait (a link's may, for room).
  for (int d : *group.first) {
    if (!is_in_process_address(run.peers.at(d))) return nullptr;
  }
  auto state = std::make_unique<State>(transport, std::move(run), *group.first, group.second, input);
  if (state->group.n() == 1 || state->group.choose(CollectiveKind::kAllReduce, input->nbytes()) != Algorithm::kTree) {
    return nullptr;
  }
  return std::unique_ptr<SteppedCollective>(new SteppedCollective(std::move(state)));
}

SteppedCollective::SteppedCollective(std::unique_ptr<State> state) : state_(std::move(state)) {}

SteppedCollective::~SteppedCollective() = default;

absl::StatusOr<std::shared_ptr<const HostArray>> SteppedCollective::advance(const ParkFn& park) {
  State& s = *state_;
  absl::StatusOr<std::shared_ptr<const HostArray>> out = s.tree.advance(s.group, park);
  if (!out.ok() || *out != nullptr) {
    s.transport.collective_metrics().record(s.run.spec.kind, s.group.chosen(), s.group.path(), s.bytes,
                                            absl::Now() - s.start, out.ok());
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const HostArray>> run_collective(Transport& transport, const CollectiveRun& run,
                                                                std::shared_ptr<const HostArray> input) {
  TESSERA_ASSIGN_OR_RETURN(auto group, group_of(run));
  const std::vector<int>& members = *group.first;
  const int rank = group.second;
  const bool ragged = run.spec.kind == CollectiveKind::kRaggedAllToAll;
  Shape out_shape;
  if (!ragged) {
    TESSERA_ASSIGN_OR_RETURN(out_shape, collective_output_shape(run.spec, input->shape()));
  }
  Group g(transport, run, members, rank);
  const absl::Time start = absl::Now();
  const int64_t bytes = input->nbytes();
  ProfileSpan span(&transport.profile(), "collective", [&] { return collective_name(run.spec.kind); });
  absl::StatusOr<std::shared_ptr<const HostArray>> out = [&]() -> absl::StatusOr<std::shared_ptr<const HostArray>> {
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
        return broadcast(g, run.spec.root, input, run.broadcast_into, run.input_ready);
      case CollectiveKind::kRaggedAllToAll:
        return ragged_all_to_all(g, input, run.ragged_operands);
    }
    return absl::InvalidArgumentError("unknown collective");
  }();
  transport.collective_metrics().record(run.spec.kind, g.chosen(), g.path(), bytes, absl::Now() - start, out.ok());
  if (span) {
    span.arg("bytes", absl::StrCat(bytes));
    span.arg("algorithm", algorithm_name(g.chosen()));
    span.arg("path", path_name(g.path()));
    span.arg("group_size", absl::StrCat(members.size()));
    span.arg("op", absl::StrCat(run.op));
    if (!out.ok()) span.arg("error", std::string(out.status().message()));
  }
  return out;
}

}  // namespace tessera
