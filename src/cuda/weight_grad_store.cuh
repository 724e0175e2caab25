#pragma once
// The last token chunk's dW product stored straight into a 16-bit dW over the f32 sum it adds
// to (LMLOSS_SUM_GRAD_WEIGHT_IN_F32's rows in place and tail), in place of that product into the
// sum and the rounding pass after it: dW = round(alpha * X^T G + beta * sum), the sum read in
// f32 as the product's C. Also lmloss_round_grad_weight_deferred's store, of a product a step left
// for it, beta the upstream gradient. sm_90a only (CUTLASS takes C and D of different types; cuBLASLt does not).
//
// bf16 row r of dW lands on the f32 row r / 2 held in its bytes, so a product over rows [a, b)
// with b <= 2a stores over no row it reads. The rows go in launches over doubling ranges [R, 2R),
// [2R, 4R), ... up to split, each storing over f32 rows that the launches before it have read,
// then [split, vocab) from the tail; rows [0, R), whose bytes hold their own f32 rows, go to
// scratch first and are copied in last (the same order as launch_regroup_rows' waves).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "lmloss/lmloss.h"

namespace lmloss::cuda {

struct WeightGradStoreArgs {
  int device = 0;
  int64_t vocab = 0, hidden = 0, tokens = 0;  // dW (vocab, hidden); the chunk's tokens
  const void* grad = nullptr;                 // G (tokens, vocab) bf16, row stride grad_ld
  int64_t grad_ld = 0;
  const void* x = nullptr;                    // X (tokens, hidden) bf16, row stride x_ld
  int64_t x_ld = 0;
  const float* alpha = nullptr;               // on the device: scales the product
  const float* beta = nullptr;                // on the device: scales the sum; null: 1
  void* rows = nullptr;                       // dW (vocab, hidden) bf16, dense; f32 rows [0, split) of
  int64_t split = 0;                          //   the sum in its bytes (row r at byte 4 r hidden)
  const float* tail = nullptr;                // the sum's rows [split, vocab), row stride tail_ld
  int64_t tail_ld = 0;
};

// Whether the store runs for these operands on this build and device (else: the product into the
// sum and the rounding pass).
bool weight_grad_store_supported(const WeightGradStoreArgs& args);

// Scratch for the rows stored first and for CUTLASS, 256-byte aligned.
size_t weight_grad_store_workspace(const WeightGradStoreArgs& args);

lmloss_status run_weight_grad_store(const WeightGradStoreArgs& args, void* workspace, cudaStream_t stream);

// A chunk's dW product into a kept sum of bf16 values and 8-bit rests (core/weight_sum_rest.hpp)
// in one kernel, whose epilogue reads the pair beside the product and writes it, in place:
//   first: s = alpha X^T G;                      values = bf16(s), rests = rest(s)
//   add:   s = alpha X^T G + join(values, rests); the same
//   store: values = bf16(alpha X^T G + beta join(values, rests)), the rests only read (the
//          rounding of a sum whose last product was deferred to it)
// sm_90a only: CUTLASS's cooperative 128 x 256 kernel in 2 x 1 clusters, the rests an auxiliary
// tensor loaded and stored by TMA beside C and D (bench/probe_dw_rest.cu measured it).
enum class RestProduct { first, add, store };
struct RestProductArgs {
  int device = 0;
  int64_t vocab = 0, hidden = 0, tokens = 0;  // dW (vocab, hidden); the chunk's tokens
  const void* grad = nullptr;                 // G (tokens, vocab) bf16, row stride grad_ld
  int64_t grad_ld = 0;
  const void* x = nullptr;                    // X (tokens, hidden) bf16, row stride x_ld
  int64_t x_ld = 0;
  const float* alpha = nullptr;               // on the device: scales the product
  const float* beta = nullptr;                // on the device, for `store`: scales the pair
  RestProduct kind = RestProduct::first;
  void* values = nullptr;                     // (vocab, hidden) bf16, row stride values_ld
  int64_t values_ld = 0;
  int8_t* rests = nullptr;                    // (vocab, hidden), row stride rests_ld
  int64_t rests_ld = 0;
};

// Whether the kernel runs for these operands on this build and device (else: the product a slice
// of rows at a time into f32, folded into the pair). Only alignments are read of the pointers.
bool rest_product_supported(const RestProductArgs& args);

// CUTLASS's scratch for these operands, 256-byte aligned (0 where not supported).
size_t rest_product_workspace(const RestProductArgs& args);

lmloss_status run_rest_product(const RestProductArgs& args, void* workspace, cudaStream_t stream);

}  // namespace lmloss::cuda
