// Which algorithm a collective runs, by kind, size and path: the one table of thresholds.
//
// Every member of a group must choose the same algorithm, so the choice depends only on what
// they all know: the kind, the buffer size, the group size, and the path their workers are
// configured for (tessera-worker --shm; a cluster's workers run with the same flags). The
// steps of each algorithm's messages differ, so members that disagree never mix messages: their
// waits fail at the op's deadline, naming the peer.
//
//   Algorithm a = choose_algorithm(CollectiveKind::kAllReduce, 4096, 8, Path::kShm);
//   algorithm_name(a);   // "tree"
#ifndef TESSERA_WORKER_COLLECTIVES_ALGORITHMS_H_
#define TESSERA_WORKER_COLLECTIVES_ALGORITHMS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "core/collective.h"

namespace tessera {

// kInProcess: workers of one process (Client::local), each message filed straight into the
// peer's mailbox (Transport::serve_in_process).
enum class Path { kGrpc, kShm, kInProcess };

enum class Algorithm {
  kTree,               // all_reduce: binomial reduce to rank 0, broadcast back (2 log2 n rounds)
  kRecursiveDoubling,  // all_reduce: log2 n rounds of pairwise exchange
  kDirect,             // one message to each peer, one round
  kRing,               // bandwidth-optimal ring, pipelined in chunks
  kChain,              // broadcast: pipelined chain from the root
};

inline const char* path_name(Path p) {
  switch (p) {
    case Path::kGrpc:
      return "grpc";
    case Path::kShm:
      return "shm";
    case Path::kInProcess:
      return "in_process";
  }
  return "?";
}

inline const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kTree:
      return "tree";
    case Algorithm::kRecursiveDoubling:
      return "recursive_doubling";
    case Algorithm::kDirect:
      return "direct";
    case Algorithm::kRing:
      return "ring";
    case Algorithm::kChain:
      return "chain";
  }
  return "?";
}

inline std::optional<Algorithm> algorithm_from_name(const std::string& name) {
  for (Algorithm a :
       {Algorithm::kTree, Algorithm::kRecursiveDoubling, Algorithm::kDirect, Algorithm::kRing, Algorithm::kChain}) {
    if (name == algorithm_name(a)) return a;
  }
  return std::nullopt;
}

// The thresholds, in bytes of the full buffer (all_gather: of the result), measured with
// `bench_collectives --ops=all_reduce --all_reduce_algorithm=A` for each A (8 worker
// processes, 2 cores, median of 15; docs/design.md has the table). On both paths the binomial
// tree's 2(n-1) messages beat recursive doubling's n log2 n and direct's n(n-1) at every
// small size: with 9 processes on 2 cores a message costs a wake-up of its receiver, more
// than its bytes. On shared memory the ring wins from 256 KiB; on gRPC the tree still wins at
// 512 KiB (its messages must stay within the wire's 1 MiB).
struct Thresholds {
  int64_t small_all_reduce;  // at most this: small_all_reduce_algorithm, else the ring
  Algorithm small_all_reduce_algorithm;
  int64_t direct_all_reduce;  // at most this (and <= small_all_reduce): direct instead
  int64_t direct_gather;      // all_gather, reduce_scatter, broadcast: direct up to this
};

inline constexpr Thresholds kGrpcThresholds = {512 << 10, Algorithm::kTree, 0, 64 << 10};
inline constexpr Thresholds kShmThresholds = {64 << 10, Algorithm::kTree, 0, 64 << 10};
inline constexpr Thresholds kInProcessThresholds = {64 << 10, Algorithm::kTree, 0, 64 << 10};

// The algorithm for `kind` on a buffer of `bytes` over a group of `n` on `path`.
// all_to_all, collective_permute and ragged_all_to_all are always direct.
inline Algorithm choose_algorithm(CollectiveKind kind, int64_t bytes, int n, Path path) {
  const Thresholds& t = path == Path::kShm         ? kShmThresholds
                        : path == Path::kInProcess ? kInProcessThresholds
                                                   : kGrpcThresholds;
  switch (kind) {
    case CollectiveKind::kAllReduce:
      if (bytes > t.small_all_reduce || n <= 1) return Algorithm::kRing;
      return bytes <= t.direct_all_reduce ? Algorithm::kDirect : t.small_all_reduce_algorithm;
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
      return bytes <= t.direct_gather ? Algorithm::kDirect : Algorithm::kRing;
    case CollectiveKind::kBroadcast:
      return bytes <= t.direct_gather ? Algorithm::kDirect : Algorithm::kChain;
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kCollectivePermute:
    case CollectiveKind::kRaggedAllToAll:
      return Algorithm::kDirect;
  }
  return Algorithm::kDirect;
}

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_ALGORITHMS_H_
