// The keys top-k selection sorts by, shared by the selection kernels and the statistics product's
// epilogue (which keeps each column tile's best few): a scaled logit as an order-preserving
// 32-bit key, and that key with the column's id as one 64-bit composite whose descending order
// is the top-k order (value descending, ties to the lower id). Composites of distinct ids are
// distinct; 0 is below every composite of a real value and marks an empty slot. Also the layout
// of a tile's column groups, which the epilogue writes and the selection reads back.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/row_stats_product.cuh"

namespace lmloss::cuda {

// Larger float -> larger unsigned key.
__device__ __forceinline__ uint32_t order_key(float s) {
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
__device__ __forceinline__ uint64_t composite(uint32_t key, int64_t id) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(0xffffffffu - static_cast<uint32_t>(id));
}
__device__ __forceinline__ int32_t composite_id(uint64_t c) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(c & 0xffffffffu));
}
__device__ __forceinline__ float composite_value(uint64_t c) { return key_value(static_cast<uint32_t>(c >> 32)); }

// A tile's column groups as the product's epilogue holds them (row_stats_product.cuh): place i
// (0-31) of group g of tile t is column 128 t + 8 (i / 2) + 2 g + i % 2; groups are numbered 4 t + g.
__device__ inline int64_t group_column(int group, int place) {
  return int64_t(group / kTopkCandidatesPerTile) * kRowStatsTileColumns + 8 * (place / 2) +
         2 * (group % kTopkCandidatesPerTile) + place % 2;
}
__device__ inline int column_group(int j) {
  return (j / int(kRowStatsTileColumns)) * int(kTopkCandidatesPerTile) + (j % 8) / 2;
}
__device__ inline int group_place(int j) { return 2 * ((j % int(kRowStatsTileColumns)) / 8) + j % 2; }

// A column group's runners-up (row_stats_product.cuh) in 64 bits: its second-largest value's key,
// exact, with its place in the group (0-31), and its third-largest value's key with the low five
// bits cleared, read back with them set: a bound at or above the key. 0 for none.
constexpr uint32_t kRunnerUpPlaceMask = 31;
__device__ __forceinline__ uint64_t runners_up(uint32_t second_key, int second_place, uint32_t third_key) {
  return (static_cast<uint64_t>(second_key) << 32) | (third_key & ~kRunnerUpPlaceMask) | uint32_t(second_place);
}
__device__ __forceinline__ uint32_t second_key_of(uint64_t r) { return static_cast<uint32_t>(r >> 32); }
__device__ __forceinline__ int second_place_of(uint64_t r) { return int(r & kRunnerUpPlaceMask); }
__device__ __forceinline__ uint32_t third_key_bound(uint64_t r) {
  return static_cast<uint32_t>(r) | kRunnerUpPlaceMask;
}

}  // namespace lmloss::cuda
