// cuBLASLt plans: made once per shape, reused by every call of that shape.
#include "cuda/matmul.cuh"

#include <string>
#include <utility>

#include "core/context.hpp"
#include "cuda/common.cuh"
#include "cuda/cublaslt_library.hpp"

namespace lmloss::cuda {
namespace {

// Only reached once the backend has checked that cuBLASLt loaded (CudaBackend::available).
const CublasLt& lt() { return *cublaslt(); }

cudaDataType_t cuda_type(lmloss_dtype dtype) {
  switch (dtype) {
    case LMLOSS_F16: return CUDA_R_16F;
    case LMLOSS_BF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

lmloss_status lt_fail(const char* what, cublasStatus_t status) {
  return core::fail(LMLOSS_ERROR_BACKEND, std::string("cuBLASLt ") + what + ": " +
                                              lt().GetStatusString(status));
}

#define LMLOSS_LT_TRY(what, expr)                          \
  do {                                                     \
    const cublasStatus_t lmloss_lt_ = (expr);              \
    if (lmloss_lt_ != CUBLAS_STATUS_SUCCESS) return lt_fail(what, lmloss_lt_); \
  } while (0)

// The algorithm's tile (cublasLtMatmulTile_t), or 0 when it does not say.
int algorithm_tile(const cublasLtMatmulAlgo_t& algo) {
  uint32_t tile = 0;
  size_t written = 0;
  const cublasStatus_t st =
      lt().MatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
  return st == CUBLAS_STATUS_SUCCESS && written == sizeof(tile) ? int(tile) : 0;
}

// A batch's count and strides on the plan's layouts: for the heuristic, then for each run (the
// strides may differ from run to run; see MatmulShape).
cublasStatus_t set_batch(MatmulPlan& p, const MatmulShape& s) {
  const std::pair<cublasLtMatrixLayout_t, int64_t> layouts[3] = {
      {p.a, s.batch_stride_a}, {p.b, s.batch_stride_b}, {p.d, s.batch_stride_d}};
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  for (const auto& [layout, stride] : layouts)
    if ((st = lt().MatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &s.batch, sizeof(s.batch))) ||
        (st = lt().MatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                            sizeof(stride))))
      break;
  return st;
}

void destroy(MatmulPlan& p) {
  if (p.a) lt().MatrixLayoutDestroy(p.a);
  if (p.b) lt().MatrixLayoutDestroy(p.b);
  if (p.d) lt().MatrixLayoutDestroy(p.d);
  if (p.desc) lt().MatmulDescDestroy(p.desc);
  p = MatmulPlan{};
}

}  // namespace

MatmulCache::~MatmulCache() {
  for (auto& [shape, plan] : plans_) destroy(plan);
  if (handle_) lt().Destroy(handle_);
  if (zero_) cudaFree(zero_);
}

lmloss_status MatmulCache::init(cudaStream_t stream) {
  if (handle_) return LMLOSS_SUCCESS;
  LMLOSS_LT_TRY("create", lt().Create(&handle_));
  LMLOSS_CUDA_TRY(cudaMalloc(&zero_, sizeof(float)));
  LMLOSS_CUDA_TRY(cudaMemsetAsync(zero_, 0, sizeof(float), stream));
  return LMLOSS_SUCCESS;
}

lmloss_status MatmulCache::plan(const MatmulShape& s, MatmulPlan** out) {
  if (auto it = plans_.find(s); it != plans_.end()) {
    *out = &it->second;
    return LMLOSS_SUCCESS;
  }
  MatmulPlan p;
  // f32 inputs keep full f32 arithmetic (the 1e-5 accuracy rule); 16-bit inputs accumulate in f32.
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  const cublasStatus_t created = lt().MatmulDescCreate(&p.desc, compute, CUDA_R_32F);
  if (created != CUBLAS_STATUS_SUCCESS) return lt_fail("descriptor", created);
  auto fail_with = [&](const char* what, cublasStatus_t st) {
    destroy(p);
    return lt_fail(what, st);
  };
  const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasLtPointerMode_t mode = CUBLASLT_POINTER_MODE_DEVICE;
  cublasStatus_t st;
  if ((st = lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta))) ||
      (st = lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb))) ||
      (st = lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode,
                                           sizeof(mode))))
    return fail_with("descriptor attribute", st);
  // Stored shapes of A and B before op(): op(A) is (m, k), op(B) is (k, n).
  const uint64_t a_rows = s.trans_a ? s.k : s.m, a_cols = s.trans_a ? s.m : s.k;
  const uint64_t b_rows = s.trans_b ? s.n : s.k, b_cols = s.trans_b ? s.k : s.n;
  if ((st = lt().MatrixLayoutCreate(&p.a, cuda_type(s.ab_type), a_rows, a_cols, s.lda)) ||
      (st = lt().MatrixLayoutCreate(&p.b, cuda_type(s.ab_type), b_rows, b_cols, s.ldb)) ||
      (st = lt().MatrixLayoutCreate(&p.d, cuda_type(s.d_type), s.m, s.n, s.ldd)))
    return fail_with("layout", st);
  if (s.batch > 1 && (st = set_batch(p, s))) return fail_with("batch layout", st);

  cublasLtMatmulPreference_t pref = nullptr;
  if ((st = lt().MatmulPreferenceCreate(&pref))) return fail_with("preference", st);
  const uint64_t ws = s.workspace_bytes;
  st = lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                            sizeof(ws));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                              &s.align_a, sizeof(s.align_a));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                              &s.align_b, sizeof(s.align_b));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                              &s.align_d, sizeof(s.align_d));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                              &s.align_d, sizeof(s.align_d));
  constexpr int kCandidates = 8;  // what tuning may time; the first is used untuned
  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = lt().MatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.d, p.d, pref, kCandidates,
                                        results, &found);
  lt().MatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return fail_with("heuristic", st);
  if (found == 0) return fail_with("heuristic (no algorithm)", CUBLAS_STATUS_NOT_SUPPORTED);
  p.algo = results[0].algo;
  for (int i = 0; i < found; ++i) p.candidates.push_back(results[i].algo);
  for (int i = 0; s.preferred_tile != 0 && i < found; ++i)
    if (algorithm_tile(results[i].algo) == s.preferred_tile) {
      p.algo = results[i].algo;
      break;
    }
  auto [it, inserted] = plans_.emplace(s, p);
  *out = &it->second;
  return LMLOSS_SUCCESS;
}

// Times each candidate on the call's own operands and keeps the fastest. The timing runs take
// alpha = 0 (a device pointer, so the product is still computed in full) and the call's beta:
// D is left as it was when beta is 1 (accumulation) and zeroed when beta is 0, and the call's
// own run follows either way.
lmloss_status MatmulCache::tune(MatmulPlan& p, const MatmulShape& s, const void* a, const void* b,
                                void* d, const float* beta, void* workspace, cudaStream_t stream) {
  p.tuned = true;
  if (p.candidates.size() < 2) return LMLOSS_SUCCESS;
  cudaEvent_t start = nullptr, stop = nullptr;
  LMLOSS_CUDA_TRY(cudaEventCreate(&start));
  if (const cudaError_t e = cudaEventCreate(&stop); e != cudaSuccess) {
    cudaEventDestroy(start);
    LMLOSS_CUDA_TRY(e);
  }
  constexpr int kRuns = 3;  // after one warm-up run; the best of them counts
  float best_ms = 0.f;
  lmloss_status status = LMLOSS_SUCCESS;
  for (const cublasLtMatmulAlgo_t& algo : p.candidates) {
    auto launch = [&] {
      return lt().Matmul(handle_, p.desc, zero_, a, p.a, b, p.b, beta, d, p.d, d, p.d, &algo,
                         workspace, s.workspace_bytes, stream);
    };
    if (launch() != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that will not run is skipped
    float fastest = 0.f;
    for (int r = 0; r < kRuns; ++r) {
      float ms = 0.f;
      if (cudaEventRecord(start, stream) != cudaSuccess || launch() != CUBLAS_STATUS_SUCCESS ||
          cudaEventRecord(stop, stream) != cudaSuccess || cudaEventSynchronize(stop) != cudaSuccess ||
          cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
        status = core::fail(LMLOSS_ERROR_BACKEND, "cuBLASLt: timing a candidate algorithm failed");
        break;
      }
      if (r == 0 || ms < fastest) fastest = ms;
    }
    if (status != LMLOSS_SUCCESS) break;
    if (best_ms == 0.f || fastest < best_ms) {
      best_ms = fastest;
      p.algo = algo;
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  // A time above the card's peak rate means the timing saw something else than the product
  // (say, a kernel that skips its work when alpha is 0): keep the heuristic's first choice.
  const double flops = 2.0 * double(s.m) * double(s.n) * double(s.k) * double(s.batch);
  if (status == LMLOSS_SUCCESS && best_ms > 0.f && flops / (double(best_ms) * 1e-3) > 2e15)
    p.algo = p.candidates.front();
  return status;
}

lmloss_status MatmulCache::run(MatmulShape shape, const void* a, const void* b, void* d,
                               const float* alpha, const float* beta, void* workspace,
                               cudaStream_t stream, bool tuning) {
  const int64_t ab_size = shape.ab_type == LMLOSS_F32 ? 4 : 2;
  const int64_t d_size = shape.d_type == LMLOSS_F32 ? 4 : 2;
  shape.align_a = matrix_alignment(a, shape.lda * ab_size, shape.batch_stride_a * ab_size);
  shape.align_b = matrix_alignment(b, shape.ldb * ab_size, shape.batch_stride_b * ab_size);
  shape.align_d = matrix_alignment(d, shape.ldd * d_size, shape.batch_stride_d * d_size);
  if (workspace == nullptr) shape.workspace_bytes = 0;
  MatmulPlan* p = nullptr;
  if (const lmloss_status st = plan(shape, &p); st != LMLOSS_SUCCESS) return st;
  if (shape.batch > 1) LMLOSS_LT_TRY("batch layout", set_batch(*p, shape));
  if (tuning && !p->tuned) {
    LMLOSS_CHECK(refuse_under_capture(stream,
                                      "product tuning: a product shape's first call times cuBLASLt's candidates "
                                      "and waits for them, which cannot be captured into a CUDA graph; make "
                                      "that call before capturing"));
    if (const lmloss_status st = tune(*p, shape, a, b, d, beta, workspace, stream); st != LMLOSS_SUCCESS) return st;
  }
  LMLOSS_LT_TRY("matmul", lt().Matmul(handle_, p->desc, alpha, a, p->a, b, p->b, beta, d, p->d,
                                         d, p->d, &p->algo, workspace, shape.workspace_bytes,
                                         stream));
  return LMLOSS_SUCCESS;
}

}  // namespace lmloss::cuda
