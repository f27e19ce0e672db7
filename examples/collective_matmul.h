// The collective matmuls of JAX's shard_map notebook (docs/notebooks/shard_map.md, "Matrix
// multiplies"), written as the notebook writes them and rolled into a fori_loop as it says
// one would "in practice, to reduce compile times" (not here: the notebook's plain
// matmul_allgather and matmul_psumscatter_overlapped_bidi; ring_gather_lhs is Tessera's own
// example (c), not the notebook's): each ring step is one iteration that
// ppermutes the moving block and multiplies the block it needs, found by dynamic_slice /
// dynamic_update_slice at a traced `(axis_index ± i) % n` offset. So the compiled program holds
// one loop whose body has the ppermute(s), whatever the ring's length.
//
// Each function is a shard_map body over the one mesh axis `axis` (n devices): it takes this
// device's blocks and returns its block of lhs @ rhs, float32 (the accumulators are). The
// specs, with M x K lhs and K x N rhs (REQUIRES as each says: a trace that breaks it fails
// INVALID_ARGUMENT naming the sizes, where the notebook's split or reshape would raise):
//
//   ring_gather_lhs:  lhs P(axis, None), rhs P(None, axis) -> P(None, axis)   (M % n == 0)
//     the rows of lhs travel around the ring; each step's product is written at its rows.
//   allgather_overlapped:  lhs P(axis, None), rhs P(axis, None) -> P(axis, None)
//     the notebook's matmul_allgather_overlapped: the rhs blocks travel (K % n == 0).
//   allgather_overlapped_bidi:  the same specs; the notebook's matmul_allgather_overlapped_bidi:
//     half of each rhs block travels each way, one full-size matmul per step by its pad-and-add
//     trick (K % 2n == 0).
//   psumscatter_overlapped:  lhs P(None, axis), rhs P(axis, None) -> P(axis, None)
//     the notebook's matmul_psumscatter_overlapped: the partial sums travel (M % n == 0).
#ifndef TESSERA_EXAMPLES_COLLECTIVE_MATMUL_H_
#define TESSERA_EXAMPLES_COLLECTIVE_MATMUL_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tessera/tessera.h"

namespace tessera::collective_matmul {

// The ring's permutation sending position i to (i + by) mod n (the notebook's
// [(i, (i + 1) % size) for i in range(size)] for by = 1).
inline std::vector<std::pair<int64_t, int64_t>> shift(int64_t n, int64_t by) {
  std::vector<std::pair<int64_t, int64_t>> perm;
  for (int64_t i = 0; i < n; ++i) perm.emplace_back(i, ((i + by) % n + n) % n);
  return perm;
}

// Fails the trace unless `size` (what: which dimension of which operand) divides into `parts`
// equal blocks along `axis` (the notebook's jnp.split / reshape raise there; a floor division
// would silently drop the remainder).
inline void require_blocks(const std::string& form, const std::string& what, int64_t size, int64_t parts,
                           const std::string& axis) {
  if (size % parts != 0) {
    fail_trace(absl::InvalidArgumentError(absl::StrCat(form, ": ", what, " is ", size, ", not divisible into ", parts,
                                                       " equal blocks over '", axis, "'")));
  }
}

// An int32 scalar 0: a start index of dynamic_slice.
inline Value zero() { return full({}, 0.0, DType::kI32); }

// lax.dynamic_slice_in_dim(x, start, size, axis) of a matrix.
inline Value slice_in_dim(const Value& x, const Value& start, int64_t size, int64_t axis) {
  return axis == 0 ? dynamic_slice(x, {start, zero()}, {size, x.shape()[1]})
                   : dynamic_slice(x, {zero(), start}, {x.shape()[0], size});
}

// All of lhs gathered around the ring, one row block per step: at step i this device holds
// rows block (idx + i) % n (each device receives from the next) and writes its product with
// the local rhs columns there.
inline std::vector<Value> ring_gather_lhs(const std::vector<Value>& in, const std::string& axis) {
  const int64_t n = axis_size(axis), rows = in[0].shape()[0];
  const Value idx = axis_index(axis);
  Value out = full({n * rows, in[1].shape()[1]}, 0.0);
  out = dynamic_update_slice(out, matmul(in[0], in[1]), {idx * rows, zero()});
  const std::vector<Value> done =
      fori_loop(1, n,
                [&](const Value& i, const std::vector<Value>& c) {
                  const Value held = ppermute(c[1], axis, shift(n, -1));
                  return std::vector<Value>{
                      dynamic_update_slice(c[0], matmul(held, in[1]), {((idx + i) % n) * rows, zero()}), held};
                },
                {out, in[0]});
  return {done[0]};
}

// matmul_allgather_overlapped.
inline std::vector<Value> allgather_overlapped(const std::vector<Value>& in, const std::string& axis) {
  const int64_t n = axis_size(axis);
  const Value idx = axis_index(axis);
  const Value& lhs_block = in[0];
  require_blocks("allgather_overlapped", "lhs's block's columns", lhs_block.shape()[1], n, axis);
  const int64_t b = lhs_block.shape()[1] / n;
  const auto lhs_blocks = [&](const Value& i) { return slice_in_dim(lhs_block, i * b, b, 1); };
  const Value out = matmul(lhs_blocks(idx), in[1]);
  const std::vector<Value> done =
      fori_loop(1, n,
                [&](const Value& i, const std::vector<Value>& c) {
                  const Value rhs_block = ppermute(c[1], axis, shift(n, 1));
                  return std::vector<Value>{c[0] + matmul(lhs_blocks((idx - i) % n), rhs_block), rhs_block};
                },
                {out, in[1]});
  return {done[0]};
}

// matmul_allgather_overlapped_bidi.
inline std::vector<Value> allgather_overlapped_bidi(const std::vector<Value>& in, const std::string& axis) {
  const int64_t n = axis_size(axis);
  const Value idx = axis_index(axis);
  const Value& lhs_block = in[0];
  require_blocks("allgather_overlapped_bidi", "lhs's block's columns", lhs_block.shape()[1], 2 * n, axis);
  const int64_t b = lhs_block.shape()[1] / n / 2;  // half-size blocks
  const auto lhs_blocks = [&](const Value& i, int64_t hi) { return slice_in_dim(lhs_block, (2 * i + hi) * b, b, 1); };
  const auto block_matmul = [&](const Value& rhs_lo, const Value& rhs_hi, const Value& i_lo, const Value& i_hi) {
    const Value lhs_lo = pad(lhs_blocks(i_lo, 0), {{0, 0}, {0, b}});
    const Value lhs_hi = pad(lhs_blocks(i_hi, 1), {{0, 0}, {b, 0}});
    return matmul(lhs_lo + lhs_hi, pad(rhs_lo, {{0, b}, {0, 0}}) + pad(rhs_hi, {{b, 0}, {0, 0}}));
  };
  const int64_t cols = in[1].shape()[1];
  const Value rhs_lo = slice(in[1], {0, 0}, {b, cols}), rhs_hi = slice(in[1], {b, 0}, {2 * b, cols});
  const Value out = block_matmul(rhs_lo, rhs_hi, idx, idx);
  const std::vector<Value> done =
      fori_loop(1, n,
                [&](const Value& i, const std::vector<Value>& c) {
                  const Value lo = ppermute(c[1], axis, shift(n, 1)), hi = ppermute(c[2], axis, shift(n, -1));
                  return std::vector<Value>{c[0] + block_matmul(lo, hi, (idx - i) % n, (idx + i) % n), lo, hi};
                },
                {out, rhs_lo, rhs_hi});
  return {done[0]};
}

// matmul_psumscatter_overlapped: lhs_block[j] of the notebook's reshape (n, M / n, K / n) is
// the rows block j, a dynamic_slice at j * M / n.
inline std::vector<Value> psumscatter_overlapped(const std::vector<Value>& in, const std::string& axis) {
  const int64_t n = axis_size(axis);
  const Value idx = axis_index(axis);
  require_blocks("psumscatter_overlapped", "lhs's rows", in[0].shape()[0], n, axis);
  const int64_t rows = in[0].shape()[0] / n;
  const auto lhs_block = [&](const Value& j) { return slice_in_dim(in[0], j * rows, rows, 0); };
  const Value out = matmul(lhs_block((idx + 1) % n), in[1]);
  const std::vector<Value> done = fori_loop(
      1, n,
      [&](const Value& i, const std::vector<Value>& c) {
        return std::vector<Value>{ppermute(c[0], axis, shift(n, -1)) + matmul(lhs_block((idx + i + 1) % n), in[1])};
      },
      {out});
  return {done[0]};
}

}  // namespace tessera::collective_matmul

#endif  // TESSERA_EXAMPLES_COLLECTIVE_MATMUL_H_
