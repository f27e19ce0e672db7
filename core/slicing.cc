#include "core/slicing.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tessera {
namespace {

// Walks every contiguous run of block `index` in an array of `shape`, calling
// f(offset_in_array_bytes, offset_in_block_bytes, run_bytes).
template <typename F>
void for_each_run(const Shape& shape, int64_t elem_size, const Index& index, F&& f) {
  const int rank = static_cast<int>(shape.size());
  // Merge trailing dimensions the block covers completely (plus the first partial one).
  int64_t run = elem_size;
  int inner = rank;  // dimensions [inner, rank) form the run
  while (inner > 0) {
    const Slice& s = index[inner - 1];
    run *= (s.stop - s.start);
    --inner;
    if (s.start != 0 || s.stop != shape[inner]) break;
  }
  if (run == 0) return;
  for (int d = 0; d < inner; ++d) {
    if (index[d].stop == index[d].start) return;
  }
  // Byte stride of each dimension in the global array.
  std::vector<int64_t> stride(rank + 1, elem_size);
  for (int d = rank - 1; d >= 0; --d) stride[d] = stride[d + 1] * shape[d];
  int64_t base = 0;
  for (int d = inner; d < rank; ++d) base += index[d].start * stride[d + 1];
  // Odometer over the outer dimensions [0, inner).
  std::vector<int64_t> pos(inner, 0);
  int64_t block_offset = 0;
  while (true) {
    int64_t offset = base;
    for (int d = 0; d < inner; ++d) offset += (index[d].start + pos[d]) * stride[d + 1];
    f(offset, block_offset, run);
    block_offset += run;
    int d = inner - 1;
    for (; d >= 0; --d) {
      if (++pos[d] < index[d].stop - index[d].start) break;
      pos[d] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace

Shape block_shape(const Index& index) {
  Shape out;
  for (const Slice& s : index) out.push_back(s.stop - s.start);
  return out;
}

absl::Status validate_index(const Index& index, const Shape& shape) {
  if (index.size() != shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat("index ", index_to_string(index), " has ", index.size(),
                                                   " slices for an array of rank ", shape.size()));
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    const Slice& s = index[d];
    if (s.start < 0 || s.start > s.stop || s.stop > shape[d]) {
      return absl::InvalidArgumentError(
          absl::StrCat("index ", index_to_string(index), ": slice ", d, " is outside dimension of size ", shape[d]));
    }
  }
  return absl::OkStatus();
}

void copy_block_out(const std::byte* src, const Shape& shape, int64_t elem_size, const Index& index, std::byte* dst) {
  for_each_run(shape, elem_size, index, [&](int64_t array_off, int64_t block_off, int64_t n) {
    std::memcpy(dst + block_off, src + array_off, static_cast<size_t>(n));
  });
}

void copy_block_in(const std::byte* block, const Shape& shape, int64_t elem_size, const Index& index, std::byte* dst) {
  for_each_run(shape, elem_size, index, [&](int64_t array_off, int64_t block_off, int64_t n) {
    std::memcpy(dst + array_off, block + block_off, static_cast<size_t>(n));
  });
}

int64_t contiguous_block_offset(const Shape& shape, const Index& index) {
  int runs = 0;
  int64_t first = 0;
  for_each_run(shape, 1, index, [&](int64_t array_off, int64_t, int64_t) {
    if (runs++ == 0) first = array_off;
  });
  return runs <= 1 ? first : -1;
}

HostArray extract_block(const HostArray& global, const Index& index) {
  HostArray out(global.dtype(), block_shape(index));
  copy_block_out(global.data(), global.shape(), dtype_size(global.dtype()), index, out.data());
  return out;
}

void insert_block(const HostArray& block, const Index& index, HostArray* global) {
  copy_block_in(block.data(), global->shape(), dtype_size(global->dtype()), index, global->data());
}

}  // namespace tessera
