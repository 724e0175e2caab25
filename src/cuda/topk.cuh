// Teacher top-k: the k largest scaled logits of each row, sorted by descending value, ties to
// the lower id, with their probabilities.
//
// Over order-preserving 32-bit keys of the values, one block per row. Rows of 16384 values or
// more first try one pass: a threshold from a sample of the row (1024 values in 128 evenly spaced
// runs of 8, sorted in shared memory) set so that about 1.5 k values pass it, then one pass gathers
// every key at or above it (and, for full-vocabulary probabilities, the row's online max and sum
// of exponentials); if at least k and at most what shared memory holds passed, they are sorted by
// (key desc, id asc) and the first k written out. Otherwise (an unlucky sample, ties, short rows,
// k near shared memory's size) a radix select:
//   pass 1   histogram of the key's top 11 bits (and the lse) -> the bin holding the k-th value
//   pass 2   the candidates (every value in or above that bin) gathered and sorted as above.
// When those do not fit (many values in one bin, or k itself larger than shared memory), two
// more histogram passes narrow the bin to the exact k-th key, the values above it and the
// lowest-id values equal to it are collected, and a block (or, for k beyond shared memory, a
// segmented device sort) orders them. Typical rows read the logits once (and the sample's 1024
// values), short ones twice.
//
// From the statistics product (row_stats_product.cuh), for k up to kTopkFromProductMaxK: the
// product keeps, for each row and each 32-column group of a tile (the columns one thread of a
// quad holds), the group's largest logit as a candidate, and its runners-up: the second-largest
// with its column, a bound on the third. One block per row selects the k largest candidates in
// shared memory (a radix select over the 64-bit composites down to at most 2k, each of those then
// put at its rank among them). The top k of the row are among them unless a group holds two or
// more of them: then that group is selected and its second value reaches the selection's k-th
// (the k-th of a subset is at most the true k-th), and the second joins the selection. Only where
// the third may reach it too (three of the top k in one group: about one row in 400 at k 64 and
// a 4008-group row for unordered logits; many where logits tie) is the group recomputed in full,
// each logit a dot product of the row with a row of W in f32, and merged in. No logits are
// written; the lse for full-vocabulary probabilities comes from the product's partials.
//
// From the statistics product for larger k (up to shared memory's, with a vocabulary of 16384 or
// more): a product of the chunk's rows with a sample of W's rows (kTopkSampleColumns of them,
// evenly spaced, by cuBLASLt) gives each row a sample of its logits, and the rank-th largest of
// it becomes the row's bar, the rank set so that about twice k logits are expected at or above
// it. The statistics product then keeps each logit at or above its row's bar as a composite in
// the row's list (a few percent of the row), and one block per row selects the top k of the list.
// A row whose list holds fewer than k (a bar set too high by its sample) or overflowed (ties at
// the bar, or a bar too low) is redone from scratch: its logits, each a dot product in f32, into
// a row of device memory, then the rows kernel's selection over them. By the binomial tail of
// the sample, a bar ends too high about once in 10^6 rows of unordered logits or less; rows of equal
// logits (a row of zeros) always take that slow way. No logits are written.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/row_math.hpp"
#include "cuda/common.cuh"
#include "cuda/row_stats_product.cuh"
#include "lmloss/lmloss.h"

namespace lmloss::cuda {

struct TopkRowsArgs {
  const void* logits = nullptr;  // (rows, vocab)
  int64_t logits_ld = 0;
  lmloss_dtype logits_dtype = LMLOSS_F32;
  const float* bias = nullptr;   // (vocab), f32, optional
  int64_t row0 = 0;              // token index of the first row
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t k = 0;
  int32_t* ids = nullptr;        // (n_tokens, k)
  int64_t ids_ld = 0;
  float* probs = nullptr;        // (n_tokens, k)
  int64_t probs_ld = 0;
  float* tail = nullptr;         // (n_tokens), optional
  bool renormalize = true;
  core::LogitScale<float> scale{};
  uint64_t* sorted_scratch = nullptr;  // (rows, k) when k > topk_shared_capacity(): set from scratch
  float* lse_scratch = nullptr;        // (rows): each row's lse, kept between the selection and the sort
};

// From the statistics product's kept logits (see above).
constexpr int64_t kTopkFromProductMaxK = 128;

// The head, for the logits the selections compute again one at a time: z = x . w in f32.
struct TopkHead {
  lmloss_dtype dtype = LMLOSS_BF16;  // bf16 or f16
  const void* hidden = nullptr;      // (n_tokens, hidden_size) from token 0, stride hidden_ld
  int64_t hidden_ld = 0;
  const void* weight = nullptr;      // (vocab, hidden_size), stride weight_ld
  int64_t weight_ld = 0;
  int64_t hidden_size = 0;           // a multiple of 8, rows 16-byte aligned
};

struct TopkCandidatesArgs {
  TopkRowsArgs select;            // row0, rows, vocab, k and the outputs (logits, bias, scale unused)
  const uint64_t* candidates = nullptr;  // (rows, candidates_ld): the product's, per column group
  const uint64_t* runners_up = nullptr;  // (rows, candidates_ld): the product's, per column group
  int64_t candidates_ld = 0;
  int64_t tiles = 0;              // column tiles of the vocabulary
  const float4* partial = nullptr;  // (rows, partial_ld): the product's statistics (for the lse)
  int64_t partial_ld = 0;
  TopkHead head;                  // for the groups recomputed in full; s = z * inv_temperature
  float inv_temperature = 1;
};

// Whether k and the vocabulary suit the selection from the product's kept logits: k at most
// kTopkFromProductMaxK and at most what the whole tiles keep, the candidates within shared memory.
bool topk_from_candidates_supported(int64_t vocab, int64_t k);
lmloss_status launch_topk_from_candidates(const TopkCandidatesArgs& args, cudaStream_t stream);

// The sampled bar's plan for (vocab, k): W's rows step * i + offset (i < kTopkSampleColumns) are
// the sample, its rank-th largest the bar, and each row's list holds kept_ld composites; false
// where the sample would not pay (a short vocabulary, k near the sample's share).
constexpr int64_t kTopkSampleColumns = 1024;
struct TopkBarPlan {
  int64_t step = 0, offset = 0, rank = 0, kept_ld = 0;
};
bool topk_bar_plan(int64_t vocab, int64_t k, TopkBarPlan* plan);

// bar[r] = the least z with z * inv_temperature (rounded to f32) at least the rank-th largest of
// sample[r, :] * inv_temperature: z >= bar[r] exactly where the scaled logit reaches that value,
// so the product compares its accumulators unscaled; kept_count[r] = 0.
struct TopkBarArgs {
  const float* sample = nullptr;  // (rows, kTopkSampleColumns): the sampled logits, unscaled
  int64_t rows = 0;
  int64_t rank = 0;
  float inv_temperature = 1;
  float* bar = nullptr;           // (rows)
  int32_t* kept_count = nullptr;  // (rows)
};
lmloss_status launch_topk_bar(const TopkBarArgs& args, cudaStream_t stream);

struct TopkKeptArgs {
  TopkRowsArgs select;          // row0, rows, vocab, k, scale and the outputs (logits and bias unused)
  const uint64_t* kept = nullptr;      // (rows, kept_ld): the product's lists
  const int32_t* kept_count = nullptr;  // (rows)
  int64_t kept_ld = 0;
  const float4* partial = nullptr;  // (rows, partial_ld): the product's statistics (for the lse)
  int64_t partial_ld = 0;
  int64_t tiles = 0;
  TopkHead head;                       // for the rows redone
  float* redo_logits = nullptr;      // topk_redo_bytes(vocab): the rows redone, one per block
};
// Device memory for the rows redone from scratch.
size_t topk_redo_bytes(int64_t vocab);
lmloss_status launch_topk_from_kept(const TopkKeptArgs& args, cudaStream_t stream);

// The largest k sorted in shared memory; beyond it the selection goes through device memory.
int64_t topk_shared_capacity();
// Device scratch bytes `launch_topk_rows` needs for `rows` rows (0 when k fits shared memory).
size_t topk_scratch_bytes(int64_t rows, int64_t k);
// `scratch` must hold topk_scratch_bytes(rows, k) bytes; sorted_scratch is set from it.
lmloss_status launch_topk_rows(TopkRowsArgs args, void* scratch, cudaStream_t stream);

}  // namespace lmloss::cuda
