// Shared pieces of the CUDA backend: status checks, storage types, loads and stores that convert
// to float, block reductions that always combine in the same order (so results are bitwise
// reproducible), and the per-call scalars that live on the device.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/context.hpp"
#include "lmloss/lmloss.h"

namespace lmloss::cuda {

// Returns from the enclosing function with LMLOSS_ERROR_BACKEND and a message naming the call.
#define LMLOSS_CUDA_TRY(expr)                                                                  \
  do {                                                                                         \
    const cudaError_t lmloss_err_ = (expr);                                                    \
    if (lmloss_err_ != cudaSuccess) {                                                          \
      return ::lmloss::core::fail(LMLOSS_ERROR_BACKEND, std::string(#expr) + ": " +            \
                                                            cudaGetErrorString(lmloss_err_)); \
    }                                                                                          \
  } while (0)

// After a launch: a launch error (bad configuration, missing kernel image) becomes a status.
#define LMLOSS_CUDA_LAUNCHED(name)                                                             \
  do {                                                                                         \
    const cudaError_t lmloss_err_ = cudaGetLastError();                                        \
    if (lmloss_err_ != cudaSuccess) {                                                          \
      return ::lmloss::core::fail(LMLOSS_ERROR_BACKEND, std::string("launching " name ": ") + \
                                                            cudaGetErrorString(lmloss_err_)); \
    }                                                                                          \
  } while (0)

// LMLOSS_SUCCESS, or LMLOSS_ERROR_UNSUPPORTED when `stream` is capturing a CUDA graph: for work
// that a graph cannot hold (made once for later calls, or waiting for the device). `what` says
// which work and ends with what the caller does instead.
inline lmloss_status refuse_under_capture(cudaStream_t stream, const char* what) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  LMLOSS_CUDA_TRY(cudaStreamIsCapturing(stream, &capture));
  if (capture == cudaStreamCaptureStatusNone) return LMLOSS_SUCCESS;
  return core::fail(LMLOSS_ERROR_UNSUPPORTED, what);
}

// Values the kernels of one call compute on the device and share (never read by the host).
struct CallScalars {
  float inv_denominator;  // 1 / D for mean, 1 for sum and none
  float upstream;         // the scalar upstream gradient (1 when absent)
  float grad_scale;       // S: f16 gradients are stored times S (a power of two), else 1
  float inv_grad_scale;   // 1 / S: alpha of the backward products
  float token_scale;      // upstream / D (mean), upstream (sum), 1 (none): alpha of the backward
                          // products where the rows carry the rest (the exponential form)
  float zero;             // beta constants for the products (device pointer mode)
  float one;
  long long counted;      // D before the normalizer
};

// ---- storage types -------------------------------------------------------------------------

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Reads element i of an id tensor of dtype i32 or i64.
__device__ __forceinline__ int64_t load_id(const void* base, lmloss_dtype dtype, int64_t i) {
  return dtype == LMLOSS_I64 ? static_cast<const int64_t*>(base)[i]
                             : static_cast<int64_t>(static_cast<const int32_t*>(base)[i]);
}

// Reads element i of an optional float tensor of dtype f32/f16/bf16 (the bias).
__device__ __forceinline__ float load_float(const void* base, lmloss_dtype dtype, int64_t i) {
  switch (dtype) {
    case LMLOSS_F16: return __half2float(static_cast<const __half*>(base)[i]);
    case LMLOSS_BF16: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// ---- vectorised row access -----------------------------------------------------------------

// 16 bytes of T at a time: 4 floats or 8 halves.
template <typename T> struct Vec {
  static constexpr int size = 16 / sizeof(T);
  alignas(16) T v[size];
};

// Calls f(j, value) for every j in [0, n) of row `row`, each thread a strided share, with 16-byte
// loads over the aligned middle of the row and scalar loads at its ragged ends. The loads of
// kLoadsInFlight of a thread's vectors are issued before any is used: one block streams a row, and
// with one 16-byte load per thread waiting at a time top-k's rows kernel read 1.7 TB/s on an H200
// (0.585 ms for 1920 rows of 128256 f32 logits at k 129; 0.48 ms with four in flight). Each
// thread still sees its values in order.
constexpr int kLoadsInFlight = 4;

template <typename T, typename F>
__device__ __forceinline__ void for_each_in_row(const T* row, int64_t n, F&& f) {
  constexpr int width = Vec<T>::size;
  const uintptr_t address = reinterpret_cast<uintptr_t>(row);
  int64_t head = static_cast<int64_t>(((16 - (address & 15)) & 15) / sizeof(T));
  if ((address % sizeof(T)) != 0) head = n;  // unaligned element pointer: scalar only
  if (head > n) head = n;
  const int64_t body = (n - head) / width;
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) f(j, to_float(row[j]));
  const Vec<T>* vectors = reinterpret_cast<const Vec<T>*>(row + head);
  const int64_t stride = blockDim.x;
  int64_t i = threadIdx.x;
  for (; i + (kLoadsInFlight - 1) * stride < body; i += kLoadsInFlight * stride) {
    Vec<T> chunk[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) chunk[u] = vectors[i + u * stride];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
#pragma unroll
      for (int e = 0; e < width; ++e) f(head + (i + u * stride) * width + e, to_float(chunk[u].v[e]));
    }
  }
  for (; i < body; i += stride) {
    const Vec<T> chunk = vectors[i];
#pragma unroll
    for (int e = 0; e < width; ++e) f(head + i * width + e, to_float(chunk.v[e]));
  }
  for (int64_t j = head + body * width + threadIdx.x; j < n; j += blockDim.x) f(j, to_float(row[j]));
}

// ---- deterministic block reductions ----------------------------------------------------------
// A fixed shuffle tree inside each warp, then warp 0 over the warp results: the same inputs
// combine in the same order on every run. `scratch` holds 32 entries; the result reaches every
// thread. Callers put a __syncthreads() between two reductions that share scratch.

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = warp_reduce(v, op);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < warps ? scratch[lane] : identity;
  r = warp_reduce(r, op);
  __syncthreads();  // scratch may be reused right after
  return r;
}

struct Sum {
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// x . w in f32 over h 16-bit elements (h a multiple of 8, both 16-byte aligned), by one warp; every
// lane gets the same sum. A lane's loads go out kDotLoadsInFlight vectors at a time, summed in the
// order of one at a time: a row of W comes from device memory, and one load a step left each dot
// waiting out h / 256 memory latencies.
constexpr int kDotLoadsInFlight = 4;
template <typename T>
__device__ float warp_dot(const T* x, const T* w, int64_t h) {
  constexpr int64_t kStep = 32 * 8;
  float sum = 0.f;
  auto add = [&sum](const Vec<T>& a, const Vec<T>& b) {
#pragma unroll
    for (int e = 0; e < 8; ++e) sum = fmaf(to_float(a.v[e]), to_float(b.v[e]), sum);
  };
  int64_t i = (threadIdx.x & 31) * 8;
  for (; i + (kDotLoadsInFlight - 1) * kStep < h; i += kDotLoadsInFlight * kStep) {
    Vec<T> a[kDotLoadsInFlight], b[kDotLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kDotLoadsInFlight; ++u) {
      a[u] = *reinterpret_cast<const Vec<T>*>(x + i + u * kStep);
      b[u] = *reinterpret_cast<const Vec<T>*>(w + i + u * kStep);
    }
#pragma unroll
    for (int u = 0; u < kDotLoadsInFlight; ++u) add(a[u], b[u]);
  }
  for (; i < h; i += kStep)
    add(*reinterpret_cast<const Vec<T>*>(x + i), *reinterpret_cast<const Vec<T>*>(w + i));
  return warp_reduce(sum, Sum{});
}

// log2(e): exp(x) = exp2(x kLog2e), the form the exponential unit takes.
constexpr float kLog2e = 1.4426950408889634f;

// Online (max, sum of exp(x - max)) pairs, merged.
struct MaxSum {
  float max;
  float sum;
};
// The online (max, sum of exp) of a row's values, one value at a time.
__device__ __forceinline__ void add_to_lse(MaxSum& acc, float s) {
  if (s > acc.max) {
    acc.sum = acc.sum * expf(acc.max - s) + 1.f;
    acc.max = s;
  } else if (s == acc.max) {  // exp(0), also where both are +inf and exp(inf - inf) would be NaN
    if (s != -INFINITY) acc.sum += 1.f;  // a masked logit adds nothing
  } else {
    acc.sum += expf(s - acc.max);
  }
}
// The side holding the max keeps its sum as it is: exp(m - m) is NaN at m = +-inf (rows masked
// whole with -inf, or a logit of +inf).
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  return {m, (a.max == m ? a.sum : a.sum * expf(a.max - m)) + (b.max == m ? b.sum : b.sum * expf(b.max - m))};
}

__device__ __forceinline__ MaxSum block_reduce_maxsum(MaxSum v, float2* scratch) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.max, offset), __shfl_xor_sync(0xffffffffu, v.sum, offset)};
    v = merge(v, other);
  }
  if (lane == 0) scratch[warp] = make_float2(v.max, v.sum);
  __syncthreads();
  MaxSum r = lane < warps ? MaxSum{scratch[lane].x, scratch[lane].y} : MaxSum{-INFINITY, 0.f};
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, r.max, offset), __shfl_xor_sync(0xffffffffu, r.sum, offset)};
    r = merge(r, other);
  }
  // merge(a, b) and merge(b, a) may round differently (a fused multiply-add takes one product
  // unrounded), so the lanes of a butterfly can disagree in the last bit: every thread takes
  // lane 0's result, the value a saved lse holds too.
  r.max = __shfl_sync(0xffffffffu, r.max, 0);
  r.sum = __shfl_sync(0xffffffffu, r.sum, 0);
  __syncthreads();
  return r;
}

// The block's log-sum-exp from each thread's online (max, sum of exp); every thread gets it.
__device__ __forceinline__ float block_lse(MaxSum v, float2* scratch) {
  v = block_reduce_maxsum(v, scratch);
  return v.max + logf(v.sum);
}

// Blocks for a grid over `rows` rows, each block looping over rows when there are more rows than
// a grid may hold.
inline unsigned int row_grid(int64_t rows) {
  constexpr int64_t limit = 1ll << 30;
  return static_cast<unsigned int>(rows < limit ? (rows > 0 ? rows : 1) : limit);
}

// Workspace pieces start on 256-byte boundaries, as cudaMalloc's blocks do.
inline size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }
// Where TMA copies and 16-byte vector accesses may start.
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace lmloss::cuda
