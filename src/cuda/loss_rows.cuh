// The fused row kernel of the losses: one block per token row of logits (a chunk of a linear
// head, or the caller's logits), never more than that row resident.
//
//   stats pass   (forward, fused): one read of the row: online max and sum of exp(s - max), and
//                sum_j s_j when label smoothing is on -> lse
//   sparse reads: s at the label and at the teacher ids (kept in a scratch row, since an in-place
//                gradient overwrites them) -> the token's loss
//   grad pass    (backward, fused): one more read of the row, the gradient written over it (or
//                into a separate buffer); the few sparse entries are fixed up after a barrier.
//
// So the fused forward+backward reads each logit twice and writes its gradient once; backward
// from a saved lse reads it once. Where the product took the statistics in its epilogue
// (row_stats_product.cuh) the row combines its column tiles' partials instead of a stats pass,
// and s at the label comes from the product too: a forward reads no logits at all, a fused
// forward+backward reads the product's 16-bit shifted logits once and writes its gradient over
// them, or, in the exponential form, reads and writes only the sparse entries of most rows (see
// LossRowsArgs). The arithmetic is core/row_math.hpp's, shared with the CPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/row_math.hpp"
#include "cuda/common.cuh"
#include "cuda/row_stats_product.cuh"
#include "lmloss/lmloss.h"

namespace lmloss::cuda {

enum class RowWork { stats, stats_and_grad, grad_from_lse, stats_from_partials, stats_and_grad_from_partials };

__host__ __device__ constexpr bool forms_gradient(RowWork work) {
  return work == RowWork::stats_and_grad || work == RowWork::grad_from_lse ||
         work == RowWork::stats_and_grad_from_partials;
}

// Whether the row's statistics come from the product's partials (row_stats_product.cuh).
__host__ __device__ constexpr bool stats_from_product(RowWork work) {
  return work == RowWork::stats_from_partials || work == RowWork::stats_and_grad_from_partials;
}

struct LossRowsArgs {
  RowWork work = RowWork::stats;
  const void* logits = nullptr;  // (rows, vocab), row stride logits_ld
  int64_t logits_ld = 0;
  lmloss_dtype logits_dtype = LMLOSS_F32;
  void* grad = nullptr;          // (rows, vocab), may be `logits` itself
  int64_t grad_ld = 0;
  lmloss_dtype grad_dtype = LMLOSS_F32;
  const void* bias = nullptr;    // (vocab), added to every row (linear heads)
  lmloss_dtype bias_dtype = LMLOSS_F32;

  int64_t row0 = 0;              // token index of the chunk's first row
  int64_t rows = 0;
  int64_t vocab = 0;

  const void* labels = nullptr;  // (n_tokens)
  lmloss_dtype labels_dtype = LMLOSS_I32;
  int64_t ignore_index = -100;
  const uint8_t* mask = nullptr;  // (n_tokens)
  const void* teacher_ids = nullptr;  // (n_tokens, top_k)
  lmloss_dtype teacher_ids_dtype = LMLOSS_I32;
  int64_t teacher_ids_ld = 0;
  const float* teacher_probs = nullptr;  // (n_tokens, top_k)
  int64_t teacher_probs_ld = 0;
  int64_t top_k = 0;

  float* token_loss = nullptr;   // (n_tokens): l_t of counted tokens, 0 otherwise, NaN for bad ids
  float* lse_out = nullptr;      // (n_tokens), optional
  const float* lse_in = nullptr; // (n_tokens), grad_from_lse
  const float* grad_loss = nullptr;  // reduction none: (n_tokens); else unused (in scalars)
  lmloss_reduction reduction = LMLOSS_REDUCTION_MEAN;
  const CallScalars* scalars = nullptr;
  int* error_flag = nullptr;
  float* sparse_s = nullptr;     // (rows, top_k + 1) scratch: s at the label, then the teacher ids
  // (rows, top_k + 1) scratch where orders_entries(top_k, vocab): each row's entries as keys
  // (id << 32 | entry) in ascending order, written by a kernel of their own before the rows (see
  // launch_loss_rows).
  uint64_t* entry_keys = nullptr;

  // stats_from_partials (no teacher) and stats_and_grad_from_partials, no bias or soft-capping:
  // per row, partial_tiles (max, sum exp(s - max), sum s) of column tiles, and s at the label.
  // With the gradient, `logits` are the product's shifted logits s - (max s of their column
  // tile), in bf16 or f16: s at the teacher ids is read from them, and the gradient goes over them.
  const float4* partial = nullptr;  // (rows, partial_ld)
  int64_t partial_ld = 0;
  int64_t partial_tiles = 0;
  const float* label_s = nullptr;   // (rows)

  // The exponential form of stats_and_grad_from_partials (bf16, no label smoothing): `logits` hold
  // exp(s - ref), ref = max(exp_shift[r], the column tile's max s - kExpFormMargin). A row whose
  // lse is within kExpFormRange of its shift keeps them, its label's and teacher ids' entries
  // corrected, and gets row_scale[r]: its gradient is row_scale[r] * token_scale times its row. Any
  // other row gets its gradient divided by token_scale written over them, and row_scale 1; a row
  // with no gradient row_scale 0. So the backward products take the stored values as they are,
  // with the rows of X (dW) and of dX (dX) scaled: no pass over the logits for most rows.
  // The label's one-hot term stays out of the stored values (rounded into bf16, and in dW with
  // the scaled X rounded too, the largest term of a cross-entropy gradient would carry two bf16
  // roundings): label_grad[r] is dl/dz at the label less its softmax part, which the backward
  // adds exactly (LabelRows below); 0 for a row without one.
  const float* exp_shift = nullptr;  // (rows)
  float* row_scale = nullptr;        // (rows)
  float* label_grad = nullptr;       // (rows)
  // The vocabulary-sliced dX (dX only, launch_fold_slice): the stored values are gone by the time
  // the row runs, so every row takes row_scale as if kept, nothing is read or written over them,
  // and the tiles they could not keep relative to the shift are added afterwards from these
  // (launch_add_flagged_tiles): row_coef[r] = the softmax part's coefficient of dl/dz (0 for a row
  // without a gradient), row_lse[r] = lse.
  bool scales_only = false;
  float* row_coef = nullptr;         // (rows), with scales_only
  float* row_lse = nullptr;          // (rows), with scales_only
  // dW's large entries (the exponential form with dW; null: none). dW's products take every
  // stored value and every scaled row of X rounded into bf16, so a row whose gradient lies
  // mostly on a few columns (a trained head's peaked rows) leaves ~2^-9 of those columns' terms
  // in dW, ~1e-3 of an f32 dW. Each row lists its columns whose probability is about
  // 1/kLargeEntryInverse or more (by their stored values) and its label's and teacher ids'
  // entries of |dl/dz| >= |p_coef| / kLargeEntryInverse (at the fix-ups), with dl/dz there from
  // s recomputed by a dot product (the label's one-hot term left to label_grad); the
  // kLargeEntries of the lowest columns where more are found, none where very many are. After
  // the call's last chunk, launch_add_large_entries puts the exact terms in place of the rounded
  // ones. Token t's slot l (kLargeEntries a token; those of a large entry written, the rest left
  // as launch_clear_large_entries set them): large_cols its column, large_coefs dl/dz,
  // large_stored the stored value there as the dW product takes it, large_slots
  // t * kLargeEntries + l; and large_row_scale[t] the row scale its row of X is staged with
  // (row_scale[r]).
  uint32_t* large_cols = nullptr;
  float* large_coefs = nullptr;
  float* large_stored = nullptr;
  int32_t* large_slots = nullptr;
  float* large_row_scale = nullptr;  // (n_tokens)
  // s at a teacher id whose stored value is too small to take its log: recomputed from the head.
  // The large entries' s too (those of the exponential form take the whole head).
  const void* hidden = nullptr;      // (n_tokens, hidden_size), row stride hidden_ld
  int64_t hidden_ld = 0;
  const void* weight = nullptr;      // (vocab, hidden_size), row stride weight_ld
  int64_t weight_ld = 0;
  int64_t hidden_size = 0;
  lmloss_dtype head_dtype = LMLOSS_BF16;

  core::LogitScale<float> scale{};
  core::LossWeights<float> weights{};
};

// The exponential form keeps a row whose lse is at most this above its shift: its stored values
// (at most e^60) and its scale (at least e^-40 times its gradient's factor) stay far from f32's and
// bf16's limits.
constexpr float kExpFormRange = 40.f;

// dW's large entries (LossRowsArgs::large_cols): a row has at most 16 columns of probability 1/16
// or more (its probabilities sum to 1), and as few teacher entries of such weight.
constexpr int kLargeEntries = 16;
constexpr float kLargeEntryInverse = 16.f;

// Rows with this many sparse entries (the label and k teacher ids) find their repeated ids in
// their entries ordered by (id, entry), O(k log^2 k), rather than by searching them, O(k^2); up to
// kOrderedEntriesMax, whose sort keys fill 32 KiB of shared memory.
constexpr int64_t kOrderedEntriesMin = 256;
constexpr int64_t kOrderedEntriesMax = 4096;
// The id in the sort key of an entry that names none (the label where it takes no fix-up, or an
// id out of range), and of the padding: it sorts after every id, so ids must stay below it.
constexpr uint64_t kNoEntryId = 0xffffffffu;
__host__ __device__ constexpr bool orders_entries(int64_t top_k, int64_t vocab) {
  return top_k + 1 >= kOrderedEntriesMin && top_k + 1 <= kOrderedEntriesMax && vocab < int64_t(kNoEntryId);
}

// Enqueues the kernel (after the entries' order, where the rows take it) on `stream`;
// LMLOSS_ERROR_UNSUPPORTED for a dtype pair it has no kernel for.
lmloss_status launch_loss_rows(const LossRowsArgs& args, cudaStream_t stream);

// The exponential form's shift of each row of a chunk, before its product: s at the token's label
// (lse - s_label is the token's cross-entropy, so lse - shift stays within kExpFormRange for all
// but badly mispredicted tokens), else at the teacher's first id, else -inf (a row without a
// gradient, stored relative to its tiles' maxima). s = x . w_id / T, a dot product per row; bf16
// rows of a multiple of 8 on 16-byte boundaries.
struct ExpShiftArgs {
  const void* hidden = nullptr;  // the chunk's first row; (rows, hidden_size), row stride hidden_ld
  int64_t hidden_ld = 0;
  const void* weight = nullptr;  // (vocab, hidden_size), row stride weight_ld
  int64_t weight_ld = 0;
  int64_t rows = 0, vocab = 0, hidden_size = 0, row0 = 0;
  float inv_temperature = 1;
  const void* labels = nullptr;  // (n_tokens) or null
  lmloss_dtype labels_dtype = LMLOSS_I32;
  int64_t ignore_index = -100;
  const uint8_t* mask = nullptr;
  const void* teacher_ids = nullptr;  // (n_tokens, teacher_ids_ld) or null
  lmloss_dtype teacher_ids_dtype = LMLOSS_I32;
  int64_t teacher_ids_ld = 0;
  float* shift = nullptr;        // (rows)
};
lmloss_status launch_exp_shift(const ExpShiftArgs& args, cudaStream_t stream);

// Before the chunks: D (counted tokens), the upstream scalar and, for f16 gradients, the scale.
struct PrepareArgs {
  int64_t n_tokens = 0;
  const void* labels = nullptr;
  lmloss_dtype labels_dtype = LMLOSS_I32;
  int64_t ignore_index = -100;
  const uint8_t* mask = nullptr;
  const float* grad_loss = nullptr;  // scalar (mean, sum) or (n_tokens) (none); null = 1
  lmloss_reduction reduction = LMLOSS_REDUCTION_MEAN;
  double normalizer = 0;
  bool scale_gradient = false;        // f16 gradients: choose S
  float max_row_factor = 1;           // bound on |dl/ds| / |g_t| for S
  CallScalars* scalars = nullptr;
};
lmloss_status launch_prepare(const PrepareArgs& args, cudaStream_t stream);

// After the chunks: loss = sum_t token_loss[t] * inv_denominator (mean, sum), in a fixed order.
lmloss_status launch_reduce_loss(const float* token_loss, int64_t n_tokens,
                                 const CallScalars* scalars, float* loss, cudaStream_t stream);

// A deferred dW product's scalars for its store: alpha_beta = (alpha * scale, scale), scale null: 1.
lmloss_status launch_deferred_scalars(const float* alpha, const float* scale, float* alpha_beta, cudaStream_t stream);

// Bias gradient: acc[j] (+)= sum over rows of grad[r, j] (times inv_scale), rows in order.
lmloss_status launch_column_sum(const void* grad, int64_t grad_ld, lmloss_dtype grad_dtype,
                                int64_t rows, int64_t vocab, bool accumulate,
                                const CallScalars* scalars, float* acc, cudaStream_t stream);
// out[j] = float(in[j]) for a vector of f32/f16/bf16 (the bias, read once per call as f32).
lmloss_status launch_to_f32(const void* in, lmloss_dtype dtype, int64_t n, float* out,
                            cudaStream_t stream);
// out[j] = acc[j] (+ out[j] when accumulating), converted to out's dtype.
lmloss_status launch_store_vector(const float* acc, int64_t n, bool accumulate, void* out,
                                  lmloss_dtype out_dtype, cudaStream_t stream);
// The exponential form's one-hot term of a chunk's rows (LossRowsArgs::label_grad): row r's
// coefficient and its label, labels[row0 + r]; rows whose label is outside [0, vocab) have none.
struct LabelRows {
  const float* coef = nullptr;   // (rows); null: no term
  const void* labels = nullptr;  // (n_tokens)
  lmloss_dtype labels_dtype = LMLOSS_I32;
  int64_t row0 = 0, vocab = 0;
};

// out[r, j] = in[r, j] * scale * row_scale[r] (scale a device f32, row_scale a device vector of
// rows; either null for 1), plus, with label.coef, label.coef[r] * table[label of r, j] (a bf16
// (vocab, cols) table of row stride table_ld: dX's one-hot term, a row of W), rounded once into
// out's dtype (f32, bf16 or f16); in is f32 or bf16; out may be in itself.
lmloss_status launch_scale_rows(const void* in, lmloss_dtype in_dtype, int64_t in_ld, const float* scale,
                                const float* row_scale, int64_t rows, int64_t cols, void* out,
                                int64_t out_ld, lmloss_dtype out_dtype, cudaStream_t stream,
                                const LabelRows& label = {}, const void* table = nullptr,
                                int64_t table_ld = 0);

// The vocabulary-sliced dX of a frozen head (dX only, the exponential form): the statistics
// product runs at full height over one slice of the vocabulary at a time, and dX accumulates
// E_slice W_slice in f32. After each slice's product, per row: its tiles' partials are merged
// into folded[r, slice] (so the row kernel sees one partial a slice), and each tile whose values
// were stored relative to its own maximum instead of the row's shift (max s - kExpFormMargin >
// shift: only rows whose lse is far above their label's s) is set to zeros and flagged in the
// row's bitmap, one bit a tile, for launch_add_flagged_tiles. Rows with shift -inf (no
// gradient) are left as they are. Slices start on 32-tile boundaries, so each bitmap word
// belongs to one slice and is written whole.
struct FoldSliceArgs {
  const float4* partial = nullptr;  // (rows, partial_ld): the slice's tiles
  int64_t partial_ld = 0;
  int64_t tiles = 0;                // the slice's
  int64_t rows = 0;
  const float* shift = nullptr;     // (rows)
  void* stored = nullptr;           // (rows, stored_ld) bf16: the slice's E
  int64_t stored_ld = 0;
  int64_t columns = 0;              // the slice's
  float4* folded = nullptr;         // (rows, folded_ld): column `slice` written
  int64_t folded_ld = 0;
  int64_t slice = 0;
  uint32_t* flags = nullptr;        // (rows, flags_ld): words first_word .. of the slice written
  int64_t flags_ld = 0;
  int64_t first_word = 0;
};
lmloss_status launch_fold_slice(const FoldSliceArgs& args, cudaStream_t stream);

// The flagged tiles' exact terms (see FoldSliceArgs): for each row with row_coef != 0, in tile
// order, s = x . w_j / T recomputed for the tile's columns and dx[r, :] += row_coef[r]
// exp(s - row_lse[r]) w_j in f32, columns in order (deterministic). dx: (rows, hidden_size) f32,
// already scaled by its rows' row_scale.
struct FlaggedTilesArgs {
  const void* hidden = nullptr;     // (rows, hidden_size) bf16, row stride hidden_ld
  int64_t hidden_ld = 0;
  const void* weight = nullptr;     // (vocab, hidden_size) bf16, row stride weight_ld
  int64_t weight_ld = 0;
  int64_t rows = 0, vocab = 0, hidden_size = 0;
  float inv_temperature = 1;
  const uint32_t* flags = nullptr;  // (rows, flags_ld)
  int64_t flags_ld = 0;
  const float* row_coef = nullptr;  // (rows)
  const float* row_lse = nullptr;   // (rows)
  float* dx = nullptr;              // (rows, hidden_size)
};
lmloss_status launch_add_flagged_tiles(const FlaggedTilesArgs& args, cudaStream_t stream);

// dW's one-hot term, deterministically: the call's tokens ordered once by label (rows in order
// within a label; a stable radix sort), then per chunk one thread block per label present sums
// coef[r] * x[r, :] over its rows in order and adds that to out's row of the label, rounding once.
// label_order_bytes: the order's workspace for n_tokens (0 where it cannot be had: more tokens than
// a 32-bit sort takes, or no device to size it for; the exponential form is then not taken).
size_t label_order_bytes(int64_t n_tokens);
// workspace: label_order_bytes(n_tokens) of them.
lmloss_status launch_label_order(const void* labels, lmloss_dtype labels_dtype, int64_t n_tokens,
                                 int64_t vocab, void* workspace, size_t workspace_bytes, cudaStream_t stream);
// Where dW's rows are: rows below `split` at `rows` (row stride ld), the others at `tail` (row
// stride tail_ld; row split first), all of one dtype. split = vocab: dW in one place.
struct WeightGradRows {
  void* rows = nullptr;
  int64_t ld = 0;
  void* tail = nullptr;
  int64_t tail_ld = 0;
  int64_t split = 0;
  lmloss_dtype dtype = LMLOSS_F32;
  int8_t* rests = nullptr;  // a kept sum of bf16 values (rows, split = vocab) and these rests
  int64_t rests_ld = 0;     //   (core/weight_sum_rest.hpp), added to as a pair
};
// A slice of a kept sum of bf16 values and 8-bit rests: rows [0, rows) of an f32 product (dense,
// `cols` wide) into the pair's rows, s = product (+ the pair's value when adding), stored as
// bf16(s) and its rest.
lmloss_status launch_fold_rests(const float* product, int64_t rows, int64_t cols, bool add, void* values,
                                int64_t values_ld, int8_t* rests, int64_t rests_ld, cudaStream_t stream);

// lmloss_round_grad_weight of such a sum: values = bf16(scale * (value + rest)), in place; the
// rests only read. scale: one f32 on the device, or null for 1.
lmloss_status launch_round_rests(void* values, int64_t values_ld, const int8_t* rests, int64_t rests_ld, int64_t rows,
                                 int64_t cols, const float* scale, cudaStream_t stream);

// x: the chunk's rows (bf16, row stride x_ld); out (vocab, cols) f32, bf16 or f16; `workspace` as
// launch_label_order left it.
lmloss_status launch_add_label_rows(const void* workspace, int64_t n_tokens, const LabelRows& label,
                                    int64_t rows, const void* x, int64_t x_ld, int64_t cols,
                                    const WeightGradRows& out, cudaStream_t stream);

// dW's large entries of a call (see LossRowsArgs::large_cols), after its last chunk's dW product:
// the slots ordered by column (stably: tokens in order within a column), then one block per
// column present adds, for each of its slots' tokens t in order, coef x[t, :] - token_scale E
// xs[t, :] (the exact term less the one the dW product added: E the stored bf16 value, xs the row
// of X as the product took it, x[t, :] times its row scale rounded into bf16) to out's row of the
// column, rounding once. The workspace, for up to `tokens` tokens: the slots' four vectors and the
// order's two, the row scales, then the sort's scratch (large_entries_bytes; 0: none to be had).
struct LargeEntries {
  uint32_t* cols = nullptr;
  float* coefs = nullptr;
  float* stored = nullptr;
  int32_t* slots = nullptr;
  uint32_t* sorted_cols = nullptr;
  int32_t* sorted_slots = nullptr;
  float* row_scale = nullptr;
  void* sort_scratch = nullptr;
  size_t sort_scratch_bytes = 0;
};
size_t large_entries_bytes(int64_t tokens);
LargeEntries large_entries_at(void* workspace, size_t bytes, int64_t tokens);
// Every slot's column set to none (all bits: after every column, also in the sort's bits), before
// a call's first chunk: the rows write only their slots of a large entry.
lmloss_status launch_clear_large_entries(const LargeEntries& entries, int64_t tokens, cudaStream_t stream);
struct LargeEntriesTerms {
  int64_t tokens = 0, vocab = 0, cols = 0;
  const void* x = nullptr;        // (tokens, cols) bf16, row stride x_ld: the call's X
  int64_t x_ld = 0;
  const CallScalars* scalars = nullptr;  // token_scale: the dW product's alpha
};
lmloss_status launch_add_large_entries(const LargeEntries& entries, const LargeEntriesTerms& terms,
                                       const WeightGradRows& out, cudaStream_t stream);

// A 16-bit dW summed in f32 over its own bytes: the first `rows` rows of a (vocab, cols) bf16 or
// f16 matrix of row stride ld (in its elements) hold f32 values at row stride ld instead, f32 row
// u over the bytes of 16-bit rows 2u and 2u + 1 and what lies between them (so rows <= vocab / 2,
// and ld = cols unless those bytes are the caller's to use). Narrowing rounds them once into their
// own 16-bit rows, in place, times *scale (null: 1); widening is its inverse. base: 4-byte aligned.
lmloss_status launch_regroup_rows(void* base, lmloss_dtype dtype, int64_t rows, int64_t cols, int64_t ld,
                                  bool narrow, const float* scale, cudaStream_t stream);

}  // namespace lmloss::cuda
