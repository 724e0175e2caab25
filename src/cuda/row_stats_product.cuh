// The forward product with each row's softmax statistics taken in its epilogue (sm_90 only).
//
//   S = X W^T / T               (rows, vocab), in f32 accumulators
//   partial[r, t] = (max_j s_rj, sum_j exp(s_rj - max), sum_j s_rj) over column tile t (with
//                   candidates: optional, and 0 for the sum of s; 0 for it too in the exponential
//                   form, which label smoothing does not take)
//   label_s[r]    = s_r,label[r]  (written by the one thread that holds that column)
//   shifted[r, j] = s_rj - partial[r, j / kRowStatsTileColumns].x, in the inputs' dtype (optional)
//                   or, given exp_shift, exp(s_rj - ref) with ref = max(exp_shift[r], that tile max
//                   - kExpFormMargin): at most e^60, whatever the row (the exponential form)
//   candidates[r, t * kTopkCandidatesPerTile + g] = the largest (s_rj, j) of column group g of tile t
//                   (columns 128 t + 8 i + 2 g + e, i < 16, e < 2) as a top-k composite (topk_keys.cuh),
//                   0 for none; runners_up[r, same] = the group's second-largest s as an order key
//                   with its place in the group and a bound on the third's key (topk_keys.cuh), 0
//                   for none (optional, both)
//   kept[r, 0 .. kept_count[r]) = every (s_rj, j) with z_rj >= keep_above[r] (the accumulator,
//                   before the scaling by 1/T) as a top-k composite, in no order; kept_count[r]
//                   counts on past kept_ld, where the list stops (optional, instead of candidates)
//
// The logits of a forward-only call are needed for nothing but these, so they stay in the
// product's f32 accumulators: no logits chunk is written or read back (a 4-byte write and read
// per logit saved, and no workspace for them). The row kernel combines the partials
// (RowWork::stats_from_partials). A call that forms the gradient also has the product store the
// shifted logits, 2 bytes each, for the row kernel's one gradient pass
// (RowWork::stats_and_grad_from_partials), which also reads s at a teacher's ids from them: the
// statistics (lse, s at the label) stay exact, and since s - max is near 0 where the softmax is
// large, its 16-bit rounding costs the gradient least where it matters (a bf16 logit of 20 is
// off by up to 0.04, a shifted one of -0.5 by 0.001). A top-k call has the product keep each
// row's three largest values of every 32-column group instead (the first two exact, the
// accumulators' own): 64 bytes per row and tile written, about half of them read back by the
// selection, instead of a 512-byte f32 logits row segment written and read back (topk.cuh); for
// larger k it keeps every logit at or above a bar per row taken from a sample of the row, a few
// percent of them. Heads with a bias or soft-capping keep the cuBLASLt path: their per-logit work
// belongs in the memory-bound row kernel, not between the product's main loops.
// Built with CUTLASS for sm_90a when its headers were found at configure time
// (LMLOSS_ROW_STATS_PRODUCT); elsewhere row_stats_product_supported() is false and the loss takes
// the cuBLASLt path.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "lmloss/lmloss.h"

namespace lmloss::cuda {

// Columns per partial: the product's tile width.
constexpr int64_t kRowStatsTileColumns = 128;
// Rows of a cluster of the product's tiles (2 x 1 or 2 x 2 tiles of 128): its grid covers a chunk's rows
// in steps of this, so a chunk of other heights pays for a cluster row it only partly fills.
constexpr int64_t kRowStatsClusterRows = 256;

// The exponential form stores exp(s - ref) of a column tile with ref at least its max s less this:
// no stored value above e^60, so no overflow in bf16 nor in the products' f32 sums over the vocab.
constexpr float kExpFormMargin = 60.f;

// Column groups of a tile for top-k, each the 32 columns one thread of a quad holds: each keeps its
// largest logit (a candidate) and its runners-up.
constexpr int64_t kTopkCandidatesPerTile = 4;
constexpr int64_t kTopkGroupColumns = kRowStatsTileColumns / kTopkCandidatesPerTile;

inline int64_t row_stats_tiles(int64_t vocab) {
  return (vocab + kRowStatsTileColumns - 1) / kRowStatsTileColumns;
}

struct RowStatsProductArgs {
  int device = 0;                    // the current device, which runs the product
  lmloss_dtype dtype = LMLOSS_BF16;  // of hidden and weight: bf16 or f16
  const void* hidden = nullptr;      // (rows, hidden_size), row stride hidden_ld
  int64_t hidden_ld = 0;
  const void* weight = nullptr;      // (vocab, hidden_size), row stride weight_ld
  int64_t weight_ld = 0;
  int64_t rows = 0, vocab = 0, hidden_size = 0;
  float inv_temperature = 1;
  const void* labels = nullptr;      // (n_tokens), optional; row r is token row0 + r
  lmloss_dtype labels_dtype = LMLOSS_I32;
  int64_t row0 = 0;
  float4* partial = nullptr;         // (rows, partial_ld >= row_stats_tiles(vocab)); .w unused;
                                     // null: none (with candidates only)
  int64_t partial_ld = 0;
  float* label_s = nullptr;          // (rows)
  void* shifted = nullptr;           // (rows, shifted_ld) of dtype, optional; shifted_ld even
  int64_t shifted_ld = 0;
  const float* exp_shift = nullptr;  // (rows), optional: shifted in the exponential form
  uint64_t* candidates = nullptr;    // (rows, candidates_ld >= kTopkCandidatesPerTile * tiles), optional
  uint64_t* runners_up = nullptr;    // (rows, candidates_ld), with candidates
  int64_t candidates_ld = 0;
  const float* keep_above = nullptr;  // (rows), optional, not with candidates: keep z >= keep_above[r]
  uint64_t* kept = nullptr;           // (rows, kept_ld), with keep_above
  int32_t* kept_count = nullptr;      // (rows), with keep_above: zero before the product
  int64_t kept_ld = 0;
};

// Whether sm_90a kernels (this file's and weight_grad_store.cuh's) run on the device: built in, and
// the device is sm_90. Read once per device.
bool sm90_kernels_run(int device);

// Whether this build has the product and `device` runs it, for these operands (16-bit, rows and
// pointers aligned as the tensor-memory copies need). The caller rules out bias and soft-capping.
bool row_stats_product_supported(int device, lmloss_dtype dtype, const void* hidden, int64_t hidden_ld,
                                 const void* weight, int64_t weight_ld, int64_t hidden_size);

// Device workspace the product needs for `rows` (its tile scheduler's), whatever it keeps (the
// outputs' pointers in `args` are not read), 256-byte aligned.
size_t row_stats_product_workspace(const RowStatsProductArgs& args);

// `workspace`: row_stats_product_workspace(args) bytes.
lmloss_status run_row_stats_product(const RowStatsProductArgs& args, void* workspace, cudaStream_t stream);

}  // namespace lmloss::cuda
