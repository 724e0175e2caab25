// The three products of a linear head, through cuBLASLt on the tensor cores, in row-major terms:
//
//   logits    Z  (rows, vocab)   = X (rows, hidden) W^T          forward
//   grad_x    dX (rows, hidden)  = dZ (rows, vocab) W            backward
//   grad_w    dW (vocab, hidden) = dZ^T X  (+ dW when accumulating)
//
// cuBLASLt is column-major, so each row-major product is issued as its transpose. A descriptor,
// its layouts and the algorithm the heuristic puts first (or the first of a preferred tile, see
// MatmulShape::preferred_tile) are made once per problem shape and cached in the context's CUDA
// state; with tuning on, the heuristic's candidates are timed on the shape's first run instead and
// the fastest kept (that run synchronises the stream). alpha and beta are device pointers: the
// f16 gradient scale is known only on the device.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "lmloss/lmloss.h"

namespace lmloss::cuda {

// One column-major product D (m, n) = alpha op(A) op(B) + beta C, C = D; or `batch` of them, the
// i-th of each operand batch_stride_* elements after the (i-1)-th. The strides are not part of
// the plan's key (a caller's buffers may lie at another distance each call): each run sets them.
struct MatmulShape {
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldd = 0;
  int32_t batch = 1;
  int64_t batch_stride_a = 0, batch_stride_b = 0, batch_stride_d = 0;
  bool trans_a = false, trans_b = false;
  lmloss_dtype ab_type = LMLOSS_BF16;  // A and B
  lmloss_dtype d_type = LMLOSS_F32;
  size_t workspace_bytes = 0;
  // Alignment in bytes (a power of two, at most 256) of each pointer: the algorithm must not
  // assume more than the caller's views give.
  uint32_t align_a = 256, align_b = 256, align_d = 256;
  // A tile (cublasLtMatmulTile_t) to take over the heuristic's first choice where the heuristic
  // offers it among its candidates; 0: none. The heuristic cannot see beta (a device pointer).
  int preferred_tile = 0;

  auto key() const {
    return std::tuple(m, n, k, lda, ldb, ldd, batch, trans_a, trans_b, int(ab_type), int(d_type), workspace_bytes,
                      align_a, align_b, align_d, preferred_tile);
  }
  bool operator<(const MatmulShape& o) const { return key() < o.key(); }
};

struct MatmulPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};                    // the heuristic's first (or preferred), or the fastest timed
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's list, best guess first
  bool tuned = false;
};

// The largest power of two (at most 256) dividing the address, the column stride and the batch
// stride in bytes: what every column of every matrix of the batch is aligned to.
inline uint32_t matrix_alignment(const void* p, int64_t ld_bytes, int64_t batch_stride_bytes = 0) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(ld_bytes) |
                      static_cast<uintptr_t>(batch_stride_bytes < 0 ? -batch_stride_bytes : batch_stride_bytes);
  uint32_t align = 256;
  while (align > 1 && (a % align) != 0) align >>= 1;
  return align;
}

class MatmulCache {
 public:
  MatmulCache() = default;
  MatmulCache(const MatmulCache&) = delete;
  MatmulCache& operator=(const MatmulCache&) = delete;
  ~MatmulCache();

  // Creates the handle, and the device zero that beta points to, set on `stream`;
  // LMLOSS_ERROR_BACKEND on failure.
  lmloss_status init(cudaStream_t stream);
  // D = alpha op(A) op(B) + beta D on `stream`; alpha and beta point to device floats. The
  // shape's alignments are taken from the pointers.
  // With `tuning`, a shape's first run times its candidates first (lmloss_context_set_product_tuning).
  lmloss_status run(MatmulShape shape, const void* a, const void* b, void* d,
                    const float* alpha, const float* beta, void* workspace, cudaStream_t stream,
                    bool tuning = false);

 private:
  lmloss_status plan(const MatmulShape& shape, MatmulPlan** out);
  lmloss_status tune(MatmulPlan& p, const MatmulShape& shape, const void* a, const void* b, void* d,
                     const float* beta, void* workspace, cudaStream_t stream);
  cublasLtHandle_t handle_ = nullptr;
  float* zero_ = nullptr;  // a device 0: alpha of the timing runs
  std::map<MatmulShape, MatmulPlan> plans_;
};

}  // namespace lmloss::cuda
