// Teacher top-k: the k largest scaled logits of each row, sorted by descending value, ties to
// the lower id, with their probabilities.
//
// A radix select over order-preserving 32-bit keys of the values, one block per row:
//   pass 1   histogram of the key's top 11 bits (and, for full-vocabulary probabilities, the
//            row's online max and sum of exponentials) -> the bin holding the k-th value
//   pass 2   the candidates (every value in or above that bin) gathered into shared memory,
//            sorted by (key desc, id asc), the first k written out.
// When the candidates do not fit (many values in one bin, or k itself larger than shared
// memory), two more histogram passes narrow the bin to the exact k-th key, the values above it
// and the lowest-id values equal to it are collected, and a block (or, for k beyond shared
// memory, a segmented device sort) orders them. Typical rows read the logits twice.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/row_math.hpp"
#include "cuda/common.cuh"
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

// The largest k sorted in shared memory; beyond it the selection goes through device memory.
int64_t topk_shared_capacity();
// Device scratch bytes `launch_topk_rows` needs for `rows` rows (0 when k fits shared memory).
size_t topk_scratch_bytes(int64_t rows, int64_t k);
// `scratch` must hold topk_scratch_bytes(rows, k) bytes; sorted_scratch is set from it.
lmloss_status launch_topk_rows(TopkRowsArgs args, void* scratch, cudaStream_t stream);

}  // namespace lmloss::cuda
