// The CUDA paths of `lmloss bench` (bench.hpp), with cuBLASLt products in the inputs' dtype and
// f32 accumulation, all on one stream:
//   floor:  Z = X W^T, dX = Z W, dW = Z^T X       (Z stands in for its gradient; dW in f32)
//   naive:  Z = X W^T into a (tokens, vocab) buffer of the input dtype; loss and dZ by lmloss's
//           logits path into a second such buffer; dX = dZ W; dW = dZ^T X
//   fused:  lmloss_loss_forward_backward(hidden, weight) -> loss, dX (input dtype), dW (f32)
//
// Built with -DLMLOSS_BENCH_CUDA_MAIN the file is instead a program of its own that times every
// mode of the issue on one preset (fused fwd+bwd with dX and dW, dX only, forward only, top-k,
// top-k distillation as `distillK` for a teacher's k ids; and `seedtopkK`, the seed's top-k scheme
// that top-k is held to) against its own floor of bare products, and the fused step over a range
// of workspace budgets; CUDA events, L2 flushed before every timed run, median of the repeats.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/cublaslt_library.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::tools {
namespace {

// cuBLASLt through the library's loader, as the library takes it: the command then starts where
// the CUDA libraries are not installed, and only its CUDA paths fail, saying why.
const cuda::CublasLt& lt() {
  const cuda::CublasLt* api = cuda::cublaslt();
  if (!api) throw std::runtime_error(std::string("cuBLASLt: ") + cuda::cublaslt_error());
  return *api;
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": " + lt().GetStatusString(s));
}

// The library's own RAII context (lmloss.hpp is C++17, as CUDA sources are built).
using Ctx = lmloss::Context;
// Descriptors of device memory.
lmloss_tensor on_device(lmloss_tensor t) {
  t.device_type = LMLOSS_DEVICE_CUDA;
  return t;
}
lmloss_tensor dev_matrix(void* p, lmloss_dtype d, int64_t rows, int64_t cols) {
  return on_device(lmloss_tensor_2d(p, d, rows, cols, 0));
}
lmloss_tensor dev_vector(void* p, lmloss_dtype d, int64_t n) { return on_device(lmloss_tensor_1d(p, d, n)); }
lmloss_tensor dev_scalar(void* p, lmloss_dtype d) { return on_device(lmloss_tensor_scalar(p, d)); }
lmloss_head linear_head(lmloss_tensor x, lmloss_tensor w) {
  lmloss_head h{};
  h.logits = h.bias = lmloss_tensor_none();
  h.hidden = x;
  h.weight = w;
  return h;
}
lmloss_targets make_targets(lmloss_tensor labels, lmloss_tensor ids, lmloss_tensor probs) {
  lmloss_targets t{};
  t.labels = labels;
  t.teacher_ids = ids;
  t.teacher_probs = probs;
  t.token_mask = lmloss_tensor_none();
  return t;
}
lmloss_grads make_grads(lmloss_tensor gl, lmloss_tensor gx, lmloss_tensor gw) {
  lmloss_grads g{};
  g.grad_logits = gl;
  g.grad_hidden = gx;
  g.grad_weight = gw;
  g.grad_bias = lmloss_tensor_none();
  return g;
}
void forward_backward(Ctx& ctx, const lmloss_head& h, const lmloss_targets& t, const lmloss_loss_options& o,
                      lmloss_tensor loss, const lmloss_grads& g) {
  const lmloss_tensor none = lmloss_tensor_none();
  lmloss::check(lmloss_loss_forward_backward(ctx.get(), &h, &t, &o, &none, &loss, &none, &g));
}

cudaDataType_t cuda_type(lmloss_dtype d) {
  return d == LMLOSS_BF16 ? CUDA_R_16BF : d == LMLOSS_F16 ? CUDA_R_16F : CUDA_R_32F;
}
size_t type_size(lmloss_dtype d) { return d == LMLOSS_F32 ? 4 : 2; }

// A product's row strides other than the contiguous ones (0: contiguous), and a strided batch:
// `batch` products, matrix i of each operand `batch_*` elements after matrix i - 1. With
// `pointer_array`, the batch's matrices are wherever device arrays of `batch` pointers say: run()
// then takes those arrays in place of the operands.
struct ProductStrides {
  int64_t lda = 0, ldb = 0, ldc = 0;
  int32_t batch = 1;
  int64_t batch_a = 0, batch_b = 0, batch_c = 0;
  bool pointer_array = false;
};

// Row-major products through cuBLASLt, each planned once (descriptor, layouts, algorithm).
class Products {
 public:
  Products() { lt_check(lt().Create(&handle_), "cublasLtCreate"); }
  ~Products() {
    for (auto& [key, p] : plans_) {
      lt().MatrixLayoutDestroy(p.a);
      lt().MatrixLayoutDestroy(p.b);
      lt().MatrixLayoutDestroy(p.c);
      lt().MatmulDescDestroy(p.desc);
    }
    if (workspace_) cudaFree(workspace_);
    lt().Destroy(handle_);
  }
  // Row-major C (m, n) = A (m, k) B (k, n) [+ C], where A is stored transposed when a_t (as
  // (k, m)) and B when b_t (as (n, k)); contiguous unless `st` says otherwise.
  void run(int64_t m, int64_t n, int64_t k, bool a_t, bool b_t, const void* a, const void* b, void* c,
           lmloss_dtype ab, lmloss_dtype c_type, cudaStream_t stream, float beta = 0.f, const ProductStrides& st = {}) {
    if (!workspace_) cuda_check(cudaMalloc(&workspace_, kWorkspace), "cudaMalloc workspace");
    // Column-major view: C^T (n, m) = op(B)^T (n, k) op(A)^T (k, m).
    const Key key = make_key(m, n, k, a_t, b_t, ab, c_type, st);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      Plan p;
      lt_check(lt().MatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
      const cublasOperation_t ta = b_t ? CUBLAS_OP_T : CUBLAS_OP_N;  // first operand: B^T
      const cublasOperation_t tb = a_t ? CUBLAS_OP_T : CUBLAS_OP_N;
      lt_check(lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)), "transa");
      lt_check(lt().MatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)), "transb");
      // First operand B^T: col-major (n, k); stored B row-major (k, n) = col-major (n, k), ld n;
      // stored transposed (n, k) row-major = col-major (k, n), ld k.
      const int64_t ldb = st.ldb ? st.ldb : b_t ? k : n, lda = st.lda ? st.lda : a_t ? m : k;
      if (b_t) lt_check(lt().MatrixLayoutCreate(&p.a, cuda_type(ab), k, n, ldb), "layout");
      else lt_check(lt().MatrixLayoutCreate(&p.a, cuda_type(ab), n, k, ldb), "layout");
      if (a_t) lt_check(lt().MatrixLayoutCreate(&p.b, cuda_type(ab), m, k, lda), "layout");
      else lt_check(lt().MatrixLayoutCreate(&p.b, cuda_type(ab), k, m, lda), "layout");
      lt_check(lt().MatrixLayoutCreate(&p.c, cuda_type(c_type), n, m, st.ldc ? st.ldc : n), "layout");
      if (st.batch > 1) {
        const int64_t batch_strides[3] = {st.batch_b, st.batch_a, st.batch_c};  // as p.a, p.b, p.c
        const cublasLtMatrixLayout_t layouts[3] = {p.a, p.b, p.c};
        for (int i = 0; i < 3; ++i) {
          lt_check(lt().MatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &st.batch,
                                                 sizeof(st.batch)),
                   "batch count");
          if (st.pointer_array) {
            const uint32_t mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
            lt_check(lt().MatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &mode,
                                                   sizeof(mode)),
                     "batch mode");
            continue;
          }
          lt_check(lt().MatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                 &batch_strides[i], sizeof(batch_strides[i])),
                   "batch stride");
        }
      }
      cublasLtMatmulPreference_t pref;
      lt_check(lt().MatmulPreferenceCreate(&pref), "pref");
      const uint64_t ws = kWorkspace;
      lt_check(lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
               "pref ws");
      cublasLtMatmulHeuristicResult_t results[kCandidates]{};
      int found = 0;
      lt_check(lt().MatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c, pref, kCandidates, results,
                                           &found),
               "heuristic");
      lt().MatmulPreferenceDestroy(pref);
      if (!found) throw std::runtime_error("cuBLASLt: no algorithm");
      p.algo = results[0].algo;
      for (int i = 0; i < found; ++i) {
        p.candidates.push_back(results[i].algo);
        p.waves.push_back(results[i].wavesCount);
      }
      it = plans_.emplace(key, p).first;
    }
    const Plan& p = it->second;
    const float alpha = 1.f;
    const cublasLtMatmulAlgo_t& algo =
        candidate_ < 0 ? p.algo : p.candidates[std::min<size_t>(candidate_, p.candidates.size() - 1)];
    lt_check(lt().Matmul(handle_, p.desc, &alpha, b, p.a, a, p.b, &beta, c, p.c, c, p.c, &algo, workspace_,
                         kWorkspace, stream),
             "cublasLtMatmul");
  }
#if defined(LMLOSS_BENCH_CUDA_MAIN)  // the modes program's algorithm survey
  // How many algorithms the heuristic offered for a planned shape (run it once first).
  size_t candidates(int64_t m, int64_t n, int64_t k, bool a_t, bool b_t, lmloss_dtype ab, lmloss_dtype c_type) const {
    const auto it = plans_.find(make_key(m, n, k, a_t, b_t, ab, c_type, {}));
    return it == plans_.end() ? 0 : it->second.candidates.size();
  }
  // The planned shape's i-th candidate forced to split K in `splits` parts, reduced by `scheme`
  // (COMPUTE_TYPE: in f32 in the workspace, then a separate step; INPLACE: in the output, the
  // parts in order by counters), if cuBLASLt accepts that configuration; its estimate of the
  // waves goes to *waves. False when it does not run.
  bool run_split(int64_t m, int64_t n, int64_t k, bool a_t, bool b_t, const void* a, const void* b, void* c,
                 lmloss_dtype ab, lmloss_dtype c_type, cudaStream_t stream, size_t i, int32_t splits,
                 uint32_t scheme, void* workspace, size_t workspace_bytes, float* waves) {
    const Plan& p = plans_.at(make_key(m, n, k, a_t, b_t, ab, c_type, {}));
    if (i >= p.candidates.size()) return false;
    cublasLtMatmulAlgo_t algo = p.candidates[i];
    if (splits == 1) scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
    if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits)) ||
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme)))
      return false;
    cublasLtMatmulHeuristicResult_t result{};
    if (cublasLtMatmulAlgoCheck(handle_, p.desc, p.a, p.b, p.c, p.c, &algo, &result) != CUBLAS_STATUS_SUCCESS ||
        result.workspaceSize > workspace_bytes)
      return false;
    *waves = result.wavesCount;
    const float alpha = 1.f, beta = 0.f;
    return cublasLtMatmul(handle_, p.desc, &alpha, b, p.a, a, p.b, &beta, c, p.c, c, p.c, &algo, workspace,
                          workspace_bytes, stream) == CUBLAS_STATUS_SUCCESS;
  }
  // Later runs use the heuristic's i-th algorithm (-1: its first, the default).
  void use_candidate(int i) { candidate_ = i; }
  // The i-th candidate's configuration: algorithm id, tile, stages, split-K, reduction scheme,
  // swizzle, custom option, inner and cluster shape (cuBLASLt's enum values; -1 where it does not
  // say), and the heuristic's estimate of its waves.
  std::string candidate_config(int64_t m, int64_t n, int64_t k, bool a_t, bool b_t, lmloss_dtype ab,
                               lmloss_dtype c_type, size_t i) const {
    const Plan& p = plans_.at(make_key(m, n, k, a_t, b_t, ab, c_type, {}));
    const cublasLtMatmulAlgo_t& algo = p.candidates.at(i);
    auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) -> long long {
      size_t size = 0;  // each attribute has its own width: ask for it first
      if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, nullptr, 0, &size) != CUBLAS_STATUS_SUCCESS || size > 8)
        return -1;
      uint64_t value = 0;  // little-endian: the low bytes hold it
      if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, size, &size) != CUBLAS_STATUS_SUCCESS) return -1;
      return static_cast<long long>(value);
    };
    char text[200];
    std::snprintf(text, sizeof(text),
                  "id %lld tile %lld stages %lld splitk %lld red %lld swz %lld opt %lld inner %lld cluster %lld waves %.2f",
                  get(CUBLASLT_ALGO_CONFIG_ID), get(CUBLASLT_ALGO_CONFIG_TILE_ID), get(CUBLASLT_ALGO_CONFIG_STAGES_ID),
                  get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM), get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                  get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING), get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION),
                  get(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID), get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), p.waves.at(i));
    return text;
  }
#endif

 private:
  struct Plan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
    std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's list, best first
    std::vector<float> waves;                       // its estimate of each one's waves
  };
  static constexpr size_t kWorkspace = size_t(32) << 20;
  static constexpr int kCandidates = 16;  // the survey times them all; the floor runs the first
  int candidate_ = -1;
  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, int, int64_t, int64_t, int64_t, int32_t, int64_t,
                         int64_t, int64_t, bool>;
  static Key make_key(int64_t m, int64_t n, int64_t k, bool a_t, bool b_t, lmloss_dtype ab, lmloss_dtype c_type,
                      const ProductStrides& st) {
    return {m, n, k, a_t, b_t, int(ab), int(c_type), st.lda, st.ldb, st.ldc, st.batch, st.batch_a, st.batch_b,
            st.batch_c, st.pointer_array};
  }
  std::map<Key, Plan> plans_;
};

// Device memory that frees itself.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : bytes(n) { cuda_check(cudaMalloc(&ptr, std::max<size_t>(n, 1)), "cudaMalloc"); }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(std::exchange(o.ptr, nullptr)), bytes(o.bytes) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
};

// Writes over a buffer larger than the L2 so a timed run starts with a cold cache.
class L2Flush {
 public:
  L2Flush() : buffer_(size_t(256) << 20) {}
  void run(cudaStream_t stream) { cuda_check(cudaMemsetAsync(buffer_.ptr, 0, buffer_.bytes, stream), "flush"); }

 private:
  DeviceBuffer buffer_;
};

std::string device_description() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "unknown CUDA device";
  return std::string(prop.name) + ", " + std::to_string(prop.multiProcessorCount) + " SMs, " +
         std::to_string(prop.totalGlobalMem >> 30) + " GiB";
}

}  // namespace
}  // namespace lmloss::tools

#if !defined(LMLOSS_BENCH_CUDA_MAIN)

#include "bench.hpp"

namespace lmloss::tools {

// From common.hpp, declared here: that header needs C++20 and CUDA sources build as C++17.
std::string cuda_unavailable_reason();
void decode(lmloss_dtype dtype, const void* in, int64_t n, double* values);

namespace {

class CudaBench final : public BenchBackend {
 public:
  CudaBench() { cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"); }
  ~CudaBench() override { cudaStreamDestroy(stream_); }
  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_description(); }

  void prepare(const BenchProblem& problem, const BenchInputs& in) override {
    p_ = problem;
    const size_t n = p_.tokens, v = p_.vocab, h = p_.hidden, es = type_size(p_.dtype);
    x_ = DeviceBuffer(n * h * es);
    w_ = DeviceBuffer(v * h * es);
    cuda_check(cudaMemcpy(x_.ptr, in.hidden.data(), x_.bytes, cudaMemcpyHostToDevice), "upload X");
    cuda_check(cudaMemcpy(w_.ptr, in.weight.data(), w_.bytes, cudaMemcpyHostToDevice), "upload W");
    labels_ = DeviceBuffer(n * 4);
    cuda_check(cudaMemcpy(labels_.ptr, in.labels.data(), n * 4, cudaMemcpyHostToDevice), "upload labels");
    if (p_.loss == BenchLoss::distill) {
      ids_ = DeviceBuffer(n * p_.top_k * 4);
      probs_ = DeviceBuffer(n * p_.top_k * 4);
      cuda_check(cudaMemcpy(ids_.ptr, in.teacher_ids.data(), ids_.bytes, cudaMemcpyHostToDevice), "upload ids");
      cuda_check(cudaMemcpy(probs_.ptr, in.teacher_probs.data(), probs_.bytes, cudaMemcpyHostToDevice),
                 "upload probs");
    }
    logits_ = DeviceBuffer(n * v * es);
    grad_logits_ = DeviceBuffer(n * v * es);
    dx_ = DeviceBuffer(n * h * es);
    dw_ = DeviceBuffer(v * h * 4);
    loss_ = DeviceBuffer(4);
    fused_dx_ = DeviceBuffer(n * h * es);
    fused_dw_ = DeviceBuffer(v * h * 4);
    fused_loss_ = DeviceBuffer(4);
    ctx_.set_stream(stream_);
    naive_ctx_.set_stream(stream_);
    if (p_.budget_bytes) ctx_.set_workspace_budget(p_.budget_bytes);
    // The naive path holds all its logits itself; its row pass may take what it needs.
    naive_ctx_.set_workspace_budget(size_t(8) << 30);
  }

  void floor() override {
    const int64_t n = p_.tokens, v = p_.vocab, h = p_.hidden;
    products_.run(n, v, h, false, true, x_.ptr, w_.ptr, logits_.ptr, p_.dtype, p_.dtype, stream_);
    products_.run(n, h, v, false, false, logits_.ptr, w_.ptr, dx_.ptr, p_.dtype, p_.dtype, stream_);
    products_.run(v, h, n, true, false, logits_.ptr, x_.ptr, dw_.ptr, p_.dtype, LMLOSS_F32, stream_);
  }

  void naive() override {
    const int64_t n = p_.tokens, v = p_.vocab, h = p_.hidden;
    const lmloss_dtype dt = p_.dtype;
    products_.run(n, v, h, false, true, x_.ptr, w_.ptr, logits_.ptr, dt, dt, stream_);
    lmloss_head head{};
    head.logits = dev_matrix(logits_.ptr, dt, n, v);
    head.hidden = head.weight = head.bias = lmloss_tensor_none();
    const lmloss_tensor none = lmloss_tensor_none();
    const lmloss_grads grads = make_grads(dev_matrix(grad_logits_.ptr, dt, n, v), none, none);
    naive_ctx_.reset_peak_workspace();
    forward_backward(naive_ctx_, head, targets(), bench_loss_options(p_), dev_scalar(loss_.ptr, LMLOSS_F32), grads);
    products_.run(n, h, v, false, false, grad_logits_.ptr, w_.ptr, dx_.ptr, dt, dt, stream_);
    products_.run(v, h, n, true, false, grad_logits_.ptr, x_.ptr, dw_.ptr, dt, LMLOSS_F32, stream_);
    naive_peak_ = std::max(naive_peak_, logits_.bytes + grad_logits_.bytes + naive_ctx_.peak_workspace());
  }

  void fused() override {
    const lmloss_dtype dt = p_.dtype;
    const lmloss_head head =
        linear_head(dev_matrix(x_.ptr, dt, p_.tokens, p_.hidden), dev_matrix(w_.ptr, dt, p_.vocab, p_.hidden));
    const lmloss_grads grads = make_grads(lmloss_tensor_none(), dev_matrix(fused_dx_.ptr, dt, p_.tokens, p_.hidden),
                                          dev_matrix(fused_dw_.ptr, LMLOSS_F32, p_.vocab, p_.hidden));
    ctx_.reset_peak_workspace();
    forward_backward(ctx_, head, targets(), bench_loss_options(p_), dev_scalar(fused_loss_.ptr, LMLOSS_F32), grads);
    fused_peak_ = std::max(fused_peak_, ctx_.peak_workspace());
  }

  void synchronize() override {
    cuda_check(cudaStreamSynchronize(stream_), "synchronize");
    ctx_.synchronize();
  }
  // Synchronous, so the host timer around the next path does not count the flush.
  void flush_caches() override {
    flush_.run(stream_);
    cuda_check(cudaStreamSynchronize(stream_), "flush");
  }

  size_t naive_peak_bytes() const override { return naive_peak_; }
  size_t fused_peak_bytes() const override { return fused_peak_; }

  BenchOutputs naive_outputs() override { return outputs(loss_, dx_, dw_); }
  BenchOutputs fused_outputs() override { return outputs(fused_loss_, fused_dx_, fused_dw_); }

 private:
  lmloss_targets targets() const {
    const lmloss_tensor labels = dev_vector(labels_.ptr, LMLOSS_I32, p_.tokens);
    if (p_.loss != BenchLoss::distill) return make_targets(labels, lmloss_tensor_none(), lmloss_tensor_none());
    return make_targets(labels, dev_matrix(ids_.ptr, LMLOSS_I32, p_.tokens, p_.top_k),
                        dev_matrix(probs_.ptr, LMLOSS_F32, p_.tokens, p_.top_k));
  }

  BenchOutputs outputs(const DeviceBuffer& loss, const DeviceBuffer& dx, const DeviceBuffer& dw) {
    cuda_check(cudaStreamSynchronize(stream_), "synchronize");
    BenchOutputs out;
    float l = 0;
    cuda_check(cudaMemcpy(&l, loss.ptr, 4, cudaMemcpyDeviceToHost), "download loss");
    out.loss = l;
    std::vector<uint8_t> raw(dx.bytes);
    cuda_check(cudaMemcpy(raw.data(), dx.ptr, dx.bytes, cudaMemcpyDeviceToHost), "download dX");
    const int64_t count = p_.tokens * p_.hidden;
    std::vector<double> values(count);
    decode(p_.dtype, raw.data(), count, values.data());
    out.grad_hidden.assign(values.begin(), values.end());
    out.grad_weight.resize(p_.vocab * p_.hidden);
    cuda_check(cudaMemcpy(out.grad_weight.data(), dw.ptr, dw.bytes, cudaMemcpyDeviceToHost), "download dW");
    return out;
  }

  BenchProblem p_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_stream_ = nullptr;  // the overlap probe's second stream
  Products products_;
  Products side_products_;              // its own handle and workspace, for side_stream_
  L2Flush flush_;
  Ctx ctx_, naive_ctx_;
  DeviceBuffer x_, w_, labels_, ids_, probs_;
  DeviceBuffer logits_, grad_logits_, dx_, dw_, loss_;  // (tokens, vocab) x2: naive and floor
  DeviceBuffer fused_dx_, fused_dw_, fused_loss_;
  size_t naive_peak_ = 0, fused_peak_ = 0;
};

}  // namespace

std::unique_ptr<BenchBackend> make_cuda_bench(std::string& reason) {
  reason = cuda_unavailable_reason();
  if (!reason.empty()) return nullptr;
  return std::make_unique<CudaBench>();
}

}  // namespace lmloss::tools

#else  // LMLOSS_BENCH_CUDA_MAIN: every mode of the issue on one preset

#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "bench.hpp"  // the presets

namespace lmloss::tools {
namespace {

// The labels' and teachers' generator on the host (an LCG; its high bits).
uint64_t next_random(uint64_t& state) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return state >> 33;
}

// Deterministic pseudo-random inputs made on the device (the host would take minutes).
__device__ uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
__device__ float uniform01(uint64_t x) { return (float((mix(x) >> 40) + 1)) * (1.0f / 16777217.0f); }

template <typename T>
__global__ void fill_normal_kernel(T* out, int64_t n, uint64_t seed, float stddev) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float u1 = uniform01(seed * 0x100000001b3ull + 2 * i), u2 = uniform01(seed * 0x100000001b3ull + 2 * i + 1);
    const float z = sqrtf(-2.f * logf(u1)) * cospif(2.f * u2) * stddev;
    if constexpr (sizeof(T) == 4) out[i] = z;
    else out[i] = T(z);
  }
}

void fill_normal(void* out, lmloss_dtype dt, int64_t n, uint64_t seed, float stddev) {
  const unsigned blocks = 4096;
  if (dt == LMLOSS_BF16) fill_normal_kernel<<<blocks, 256>>>(static_cast<__nv_bfloat16*>(out), n, seed, stddev);
  else if (dt == LMLOSS_F16) fill_normal_kernel<<<blocks, 256>>>(static_cast<__half*>(out), n, seed, stddev);
  else fill_normal_kernel<<<blocks, 256>>>(static_cast<float*>(out), n, seed, stddev);
  cuda_check(cudaGetLastError(), "fill_normal");
}

// The teacher top-k of the project's seed (seed 001's topk_rows), the issue's bar for k up to 2048,
// written again here from its description: one block of 256 threads a row of f32 logits; each
// thread keeps the 8 largest of its strided scan in descending order (a later equal value after
// an earlier one), the block's 2048 candidates are bitonic-sorted in shared memory, descending,
// and the first k go out with probabilities renormalised over them. (Not exact: a row whose top
// k holds more than 8 of one thread's columns loses some.) The insertion is unrolled, so that the
// 8 stay in registers.
constexpr int kSeedThreads = 256, kSeedKept = 8, kSeedCandidates = kSeedThreads * kSeedKept;
__global__ void __launch_bounds__(kSeedThreads)
    seed_topk_rows_kernel(const float* logits, int64_t ld, int64_t vocab, int k, int32_t* ids, float* probs) {
  __shared__ float value[kSeedCandidates];
  __shared__ int32_t id[kSeedCandidates];
  __shared__ float partial[kSeedThreads];
  const int t = threadIdx.x;
  const float* row = logits + int64_t(blockIdx.x) * ld;
  float best[kSeedKept];
  int32_t best_id[kSeedKept];
#pragma unroll
  for (int q = 0; q < kSeedKept; ++q) {
    best[q] = -3.0e38f;
    best_id[q] = 0;
  }
  for (int64_t j = t; j < vocab; j += kSeedThreads) {
    float v = row[j];
    if (!(v > best[kSeedKept - 1])) continue;
    int32_t i = int32_t(j);
#pragma unroll
    for (int q = 0; q < kSeedKept; ++q) {  // v passes every kept value at least as large
      if (v > best[q]) {
        const float kept = best[q];
        const int32_t kept_id = best_id[q];
        best[q] = v;
        best_id[q] = i;
        v = kept;
        i = kept_id;
      }
    }
  }
#pragma unroll
  for (int q = 0; q < kSeedKept; ++q) {
    value[t * kSeedKept + q] = best[q];
    id[t * kSeedKept + q] = best_id[q];
  }
  __syncthreads();
  for (int size = 2; size <= kSeedCandidates; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int e = t; e < kSeedCandidates; e += kSeedThreads) {
        const int other = e ^ stride;
        if (other <= e) continue;
        const bool descending = (e & size) == 0;
        const float a = value[e], b = value[other];
        if ((descending && a < b) || (!descending && a > b)) {
          value[e] = b;
          value[other] = a;
          const int32_t swap = id[e];
          id[e] = id[other];
          id[other] = swap;
        }
      }
      __syncthreads();
    }
  }
  const float top = value[0];
  float sum = 0.f;
  for (int q = t; q < k; q += kSeedThreads) sum += expf(value[q] - top);
  partial[t] = sum;
  __syncthreads();
  for (int half = kSeedThreads / 2; half > 0; half >>= 1) {
    if (t < half) partial[t] += partial[t + half];
    __syncthreads();
  }
  const float total = partial[0];
  for (int q = t; q < k; q += kSeedThreads) {
    ids[int64_t(blockIdx.x) * k + q] = id[q];
    probs[int64_t(blockIdx.x) * k + q] = expf(value[q] - top) / total;
  }
}

int current_device() {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "device");
  return device;
}

// The SM clock during a run, whether the card's power limit (or heat) was holding it back, and the
// energy the card has spent, from NVML where the driver has it: loaded at run time, so that the
// program builds and runs without it. Under a long run of products an H200 sits at its power limit
// with its clock well below its peak, and a step's time then follows the energy it spends (run 45).
class ClockProbe {
 public:
  struct Sample {
    unsigned mhz = 0;
    bool held = false;
  };
  explicit ClockProbe(int cuda_device) {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) return;
    auto init = reinterpret_cast<int (*)()>(dlsym(lib_, "nvmlInit_v2"));
    auto by_bus = reinterpret_cast<int (*)(const char*, void**)>(dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    clock_ = reinterpret_cast<int (*)(void*, int, unsigned*)>(dlsym(lib_, "nvmlDeviceGetClockInfo"));
    reasons_ = reinterpret_cast<int (*)(void*, unsigned long long*)>(
        dlsym(lib_, "nvmlDeviceGetCurrentClocksEventReasons"));
    if (!reasons_)
      reasons_ = reinterpret_cast<int (*)(void*, unsigned long long*)>(
          dlsym(lib_, "nvmlDeviceGetCurrentClocksThrottleReasons"));
    energy_ = reinterpret_cast<int (*)(void*, unsigned long long*)>(dlsym(lib_, "nvmlDeviceGetTotalEnergyConsumption"));
    char bus[32] = {};
    ok_ = init && by_bus && clock_ && reasons_ && init() == 0 &&
          cudaDeviceGetPCIBusId(bus, sizeof(bus), cuda_device) == cudaSuccess && by_bus(bus, &device_) == 0;
  }
  ~ClockProbe() {
    if (lib_) dlclose(lib_);  // nvmlShutdown is left to the process's end
  }
  bool ok() const { return ok_; }
  Sample sample() const {
    Sample s;
    unsigned long long reasons = 0;
    if (!ok_ || clock_(device_, kSmClock, &s.mhz) != 0 || reasons_(device_, &reasons) != 0) return {};
    s.held = (reasons & kHeldBack) != 0;
    return s;
  }
  // Millijoules spent since the driver loaded; false where the driver does not count them.
  bool energy_mj(unsigned long long* mj) const { return ok_ && energy_ && energy_(device_, mj) == 0; }

 private:
  static constexpr int kSmClock = 1;  // NVML_CLOCK_SM
  // Software power cap, hardware slowdown, software and hardware thermal slowdown, power brake.
  static constexpr unsigned long long kHeldBack = 0x4 | 0x8 | 0x20 | 0x40 | 0x80;
  void* lib_ = nullptr;
  void* device_ = nullptr;
  int (*clock_)(void*, int, unsigned*) = nullptr;
  int (*reasons_)(void*, unsigned long long*) = nullptr;
  int (*energy_)(void*, unsigned long long*) = nullptr;
  bool ok_ = false;
};

// The SM clock during a row's runs (the median of the runs' medians), how many runs the power
// limit or heat held back at some sample, and where the driver counts energy, the joules of a run
// and the mean watts over back-to-back runs (ModesBench::steady_energy); the same for the floor's.
struct Clocks {
  unsigned mhz = 0, floor_mhz = 0;
  int held = 0, floor_held = 0, runs = 0;
  double joules = 0, watts = 0, floor_joules = 0, floor_watts = 0;  // 0: not counted
};

struct Row {
  std::string mode;
  double budget_gib;
  double ms, floor_ms, peak_gib;
  int repeats;
  Clocks clocks;
};

class ModesBench {
  struct Teacher {
    int64_t k = 0;
    DeviceBuffer ids, probs;  // (tokens, k) i32 and f32
  };

 public:
  ModesBench(int64_t n, int64_t h, int64_t v, lmloss_dtype dt, int repeats)
      : n_(n), h_(h), v_(v), dt_(dt), repeats_(repeats) {
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    cuda_check(cudaStreamCreateWithFlags(&side_stream_, cudaStreamNonBlocking), "stream");
    const size_t es = type_size(dt);
    x_ = DeviceBuffer(n * h * es);
    w_ = DeviceBuffer(v * h * es);
    fill_normal(x_.ptr, dt, n * h, 1, 1.f);
    fill_normal(w_.ptr, dt, v * h, 2, 2.f / std::sqrt(float(h)));
    std::vector<int32_t> labels(n);
    uint64_t state = 12345;
    for (int64_t t = 0; t < n; ++t) labels[t] = int32_t(next_random(state) % v);
    labels_ = upload(labels.data(), labels.size() * 4);
    dx_ = DeviceBuffer(n * h * es);
    dw_ = DeviceBuffer(v * h * 4 + kDwTailGap);
    loss_ = DeviceBuffer(4);
    topk_ids_ = DeviceBuffer(n * kTopkMax * 4);
    topk_probs_ = DeviceBuffer(n * kTopkMax * 4);
    cuda_check(cudaDeviceSynchronize(), "inputs");
  }
  ~ModesBench() {
    cudaStreamDestroy(stream_);
    cudaStreamDestroy(side_stream_);
  }
  void tune_products(bool on) { tune_ = on; }
  // dW in the loss modes and their floor: --dw-dtype's forms. With a kept sum, a 16-bit dW is kept
  // as its f32 sum over its own bytes and a tail (options.grad_weight_sum_tail), and each step
  // ends with lmloss_round_grad_weight; the tail follows the rows in place where the vocabulary
  // allows (one f32 matrix, one product a chunk, as lmloss.torch places it), unless kept past a
  // gap after them (the library's products batched over both parts) or apart: a buffer of its own
  // (two products a chunk where it lies below, else batched). input-kept-deferred: as input-kept,
  // the last chunk's product left to lmloss_round_grad_weight_deferred where the library defers it
  // (its buffer counted in the peak). input-rests: the sum kept as the bf16 dW's values and a u8
  // tail of their rests (every weight's), rounded by the caller; input-rests-deferred: deferred too.
  static constexpr size_t kDwTailGap = 256;
  struct DwForm {
    const char* name;
    bool input_dtype;  // else f32
    uint32_t flags;
    enum class Sum { none, kept, kept_gap, kept_apart, rests } sum;
    const char* note;  // for the header line
    bool defer;  // input-kept-deferred (unset: false)
  };
  static constexpr DwForm kDwForms[] = {
      {"f32", false, 0u, DwForm::Sum::none, ""},
      {"input", true, 0u, DwForm::Sum::none, ", dW in the input dtype, rounded per chunk"},
      {"input-once", true, LMLOSS_SUM_GRAD_WEIGHT_IN_F32, DwForm::Sum::none,
       ", dW in the input dtype, summed in f32 and rounded once"},
      {"input-kept", true, 0u, DwForm::Sum::kept,
       ", dW in the input dtype, its f32 sum kept with a tail after it, rounded by the caller"},
      {"input-kept-gap", true, 0u, DwForm::Sum::kept_gap,
       ", dW in the input dtype, its f32 sum kept with a tail past a gap after it, rounded by the caller"},
      {"input-kept-apart", true, 0u, DwForm::Sum::kept_apart,
       ", dW in the input dtype, its f32 sum kept with a tail apart, rounded by the caller"},
      {"input-kept-deferred", true, 0u, DwForm::Sum::kept,
       ", dW in the input dtype, its f32 sum kept with a tail after it, the last product deferred to the rounding",
       true},
      {"input-rests", true, 0u, DwForm::Sum::rests,
       ", dW in the input dtype, its sum kept as the values and a u8 tail of rests, rounded by the caller"},
      {"input-rests-deferred", true, 0u, DwForm::Sum::rests,
       ", dW in the input dtype, its sum kept as the values and a u8 tail of rests, the last product deferred to the "
       "rounding",
       true},
  };
  void set_dw_form(const DwForm& form) {
    dw_dtype_ = form.input_dtype ? dt_ : LMLOSS_F32;
    dw_flags_ = form.flags;
    defer_dw_ = form.defer;
    dw_sum_ = form.sum;
    if (form.sum == DwForm::Sum::none) return;
    if (form.sum == DwForm::Sum::rests) {
      dw_sum_tail_ = DeviceBuffer(size_t(v_) * size_t(h_));
      dw_sum_tail_at_ = dw_sum_tail_.ptr;
      return;
    }
    const int64_t tail_rows = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(v_);
    if ((form.sum == DwForm::Sum::kept || form.sum == DwForm::Sum::kept_gap) && 2 * tail_rows == v_) {
      // dw_ holds an f32 (v, h) and the gap
      dw_sum_tail_at_ = static_cast<char*>(dw_.ptr) + size_t(v_) * size_t(h_) * 2 +
                        (form.sum == DwForm::Sum::kept_gap ? kDwTailGap : 0);
    } else {
      dw_sum_tail_ = DeviceBuffer(size_t(tail_rows) * size_t(h_) * 4);
      dw_sum_tail_at_ = dw_sum_tail_.ptr;
      // Which way the library's products may take it (one batched product needs it above).
      std::printf("# the kept sum's tail lies %s dW's rows\n", dw_sum_tail_at_ > dw_.ptr ? "above" : "below");
    }
  }
  // Host sleep before each timed run (floor and step alike), so that each starts on a card that
  // has rested (its clocks and temperature as after an idle gap) instead of one kept hot.
  void set_rest_ms(int ms) { rest_ms_ = ms; }
  // The SM clock sampled while each timed run is on the device (NVML); whether NVML answered.
  bool sample_clocks() {
    clock_probe_ = std::make_unique<ClockProbe>(current_device());
    return clock_probe_->ok();
  }

  // Median milliseconds of `repeats` runs of f, each after an L2 flush, timed by events. With
  // floor_count > 0 each run of f follows a run of that floor (see run_floor), so both see the
  // same clocks and temperature (a long run of products slows the card); the floor's median is
  // kept for the row (last_floor_ms_). With sample_clocks, the host samples the SM clock while
  // each run is on the device, and steady_energy counts a run's energy after the timed runs
  // (last_clocks_).
  template <typename F>
  double time(F&& f, int floor_count = 0) {
    cudaEvent_t start, stop;
    cuda_check(cudaEventCreate(&start), "event");
    cuda_check(cudaEventCreate(&stop), "event");
    struct Run {
      double ms;
      ClockProbe::Sample clock;  // the median of the run's samples; held if any one was
    };
    auto timed = [&](auto&& g) {
      if (rest_ms_ > 0) {
        cuda_check(cudaStreamSynchronize(stream_), "sync");
        std::this_thread::sleep_for(std::chrono::milliseconds(rest_ms_));
      }
      flush_.run(stream_);
      cuda_check(cudaEventRecord(start, stream_), "record");
      g();
      cuda_check(cudaEventRecord(stop, stream_), "record");
      Run run{};
      std::vector<double> mhz;
      while (clock_probe_ && clock_probe_->ok() && cudaEventQuery(stop) == cudaErrorNotReady) {
        const ClockProbe::Sample c = clock_probe_->sample();
        mhz.push_back(c.mhz);
        run.clock.held = run.clock.held || c.held;
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      }
      if (!mhz.empty()) run.clock.mhz = unsigned(median(mhz));
      cuda_check(cudaEventSynchronize(stop), "sync");
      float ms = 0;
      cuda_check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
      run.ms = ms;
      return run;
    };
    std::vector<double> times, floors, mhz, floor_mhz;
    Clocks clocks;
    for (int r = -1; r < repeats_; ++r) {  // r = -1: warm-up (plans, pools)
      if (floor_count > 0) {
        const Run floor = timed([&] { run_floor(floor_count); });
        if (r >= 0) {
          floors.push_back(floor.ms);
          floor_mhz.push_back(floor.clock.mhz);
          clocks.floor_held += floor.clock.held;
        }
      }
      const Run run = timed(f);
      if (r >= 0) {
        times.push_back(run.ms);
        mhz.push_back(run.clock.mhz);
        clocks.held += run.clock.held;
      }
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    last_floor_ms_ = floor_count > 0 ? median(floors) : 0;
    clocks.runs = repeats_;
    clocks.mhz = unsigned(median(mhz));
    clocks.floor_mhz = floor_count > 0 ? unsigned(median(floor_mhz)) : 0;
    if (clock_probe_ && clock_probe_->ok() && count_energy_) {
      steady_energy(f, median(times), &clocks.joules, &clocks.watts);
      if (floor_count > 0)
        steady_energy([&] { run_floor(floor_count); }, median(floors), &clocks.floor_joules, &clocks.floor_watts);
    }
    last_clocks_ = clock_probe_ && clock_probe_->ok() ? clocks : Clocks{};
    return median(times);
  }
  // The joules of a run of f and the mean watts, from the driver's energy counter over runs back
  // to back (no flush between them) for at least kSteadyMs: its instantaneous power trails the
  // load (a 4 ms product read 0.6 J where its like read 3 J, run 54), so that a single run's
  // reading says little. Left as they are where the driver does not count energy.
  template <typename F>
  void steady_energy(F&& f, double run_ms, double* joules, double* watts) {
    constexpr double kSteadyMs = 2000;
    const int count = std::max(3, int(std::ceil(kSteadyMs / std::max(run_ms, 1e-3))));
    unsigned long long e0 = 0, e1 = 0;
    cuda_check(cudaStreamSynchronize(stream_), "sync");
    const auto t0 = std::chrono::steady_clock::now();
    if (!clock_probe_->energy_mj(&e0)) return;
    for (int i = 0; i < count; ++i) f();
    cuda_check(cudaStreamSynchronize(stream_), "sync");
    const auto t1 = std::chrono::steady_clock::now();
    if (!clock_probe_->energy_mj(&e1) || e1 < e0) return;
    const double seconds = std::chrono::duration<double>(t1 - t0).count();
    *joules = double(e1 - e0) * 1e-3 / count;
    *watts = seconds > 0 ? double(e1 - e0) * 1e-3 / seconds : 0;
  }
  static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }

  // The floor: the bare products of `count` kinds (1: forward; 2: + dX; 3: + dW).
  void run_floor(int count) {
    void* z = full_logits();
    products_.run(n_, v_, h_, false, true, x_.ptr, w_.ptr, z, dt_, dt_, stream_);
    if (count >= 2) products_.run(n_, h_, v_, false, false, z, w_.ptr, dx_.ptr, dt_, dt_, stream_);
    if (count >= 3) products_.run(v_, h_, n_, true, false, z, x_.ptr, dw_.ptr, dt_, dw_dtype_, stream_);
  }
  // (tokens, vocab) in the input dtype: the floor's logits, standing in for their gradient too.
  // Filled by the forward product when first made: a product's power draw, and so the card's
  // clocks under a long run of them, depend on the values it reads (never-written memory reads
  // as zeros and times fast).
  void* full_logits() {
    if (!z_.ptr) {
      z_ = DeviceBuffer(n_ * v_ * type_size(dt_));
      products_.run(n_, v_, h_, false, true, x_.ptr, w_.ptr, z_.ptr, dt_, dt_, stream_);
    }
    return z_.ptr;
  }

  // Each product of the step at chunk height `rows` (and at the full height, as the floor runs
  // it) with every algorithm the cuBLASLt heuristic offers: is its first choice the fastest?
  // `only`: a part of the products' names to keep (all when empty).
  void survey_algorithms(int64_t rows, const std::string& only) {
    void* z = full_logits();
    DeviceBuffer z32(size_t(rows) * v_ * 4), dx32(size_t(rows) * h_ * 4);
    struct Shape {
      const char* name;
      int64_t m, n, k;
      bool a_t, b_t;
      const void *a, *b;
      void* c;
      lmloss_dtype c_type;
      float beta;
    };
    const Shape shapes[] = {
        {"forward bf16 (floor)", n_, v_, h_, false, true, x_.ptr, w_.ptr, z, dt_, 0.f},
        {"forward f32 chunk", rows, v_, h_, false, true, x_.ptr, w_.ptr, z32.ptr, LMLOSS_F32, 0.f},
        {"dX (floor)", n_, h_, v_, false, false, z, w_.ptr, dx_.ptr, dt_, 0.f},
        {"dX chunk", rows, h_, v_, false, false, z, w_.ptr, dx_.ptr, dt_, 0.f},
        {"dX chunk f32", rows, h_, v_, false, false, z, w_.ptr, dx32.ptr, LMLOSS_F32, 0.f},
        {"dW (floor)", v_, h_, n_, true, false, z, x_.ptr, dw_.ptr, LMLOSS_F32, 0.f},
        {"dW chunk, beta 0", v_, h_, rows, true, false, z, x_.ptr, dw_.ptr, LMLOSS_F32, 0.f},
        {"dW chunk, beta 1", v_, h_, rows, true, false, z, x_.ptr, dw_.ptr, LMLOSS_F32, 1.f},
    };
    for (const Shape& sh : shapes) {
      if (!only.empty() && std::string(sh.name).find(only) == std::string::npos) continue;
      auto run = [&] {
        products_.run(sh.m, sh.n, sh.k, sh.a_t, sh.b_t, sh.a, sh.b, sh.c, dt_, sh.c_type, stream_, sh.beta);
      };
      run();
      const size_t count = products_.candidates(sh.m, sh.n, sh.k, sh.a_t, sh.b_t, dt_, sh.c_type);
      // Three rounds over the candidates, each candidate's best kept: the card's clocks drift
      // over a survey, and rounds spread that drift over every candidate alike.
      std::vector<double> best(count, 0.0), joules(count, 0.0);
      for (int round = 0; round < 3; ++round)
        for (size_t i = 0; i < count; ++i) {
          products_.use_candidate(int(i));
          count_energy_ = round == 2;  // the last round's only: 2 s a candidate
          const double ms = time(run);
          if (round == 0 || ms < best[i]) best[i] = ms;
          if (round == 2) joules[i] = last_clocks_.joules;  // 0 where not counted
        }
      products_.use_candidate(-1);
      count_energy_ = true;
      for (size_t i = 0; i < count; ++i)
        std::printf("algos %-22s rows %5lld  #%zu %8.3f ms %6.3f J  %s\n", sh.name, (long long)rows, i, best[i],
                    joules[i], products_.candidate_config(sh.m, sh.n, sh.k, sh.a_t, sh.b_t, dt_, sh.c_type, i).c_str());
      std::fflush(stdout);
    }
  }

  // The bare products of a chunked step summed over all tokens, for chunks of `rows` tokens: the
  // forward product to f32 logits, dX, and dW accumulated in f32 (beta 1 after the first chunk).
  // Says what the chunk height alone costs, apart from the row kernels.
  void chunked_products(int64_t rows) {
    DeviceBuffer z32(size_t(rows) * v_ * 4), dx32(size_t(rows) * h_ * 4);
    const size_t es = type_size(dt_);
    auto each_chunk = [&](auto&& f) {
      for (int64_t r0 = 0; r0 < n_; r0 += rows) f(r0, std::min(rows, n_ - r0));
    };
    const char* x = static_cast<const char*>(x_.ptr);
    const char* g = static_cast<const char*>(full_logits());
    // Each timing's joules a run where the driver counts them (--clocks), printed last.
    std::string joules;
    auto time_family = [&](const char* name, auto&& f) {
      const double ms = time(f);
      char note[96];
      std::snprintf(note, sizeof(note), "  %s %.2f J", name, last_clocks_.joules);
      if (last_clocks_.joules > 0) joules += note;
      return ms;
    };
    const double fwd = time_family("forward->f32", [&] {
      each_chunk([&](int64_t r0, int64_t m) {
        products_.run(m, v_, h_, false, true, x + r0 * h_ * es, w_.ptr, z32.ptr, dt_, LMLOSS_F32, stream_);
      });
    });
    const double dx = time_family("dX", [&] {
      each_chunk([&](int64_t r0, int64_t m) {
        products_.run(m, h_, v_, false, false, g + r0 * v_ * es, w_.ptr, static_cast<char*>(dx_.ptr) + r0 * h_ * es,
                      dt_, dt_, stream_);
      });
    });
    const double dx_f32 = time_family("dX->f32", [&] {
      each_chunk([&](int64_t r0, int64_t m) {
        products_.run(m, h_, v_, false, false, g + r0 * v_ * es, w_.ptr, dx32.ptr, dt_, LMLOSS_F32, stream_);
      });
    });
    const double dx_full = time_family("dX full", [&] {
      products_.run(n_, h_, v_, false, false, g, w_.ptr, dx_.ptr, dt_, dt_, stream_);
    });
    // dX by as many vocabulary slices as there are chunks, each at full height into one f32 dX
    // (beta 1 after the first): what a step that formed the gradient a slice of the vocabulary
    // at a time would pay for dX. A slice's logits are the first n x slice values of the full
    // logits read as a dense matrix.
    const int64_t slices = (n_ + rows - 1) / rows, slice = (v_ + slices - 1) / slices;
    DeviceBuffer dx_full32(size_t(n_) * h_ * 4);
    const double dx_sliced = time_family("dX sliced", [&] {
      for (int64_t v0 = 0; v0 < v_; v0 += slice) {
        const int64_t width = std::min(slice, v_ - v0);
        products_.run(n_, h_, width, false, false, g, static_cast<const char*>(w_.ptr) + v0 * h_ * es,
                      dx_full32.ptr, dt_, LMLOSS_F32, stream_, v0 > 0 ? 1.f : 0.f);
      }
    });
    const double dw = time_family("dW(f32, beta 1)", [&] {
      each_chunk([&](int64_t r0, int64_t m) {
        products_.run(v_, h_, m, true, false, g + r0 * v_ * es, x + r0 * h_ * es, dw_.ptr, dt_, LMLOSS_F32, stream_,
                      r0 > 0 ? 1.f : 0.f);
      });
    });
    std::printf("products  chunk %5lld rows  forward->f32 %8.3f ms  dX %8.3f ms  dW(f32, beta 1) %8.3f ms  sum %8.3f ms"
                "  (dX into f32 %8.3f ms, dX at full height %8.3f ms, dX by %lld vocabulary slices into f32 %8.3f ms)\n",
                (long long)rows, fwd, dx, dw, fwd + dx + dw, dx_f32, dx_full, (long long)slices, dx_sliced);
    std::fflush(stdout);

    // Does a second product fill the SMs that a chunk's dX (under a wave at gemma2-2b) leaves
    // idle? Each chunk's dX into f32 beside its dW, and beside the next chunk's forward product,
    // on a second stream (its own cuBLASLt handle and workspace), against the same one after the
    // other.
    cudaEvent_t fork, join;
    cuda_check(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming), "event");
    cuda_check(cudaEventCreateWithFlags(&join, cudaEventDisableTiming), "event");
    auto chunk_dx = [&](int64_t r0, int64_t m, cudaStream_t s) {
      side_products_.run(m, h_, v_, false, false, g + r0 * v_ * es, w_.ptr, dx32.ptr, dt_, LMLOSS_F32, s);
    };
    auto chunk_dw = [&](int64_t r0, int64_t m) {
      products_.run(v_, h_, m, true, false, g + r0 * v_ * es, x + r0 * h_ * es, dw_.ptr, dt_, LMLOSS_F32, stream_,
                    r0 > 0 ? 1.f : 0.f);
    };
    auto next_forward = [&](int64_t r0, int64_t m) {
      const int64_t next = r0 + m < n_ ? r0 + m : 0;
      products_.run(std::min(rows, n_ - next), v_, h_, false, true, x + next * h_ * es, w_.ptr, z32.ptr, dt_,
                    LMLOSS_F32, stream_);
    };
    auto beside = [&](int64_t r0, int64_t m, auto&& other) {
      cuda_check(cudaEventRecord(fork, stream_), "fork");
      cuda_check(cudaStreamWaitEvent(side_stream_, fork), "fork wait");
      chunk_dx(r0, m, side_stream_);
      other(r0, m);
      cuda_check(cudaEventRecord(join, side_stream_), "join");
      cuda_check(cudaStreamWaitEvent(stream_, join), "join wait");
    };
    const double dx_dw_serial = time_family("dX+dW serial", [&] {
      each_chunk([&](int64_t r0, int64_t m) { chunk_dx(r0, m, stream_); chunk_dw(r0, m); });
    });
    const double dx_dw_beside = time_family("dX+dW beside", [&] {
      each_chunk([&](int64_t r0, int64_t m) { beside(r0, m, chunk_dw); });
    });
    const double dx_fwd_serial = time_family("dX+next fwd serial", [&] {
      each_chunk([&](int64_t r0, int64_t m) { chunk_dx(r0, m, stream_); next_forward(r0, m); });
    });
    const double dx_fwd_beside = time_family("dX+next fwd beside", [&] {
      each_chunk([&](int64_t r0, int64_t m) { beside(r0, m, next_forward); });
    });
    cudaEventDestroy(fork);
    cudaEventDestroy(join);
    std::printf("overlap   chunk %5lld rows  dX(f32)+dW one after the other %8.3f ms, on two streams %8.3f ms;"
                "  dX(f32)+next forward->f32 one after the other %8.3f ms, on two streams %8.3f ms\n",
                (long long)rows, dx_dw_serial, dx_dw_beside, dx_fwd_serial, dx_fwd_beside);
    if (!joules.empty()) std::printf("energy    chunk %5lld rows%s\n", (long long)rows, joules.c_str());
    std::fflush(stdout);
  }

  // The chunked dX product into f32 (chunks of `rows`, summed over all tokens) with the
  // heuristic's first algorithms forced to split K: can more, shorter tiles fill the SMs that a
  // chunk under a wave leaves idle (117 output tiles on 132 SMs at gemma2-2b)?
  void splitk_probe(int64_t rows) {
    const size_t es = type_size(dt_);
    const char* g = static_cast<const char*>(full_logits());
    DeviceBuffer dx32(size_t(rows) * h_ * 4);
    const size_t ws_bytes = size_t(512) << 20;
    DeviceBuffer ws(ws_bytes);
    for (int64_t r0 = 0; r0 < n_; r0 += rows)  // plans each chunk height
      products_.run(std::min(rows, n_ - r0), h_, v_, false, false, g, w_.ptr, dx32.ptr, dt_, LMLOSS_F32, stream_);
    const size_t count = std::min<size_t>(4, products_.candidates(rows, h_, v_, false, false, dt_, LMLOSS_F32));
    for (size_t i = 0; i < count; ++i)
      for (const uint32_t scheme : {CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, CUBLASLT_REDUCTION_SCHEME_INPLACE})
        for (int32_t splits : {1, 2, 3, 4, 5, 6, 8, 9, 12, 16}) {
          if (splits == 1 && scheme != CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE) continue;
          bool ran = true;
          float waves = 0;
          const double ms = time([&] {
            for (int64_t r0 = 0; r0 < n_ && ran; r0 += rows)
              ran = products_.run_split(std::min(rows, n_ - r0), h_, v_, false, false, g + r0 * v_ * es, w_.ptr,
                                        dx32.ptr, dt_, LMLOSS_F32, stream_, i, splits, scheme, ws.ptr, ws_bytes,
                                        &waves);
          });
          if (!ran) continue;
          std::printf("splitk    chunk %5lld rows  #%zu splits %2d  red %u  dX into f32 %8.3f ms  waves %.2f  %s\n",
                      (long long)rows, i, splits, scheme, ms, waves,
                      products_.candidate_config(rows, h_, v_, false, false, dt_, LMLOSS_F32, i).c_str());
          std::fflush(stdout);
        }
  }

  // dW summed in f32 over chunks of `rows` tokens into two buffers of its own, rows [0, V/2) and
  // [V/2, V), as an f32 sum kept over a 16-bit dW's own bytes and a second buffer would take it:
  // as one product into a whole dW (the default's), as two products (one a part, as
  // LMLOSS_SUM_GRAD_WEIGHT_IN_F32 runs them), and as one strided-batched product over both parts
  // (the batch stride of D the distance between the buffers), and as one product batched from
  // arrays of pointers (the parts wherever they lie). Can the parts cost what the whole does? The
  // batched sums are compared with the two products'.
  void dw_parts_probe(int64_t rows) {
    if (v_ % 2 != 0) {
      std::printf("dw-parts  V %lld is odd: no two equal parts\n", (long long)v_);
      return;
    }
    const int64_t half = v_ / 2;
    const size_t es = type_size(dt_), part_bytes = size_t(half) * h_ * 4;
    DeviceBuffer first(part_bytes), second(part_bytes);
    // Rows [0, half) go to the buffer at the lower address, so that the batch strides are positive.
    char* lo = static_cast<char*>(std::min(first.ptr, second.ptr));
    char* hi = static_cast<char*>(std::max(first.ptr, second.ptr));
    const int64_t d_stride = (hi - lo) / 4;
    const char* x = static_cast<const char*>(x_.ptr);
    const char* g = static_cast<const char*>(full_logits());
    // A part: dW rows (half, H) = G_chunk's columns [col0, col0 + half)^T X_chunk, G's rows V wide.
    ProductStrides part;
    part.lda = v_;
    ProductStrides both = part;  // the two parts, one after the other in G and in memory
    both.batch = 2;
    both.batch_a = half;
    both.batch_c = d_stride;
    auto product = [&](int64_t r0, int64_t m, const ProductStrides& st, int64_t col0, char* d) {
      products_.run(half, h_, m, true, false, g + (r0 * v_ + col0) * es, x + r0 * h_ * es, d, dt_, LMLOSS_F32,
                    stream_, r0 > 0 ? 1.f : 0.f, st);
    };
    auto each_chunk = [&](auto&& f) {
      for (int64_t r0 = 0; r0 < n_; r0 += rows) f(r0, std::min(rows, n_ - r0));
    };
    const double whole = time([&] {
      each_chunk([&](int64_t r0, int64_t m) {
        products_.run(v_, h_, m, true, false, g + r0 * v_ * es, x + r0 * h_ * es, dw_.ptr, dt_, LMLOSS_F32, stream_,
                      r0 > 0 ? 1.f : 0.f);
      });
    });
    // The sum's rows [0, half) as read from `first`, [half, V) from `second`.
    auto sums = [&](const char* first, const char* second) {
      cuda_check(cudaStreamSynchronize(stream_), "sync");
      std::vector<float> out(size_t(v_) * h_);
      cuda_check(cudaMemcpy(out.data(), first, part_bytes, cudaMemcpyDeviceToHost), "copy");
      cuda_check(cudaMemcpy(out.data() + size_t(half) * h_, second, part_bytes, cudaMemcpyDeviceToHost), "copy");
      return out;
    };
    // Either way may find no cuBLASLt algorithm (Products throws): said so, and the probe goes on.
    auto timed_or_not = [&](auto&& f, bool& ran) {
      try {
        ran = true;
        return time(f);
      } catch (const std::runtime_error& e) {
        std::printf("dw-parts  %s\n", e.what());
        ran = false;
        return 0.0;
      }
    };
    auto largest_difference = [&](const std::vector<float>& a, const std::vector<float>& b) {
      double diff = 0, scale = 0;
      for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
        diff = std::max(diff, double(std::fabs(a[i] - b[i])));
        scale = std::max(scale, double(std::fabs(a[i])));
      }
      return scale > 0 ? diff / scale : 0.0;
    };
    bool two_ran = false, batched_ran = false, pointers_ran = false;
    const double two = timed_or_not([&] {
      each_chunk([&](int64_t r0, int64_t m) {
        product(r0, m, part, 0, lo);
        product(r0, m, part, half, hi);
      });
    }, two_ran);
    const std::vector<float> two_sums = sums(lo, hi);
    const double batched = timed_or_not(
        [&] { each_chunk([&](int64_t r0, int64_t m) { product(r0, m, both, 0, lo); }); }, batched_ran);
    const double batched_diff = batched_ran ? largest_difference(two_sums, sums(lo, hi)) : 0;
    // The first rows at the higher address (a caller's tail below its gradient) would need D's
    // batch stride negative: cuBLASLt 13.1 then read out of bounds (run 48). Arrays of pointers
    // instead, made for every chunk before the timing (a library would have a small kernel write
    // them): the two parts wherever they lie, here the first at the higher address.
    ProductStrides arrays = part;
    arrays.batch = 2;
    arrays.pointer_array = true;
    std::vector<const void*> host_pointers;
    each_chunk([&](int64_t r0, int64_t) {
      const void* chunk[6] = {g + r0 * v_ * es, g + (r0 * v_ + half) * es, x + r0 * h_ * es, x + r0 * h_ * es,
                              hi, lo};
      host_pointers.insert(host_pointers.end(), chunk, chunk + 6);
    });
    DeviceBuffer device_pointers(host_pointers.size() * sizeof(void*));
    cuda_check(cudaMemcpy(device_pointers.ptr, host_pointers.data(), host_pointers.size() * sizeof(void*),
                          cudaMemcpyHostToDevice),
               "copy pointers");
    const double pointers = timed_or_not([&] {
      int64_t c = 0;
      each_chunk([&](int64_t r0, int64_t m) {
        const void** p = static_cast<const void**>(device_pointers.ptr) + 6 * c++;
        products_.run(half, h_, m, true, false, p, p + 2, const_cast<void**>(p + 4), dt_, LMLOSS_F32, stream_,
                      r0 > 0 ? 1.f : 0.f, arrays);
      });
    }, pointers_ran);
    const double pointers_diff = pointers_ran ? largest_difference(two_sums, sums(hi, lo)) : 0;
    auto shown = [](double ms, bool ran) {
      char text[48];
      std::snprintf(text, sizeof text, ran ? "%8.3f ms" : "did not run", ms);
      return std::string(text);
    };
    std::printf("dw-parts  chunk %5lld rows  whole %8.3f ms  two products %s  one batched %s  from pointer arrays"
                " %s  (each against two: max difference %.2e, %.2e of the largest)\n",
                (long long)rows, whole, shown(two, two_ran).c_str(), shown(batched, batched_ran).c_str(),
                shown(pointers, pointers_ran).c_str(), batched_diff, pointers_diff);
    std::fflush(stdout);
  }

  Row loss_mode(const std::string& mode, size_t budget, int floor_count) {
    Ctx ctx;
    ctx.set_stream(stream_);
    ctx.set_product_tuning(tune_);
    if (budget) ctx.set_workspace_budget(budget);
    // distillK: top-k distillation against a teacher's k ids (ce_weight 0, kd_weight 1).
    const bool distill = mode.rfind("distill", 0) == 0;
    const Teacher* teach = distill ? &teacher(mode) : nullptr;
    const bool want_dw = mode == "fwd_bwd" || distill;
    const bool want_dx = want_dw || mode == "dx_only";
    lmloss_loss_options o = lmloss_loss_options_default();
    o.flags |= dw_flags_;
    const bool kept_sum = want_dw && dw_sum_tail_at_, rests = dw_sum_ == DwForm::Sum::rests;
    const lmloss_tensor sum_tail =
        !kept_sum ? lmloss_tensor_none()
        : rests   ? dev_matrix(dw_sum_tail_at_, LMLOSS_U8, v_, h_)
                  : dev_matrix(dw_sum_tail_at_, LMLOSS_F32, LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(v_), h_);
    o.grad_weight_sum_tail = sum_tail;
    if (distill) {
      o.ce_weight = 0;
      o.kd_weight = 1;
    }
    const lmloss_head head = linear_head(dev_matrix(x_.ptr, dt_, n_, h_), dev_matrix(w_.ptr, dt_, v_, h_));
    const lmloss_tensor labels = dev_vector(labels_.ptr, LMLOSS_I32, n_);
    const lmloss_tensor none = lmloss_tensor_none();
    const lmloss_targets targets =
        distill ? make_targets(labels, dev_matrix(teach->ids.ptr, LMLOSS_I32, n_, teach->k),
                               dev_matrix(teach->probs.ptr, LMLOSS_F32, n_, teach->k))
                : make_targets(labels, none, none);
    const lmloss_grads g = make_grads(none, want_dx ? dev_matrix(dx_.ptr, dt_, n_, h_) : none,
                                      want_dw ? dev_matrix(dw_.ptr, dw_dtype_, v_, h_) : none);
    const lmloss_tensor loss = dev_scalar(loss_.ptr, LMLOSS_F32);
    const bool forward_only = mode == "forward";
    DeviceBuffer deferred;
    if (kept_sum && defer_dw_) {
      size_t bytes = 0;
      lmloss::check(lmloss_loss_deferred_bytes(ctx.get(), &head, &targets, &o, &none, &loss, &none, &g, &bytes));
      std::printf("# %s: %zu bytes of the last dW product deferred\n", mode.c_str(), bytes);
      if (bytes > 0) {
        deferred = DeviceBuffer(bytes);
        o.grad_weight_deferred = lmloss_tensor_1d(deferred.ptr, LMLOSS_U8, int64_t(bytes));
        o.grad_weight_deferred.device_type = LMLOSS_DEVICE_CUDA;
      }
    }
    const double ms = time(
        [&] {
          if (forward_only) {
            lmloss::check(lmloss_loss_forward(ctx.get(), &head, &targets, &o, &loss, &none));
          } else {
            forward_backward(ctx, head, targets, o, loss, g);
            if (deferred.ptr)
              lmloss::check(lmloss_round_grad_weight_deferred(ctx.get(), &g.grad_weight, &sum_tail, nullptr,
                                                              &o.grad_weight_deferred));
            else if (kept_sum)
              lmloss::check(lmloss_round_grad_weight(ctx.get(), &g.grad_weight, &sum_tail, nullptr));
          }
        },
        floor_count);
    ctx.synchronize();
    float l = 0;
    cuda_check(cudaMemcpy(&l, loss_.ptr, 4, cudaMemcpyDeviceToHost), "loss");
    if (!std::isfinite(l)) throw std::runtime_error(mode + ": the loss is not finite");
    return {mode, double(ctx.workspace_budget()) / double(1 << 30), ms, last_floor_ms_,
            double(ctx.peak_workspace() + deferred.bytes) / double(1 << 30), repeats_, last_clocks_};
  }

  // The teacher of mode `distillK`: its top k for every token, made once per k: distinct ids,
  // from a random base in strides of a prime, with random probabilities summing to 1.
  const Teacher& teacher(const std::string& mode) {
    int64_t k = 0;
    try {
      size_t used = 0;
      k = std::stoll(mode.substr(7), &used);
      if (used != mode.size() - 7) k = 0;
    } catch (const std::exception&) {
    }
    if (k < 1 || k > v_) throw std::runtime_error(mode + ": distillK takes a teacher's k from 1 to the vocabulary");
    auto found = teachers_.find(k);
    if (found != teachers_.end()) return found->second;
    std::vector<int32_t> ids(n_ * k);
    std::vector<float> probs(n_ * k);
    uint64_t state = 12345 + uint64_t(k);
    for (int64_t t = 0; t < n_; ++t) {
      const int64_t base = int64_t(next_random(state) % v_);
      double mass = 0;
      for (int64_t e = 0; e < k; ++e) mass += probs[t * k + e] = float(next_random(state) % 1000 + 1);
      for (int64_t e = 0; e < k; ++e) {
        ids[t * k + e] = int32_t((base + e * 7919) % v_);  // distinct while k <= vocab: 7919 is prime
        probs[t * k + e] = float(probs[t * k + e] / mass);
      }
    }
    Teacher& made = teachers_[k];
    made.k = k;
    made.ids = upload(ids.data(), ids.size() * 4);
    made.probs = upload(probs.data(), probs.size() * 4);
    return made;
  }

  // lmloss_topk of the head into topk_ids_ and topk_probs_, on ctx's stream.
  void topk_into_buffers(Ctx& ctx, int64_t k) {
    const lmloss_head head = linear_head(dev_matrix(x_.ptr, dt_, n_, h_), dev_matrix(w_.ptr, dt_, v_, h_));
    lmloss_topk_options o = lmloss_topk_options_default();
    o.k = k;
    const lmloss_tensor ids = dev_matrix(topk_ids_.ptr, LMLOSS_I32, n_, k);
    const lmloss_tensor probs = dev_matrix(topk_probs_.ptr, LMLOSS_F32, n_, k);
    const lmloss_tensor none = lmloss_tensor_none();
    lmloss::check(lmloss_topk(ctx.get(), &head, &o, &ids, &probs, &none));
  }

  Row topk_mode(int64_t k, size_t budget, int floor_count) {
    Ctx ctx;
    ctx.set_stream(stream_);
    ctx.set_product_tuning(tune_);
    if (budget) ctx.set_workspace_budget(budget);
    const double ms = time([&] { topk_into_buffers(ctx, k); }, floor_count);
    ctx.synchronize();
    return {"topk" + std::to_string(k), double(ctx.workspace_budget()) / double(1 << 30), ms, last_floor_ms_,
            double(ctx.peak_workspace()) / double(1 << 30), repeats_, last_clocks_};
  }

  // The seed's top-k (seed_topk_rows_kernel) for the issue's comparison: chunks of `chunk_rows`
  // tokens (2048: a chunk's f32 logits at V 128256 fill the default 1 GiB), each cuBLASLt's
  // forward product into f32 logits and then the seed's row kernel. Also says in how many rows
  // its ids differ from lmloss_topk's, which are exact.
  Row seed_topk_mode(int64_t k, int64_t chunk_rows, int floor_count) {
    if (k > kSeedCandidates) throw std::invalid_argument("the seed's top-k takes k <= 2048");
    chunk_rows = std::min(chunk_rows, n_);
    DeviceBuffer logits(size_t(chunk_rows) * size_t(v_) * 4);
    DeviceBuffer ids(size_t(n_) * size_t(k) * 4), probs(size_t(n_) * size_t(k) * 4);
    const size_t es = type_size(dt_);
    auto step = [&] {
      for (int64_t r0 = 0; r0 < n_; r0 += chunk_rows) {
        const int64_t rows = std::min(chunk_rows, n_ - r0);
        products_.run(rows, v_, h_, false, true, static_cast<char*>(x_.ptr) + size_t(r0) * size_t(h_) * es, w_.ptr,
                      logits.ptr, dt_, LMLOSS_F32, stream_);
        seed_topk_rows_kernel<<<unsigned(rows), kSeedThreads, 0, stream_>>>(
            static_cast<const float*>(logits.ptr), v_, v_, int(k), static_cast<int32_t*>(ids.ptr) + r0 * k,
            static_cast<float*>(probs.ptr) + r0 * k);
      }
      cuda_check(cudaGetLastError(), "seed top-k");
    };
    const double ms = time(step, floor_count);

    // Its ids beside lmloss_topk's.
    Ctx ctx;
    ctx.set_stream(stream_);
    topk_into_buffers(ctx, k);
    ctx.synchronize();
    std::vector<int32_t> seed(size_t(n_) * size_t(k)), ours(seed.size());
    cuda_check(cudaMemcpy(seed.data(), ids.ptr, seed.size() * 4, cudaMemcpyDeviceToHost), "ids");
    cuda_check(cudaMemcpy(ours.data(), topk_ids_.ptr, ours.size() * 4, cudaMemcpyDeviceToHost), "ids");
    int64_t differing = 0;
    for (int64_t t = 0; t < n_; ++t)
      differing += !std::equal(seed.begin() + t * k, seed.begin() + (t + 1) * k, ours.begin() + t * k);
    std::printf("# seedtopk%lld: %lld of %lld rows' ids differ from lmloss_topk's\n", (long long)k,
                (long long)differing, (long long)n_);
    return {"seedtopk" + std::to_string(k), double(logits.bytes) / double(1 << 30), ms, last_floor_ms_,
            double(logits.bytes) / double(1 << 30), repeats_, last_clocks_};
  }

  static constexpr int kTopkMax = 2048;

 private:
  DeviceBuffer upload(const void* host, size_t bytes) {
    DeviceBuffer b(bytes);
    cuda_check(cudaMemcpy(b.ptr, host, bytes, cudaMemcpyHostToDevice), "upload");
    return b;
  }
  int64_t n_, h_, v_;
  lmloss_dtype dt_;
  int repeats_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_stream_ = nullptr;  // the overlap probe's second stream
  Products products_;
  Products side_products_;              // its own handle and workspace, for side_stream_
  L2Flush flush_;
  DeviceBuffer x_, w_, labels_, dx_, dw_, loss_, topk_ids_, topk_probs_, z_;
  std::map<int64_t, Teacher> teachers_;  // by k
  double last_floor_ms_ = 0;
  std::unique_ptr<ClockProbe> clock_probe_;  // null: no clock samples
  Clocks last_clocks_;
  bool count_energy_ = true;  // whether time() also counts a run's energy (steady_energy)
  int rest_ms_ = 0;
  bool tune_ = false;  // lmloss_context_set_product_tuning on the library's contexts
  lmloss_dtype dw_dtype_ = LMLOSS_F32;
  uint32_t dw_flags_ = 0;  // LMLOSS_SUM_GRAD_WEIGHT_IN_F32 for --dw-dtype input-once
  bool defer_dw_ = false;  // --dw-dtype input-kept-deferred
  DwForm::Sum dw_sum_ = DwForm::Sum::none;  // how a kept sum of dW is held (--dw-dtype)
  DeviceBuffer dw_sum_tail_;         // --dw-dtype input-kept-apart: the kept f32 sum's tail
  void* dw_sum_tail_at_ = nullptr;   // --dw-dtype input-kept*: where that tail is
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

int run(int argc, char** argv) {
  std::string preset = "llama3-8b", modes = "fwd_bwd,dx_only,forward,topk64,topk2048,distill64", budgets = "",
              json_path = "", dtype = "bf16", chunks = "", survey = "",
              survey_only = "", splitk = "", dw_parts = "", dw_dtype = "f32";
  int64_t tokens = 0, hidden = 0, vocab = 0;  // 0: the preset's
  int repeats = 10, rest_ms = 0;
  double mode_budget_gib = 0;  // the modes' workspace budget; 0: the library's default
  bool with_floor = true, tune = false, clocks = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--preset") preset = value;
    else if (key == "--tokens") tokens = std::stoll(value);
    else if (key == "--hidden") hidden = std::stoll(value);
    else if (key == "--vocab") vocab = std::stoll(value);
    else if (key == "--modes") modes = value;
    else if (key == "--budgets-gib") budgets = value;
    else if (key == "--repeats") repeats = std::stoi(value);
    else if (key == "--json") json_path = value;
    else if (key == "--dtype") dtype = value;
    else if (key == "--product-chunks") chunks = value;
    else if (key == "--floor") with_floor = value != "0";
    else if (key == "--survey-rows") survey = value;
    else if (key == "--survey-only") survey_only = value;
    else if (key == "--tune") tune = value != "0";
    else if (key == "--splitk-rows") splitk = value;
    else if (key == "--dw-parts-rows") dw_parts = value;
    else if (key == "--dw-dtype") dw_dtype = value;
    else if (key == "--budget-gib") mode_budget_gib = std::stod(value);
    else if (key == "--rest-ms") rest_ms = std::stoi(value);
    else if (key == "--clocks") clocks = value != "0";
    else throw std::invalid_argument("unknown option " + key);
  }
  const BenchPreset& p = find_preset(preset);
  const int64_t n = tokens > 0 ? tokens : p.tokens;
  const int64_t h = hidden > 0 ? hidden : p.hidden, v = vocab > 0 ? vocab : p.vocab;
  const lmloss_dtype dt = dtype == "f16" ? LMLOSS_F16 : dtype == "f32" ? LMLOSS_F32 : LMLOSS_BF16;
  ModesBench bench(n, h, v, dt, repeats);
  bench.tune_products(tune);
  const ModesBench::DwForm* dw_form = nullptr;
  for (const auto& form : ModesBench::kDwForms)
    if (dw_dtype == form.name) dw_form = &form;
  if (!dw_form)
    throw std::invalid_argument(
        "--dw-dtype takes f32, input, input-once, input-kept, input-kept-gap, input-kept-apart, input-kept-deferred, "
        "input-rests or input-rests-deferred");
  bench.set_dw_form(*dw_form);
  bench.set_rest_ms(rest_ms);
  if (clocks && !bench.sample_clocks()) std::fprintf(stderr, "# --clocks: NVML did not answer; no clocks\n");
  const char* dw_note = dw_form->note;
  std::printf("# %s, preset %s: N %lld H %lld V %lld %s, median of %d, L2 flushed, CUDA events%s%s%s\n",
              device_description().c_str(), p.name, (long long)n, (long long)h, (long long)v,
              dtype.c_str(), repeats, tune ? ", products tuned" : "", dw_note,
              rest_ms > 0 ? (", " + std::to_string(rest_ms) + " ms of rest before each timed run").c_str() : "");
  std::fflush(stdout);

  // Every row's floor is timed in the same loop as the row itself, run for run (with --floor 0,
  // not at all: the ratios then read as plain milliseconds).
  auto floor_count = [&](const std::string& mode) {
    if (!with_floor) return 0;
    return mode == "forward" || mode.find("topk") != std::string::npos ? 1 : mode == "dx_only" ? 2 : 3;
  };
  std::vector<Row> rows;
  for (const std::string& c : split(chunks)) bench.chunked_products(std::stoll(c));
  for (const std::string& r : split(survey)) bench.survey_algorithms(std::stoll(r), survey_only);
  for (const std::string& r : split(splitk)) bench.splitk_probe(std::stoll(r));
  for (const std::string& r : split(dw_parts)) bench.dw_parts_probe(std::stoll(r));
  auto report = [&](Row r) {
    if (!with_floor) r.floor_ms = 1.0;
    rows.push_back(r);
    std::printf("%-10s budget %6.3f GiB  %8.3f ms  floor %8.3f ms  x%.3f  peak %.3f GiB", r.mode.c_str(),
                r.budget_gib, r.ms, r.floor_ms, r.ms / r.floor_ms, r.peak_gib);
    const Clocks& c = r.clocks;
    if (c.runs > 0 && c.mhz > 0) {
      std::printf("  clock %u MHz, held %d/%d", c.mhz, c.held, c.runs);
      if (c.joules > 0) std::printf(", %.2f J at %.0f W", c.joules, c.watts);
      if (c.floor_mhz > 0) {
        std::printf(" (floor %u MHz, held %d/%d", c.floor_mhz, c.floor_held, c.runs);
        if (c.floor_joules > 0) std::printf(", %.2f J at %.0f W", c.floor_joules, c.floor_watts);
        std::printf(")");
      }
    }
    std::printf("\n");
    std::fflush(stdout);
  };
  const size_t mode_budget = size_t(mode_budget_gib * double(1 << 30));
  for (const std::string& mode : split(modes)) {
    if (mode.rfind("topk", 0) == 0 && mode != "topk")
      report(bench.topk_mode(std::stoll(mode.substr(4)), mode_budget, floor_count(mode)));
    else if (mode.rfind("seedtopk", 0) == 0)
      report(bench.seed_topk_mode(std::stoll(mode.substr(8)), 2048, floor_count(mode)));
    else
      report(bench.loss_mode(mode, mode_budget, floor_count(mode)));
  }
  for (const std::string& b : split(budgets)) {
    Row r = bench.loss_mode("fwd_bwd", size_t(std::stod(b) * double(1 << 30)), floor_count("fwd_bwd"));
    r.mode = "curve";
    report(r);
  }
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) throw std::runtime_error("cannot write " + json_path);
    std::fprintf(f, "{\"device\": \"%s\", \"preset\": \"%s\", \"tokens\": %lld, \"hidden\": %lld, \"vocab\": %lld, "
                    "\"dtype\": \"%s\", \"repeats\": %d, \"rows\": [",
                 device_description().c_str(), p.name, (long long)n, (long long)h, (long long)v,
                 dtype.c_str(), repeats);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f, "%s{\"mode\": \"%s\", \"budget_gib\": %.4f, \"ms\": %.4f, \"floor_ms\": %.4f, \"peak_gib\": %.4f",
                   i ? ", " : "", r.mode.c_str(), r.budget_gib, r.ms, r.floor_ms, r.peak_gib);
      if (r.clocks.runs > 0 && r.clocks.mhz > 0)
        std::fprintf(f, ", \"sm_mhz\": %u, \"held_runs\": %d, \"floor_sm_mhz\": %u, \"floor_held_runs\": %d",
                     r.clocks.mhz, r.clocks.held, r.clocks.floor_mhz, r.clocks.floor_held);
      if (r.clocks.joules > 0)
        std::fprintf(f, ", \"joules\": %.4f, \"watts\": %.1f, \"floor_joules\": %.4f, \"floor_watts\": %.1f",
                     r.clocks.joules, r.clocks.watts, r.clocks.floor_joules, r.clocks.floor_watts);
      std::fprintf(f, "}");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace lmloss::tools

int main(int argc, char** argv) {
  try {
    return lmloss::tools::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_modes: %s\n", e.what());
    return 1;
  }
}

#endif
