// Copying blocks between a global row-major array and its contiguous shards.
//
// Both directions move whole contiguous runs with memcpy: trailing dimensions a block covers
// entirely merge into one run, so a row-split 2-D block is a single copy.
//
//   HostArray shard = extract_block(global, {{4, 8}, {0, 8}});
//   insert_block(shard, {{4, 8}, {0, 8}}, &global);
#ifndef TESSERA_CORE_SLICING_H_
#define TESSERA_CORE_SLICING_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "core/host_array.h"
#include "core/sharding.h"

namespace tessera {

// The shape of the block `index` selects.
Shape block_shape(const Index& index);

// INVALID_ARGUMENT unless `index` has one slice per dimension of `shape`, each with
// 0 <= start <= stop <= dim.
absl::Status validate_index(const Index& index, const Shape& shape);

// Copies block `index` of the array (`shape`, `elem_size`-byte elements at `src`) into the
// contiguous buffer `dst`, which must hold num_elements(block_shape(index)) elements.
// REQUIRES: validate_index(index, shape) is OK.
void copy_block_out(const std::byte* src, const Shape& shape, int64_t elem_size, const Index& index, std::byte* dst);

// The inverse: writes the contiguous `block` into block `index` of the array at `dst`.
void copy_block_in(const std::byte* block, const Shape& shape, int64_t elem_size, const Index& index, std::byte* dst);

// When block `index` is one contiguous run of the array, its offset in elements; else -1.
int64_t contiguous_block_offset(const Shape& shape, const Index& index);

// HostArray conveniences over the two above.
HostArray extract_block(const HostArray& global, const Index& index);
void insert_block(const HostArray& block, const Index& index, HostArray* global);

}  // namespace tessera

#endif  // TESSERA_CORE_SLICING_H_
