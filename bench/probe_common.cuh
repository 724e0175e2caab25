// What the dW probes (probe_dw_store.cu, probe_dw_rest.cu) share: error checks, fills, the
// cuBLASLt dW product they time against, CUTLASS setup, and the timing loop. Not part of the
// library.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;

#define CUDA_OK(x)                                                          \
  do {                                                                      \
    cudaError_t e_ = (x);                                                   \
    if (e_ != cudaSuccess) {                                                \
      printf("cuda %s line %d\n", cudaGetErrorString(e_), __LINE__);        \
      exit(1);                                                              \
    }                                                                       \
  } while (0)
#define LT_OK(x)                                                            \
  do {                                                                      \
    cublasStatus_t s_ = (x);                                                \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                      \
      printf("cublasLt %d line %d\n", int(s_), __LINE__);                   \
      exit(1);                                                              \
    }                                                                       \
  } while (0)

__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16((float(h & 0xffffff) / 16777216.f - 0.5f) * scale);
  }
}

inline float bf(__nv_bfloat16 v) { return __bfloat162float(v); }

// dW (col-major H x V, ld H) = beta dW + X^T-view * G-view^T, dW of dtype `out`.
struct LtProduct {
  cublasLtHandle_t lt;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;
  void* ws;
  size_t ws_bytes = 32u << 20;
  LtProduct(cublasLtHandle_t h, int V, int H, int K, cudaDataType out) : lt(h) {
    LT_OK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t tn = CUBLAS_OP_N, tt = CUBLAS_OP_T;
    LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &tn, sizeof(tn)));
    LT_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tt, sizeof(tt)));
    LT_OK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, H, K, H));
    LT_OK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, V, K, V));
    LT_OK(cublasLtMatrixLayoutCreate(&lc, out, H, V, H));
    CUDA_OK(cudaMalloc(&ws, ws_bytes));
    cublasLtMatmulPreference_t pref;
    LT_OK(cublasLtMatmulPreferenceCreate(&pref));
    LT_OK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                               sizeof(ws_bytes)));
    cublasLtMatmulHeuristicResult_t r; int found = 0;
    LT_OK(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &r, &found));
    if (!found) { printf("no cuBLASLt algorithm\n"); exit(1); }
    algo = r.algo;
  }
  void run(const void* x, const void* g, void* c, float beta, cudaStream_t s) {
    const float alpha = 1.f;
    LT_OK(cublasLtMatmul(lt, desc, &alpha, x, la, g, lb, &beta, c, lc, c, lc, &algo, ws, ws_bytes, s));
  }
};

// A CUTLASS device GEMM set up once for its arguments (its workspace allocated here), run by run.
template <class Gemm>
void cutlass_initialize(Gemm& gemm, typename Gemm::Arguments const& args, void** ws) {
  const size_t bytes = Gemm::get_workspace_size(args);
  if (bytes) CUDA_OK(cudaMalloc(ws, bytes));
  cutlass::Status st = gemm.can_implement(args);
  if (st == cutlass::Status::kSuccess) st = gemm.initialize(args, *ws);
  if (st != cutlass::Status::kSuccess) { printf("cutlass init: %s\n", cutlass::cutlassGetStatusString(st)); exit(1); }
}
template <class Gemm>
void cutlass_run(Gemm& gemm, cudaStream_t s) {
  const cutlass::Status st = gemm.run(s);
  if (st != cutlass::Status::kSuccess) { printf("cutlass run: %s\n", cutlass::cutlassGetStatusString(st)); exit(1); }
}

// The last chunk's dW product stored in bf16 over the f32 sum C it adds to (CUTLASS sm90, C read
// in f32): dW = bf16(alpha P + C), alpha P alone without with_c, alpha (P + C) with scale_c.
template <class Tile, class Cluster, class MainSched, class EpiSched>
struct DwStore {
  using A = cutlass::bfloat16_t;
  using LayoutA = cutlass::layout::ColumnMajor;  // A(v, k) = G[k * V + v]
  using LayoutB = cutlass::layout::RowMajor;     // B(k, h) = X[k * H + h]
  using LayoutC = cutlass::layout::RowMajor;     // dW[v * H + h]
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, LayoutC, 4, cutlass::bfloat16_t,
      LayoutC, 8, EpiSched>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, A, LayoutA, 8, A, LayoutB, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      MainSched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  Gemm gemm;
  void* ws = nullptr;
  typename Gemm::Arguments args;
  // Rows [first, first + rows) of dW (all of them by default); G's rows are V apart. The scale
  // multiplies the product, and with scale_c C too (the upstream gradient of a deferred product).
  DwStore(int V, int H, int K, const void* g, const void* x, const float* c, void* d, const float* alpha, bool with_c,
          int sms, int first = 0, int rows = -1, bool scale_c = false) {
    if (rows < 0) rows = V - first;
    typename Kernel::StrideA sa = make_stride(Int<1>{}, int64_t(V), int64_t(0));
    typename Kernel::StrideB sb = make_stride(Int<1>{}, int64_t(H), int64_t(0));
    typename Kernel::StrideC sc = make_stride(int64_t(H), Int<1>{}, int64_t(0));
    typename Kernel::StrideD sd = make_stride(int64_t(H), Int<1>{}, int64_t(0));
    args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                                    {rows, H, K, 1},
                                    {static_cast<const A*>(g) + first, sa, static_cast<const A*>(x), sb},
                                    {{}, c, sc, static_cast<cutlass::bfloat16_t*>(d), sd}};
    args.epilogue.thread.alpha = 1.f;
    args.epilogue.thread.alpha_ptr = alpha;
    args.epilogue.thread.beta = with_c ? 1.f : 0.f;
    if (scale_c) args.epilogue.thread.beta_ptr = alpha;
    args.hw_info.sm_count = sms;
    cutlass_initialize(gemm, args, &ws);
  }
  void run(cudaStream_t s) { cutlass_run(gemm, s); }
};

// Each variant once to warm, then `reps` rounds of three timings each (CUDA events; prep, when set,
// runs before each timing, outside it); prints the medians and their rate for `flops`.
struct Variant {
  const char* name;
  std::function<void()> run;
  std::function<void()> prep = {};
  std::vector<float> ms = {};
};
inline void time_variants(std::vector<Variant>& vs, int reps, cudaStream_t s, double flops, const char* header) {
  cudaEvent_t e0, e1; CUDA_OK(cudaEventCreate(&e0)); CUDA_OK(cudaEventCreate(&e1));
  for (auto& v : vs) {
    if (v.prep) v.prep();
    v.run();
  }
  CUDA_OK(cudaStreamSynchronize(s));
  for (int round = 0; round < reps; ++round)
    for (auto& v : vs)
      for (int i = 0; i < 3; ++i) {
        if (v.prep) v.prep();
        CUDA_OK(cudaEventRecord(e0, s)); v.run(); CUDA_OK(cudaEventRecord(e1, s)); CUDA_OK(cudaEventSynchronize(e1));
        float ms; CUDA_OK(cudaEventElapsedTime(&ms, e0, e1)); v.ms.push_back(ms);
      }
  printf("%s, %d timings each (medians)\n", header, 3 * reps);
  for (auto& v : vs) {
    std::sort(v.ms.begin(), v.ms.end());
    const float med = v.ms[v.ms.size() / 2];
    printf("%-36s %8.3f ms  %6.1f TFLOP/s  (min %.3f)\n", v.name, med, flops / med / 1e9, v.ms.front());
  }
}
