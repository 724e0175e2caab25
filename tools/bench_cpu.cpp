// The CPU paths of `lmloss bench`, with OpenBLAS products in f32.
//   floor:  Z = X W^T, dX = Z W, dW = Z^T X        (Z stands in for its gradient)
//   naive:  Z = X W^T into an f32 (tokens, vocab) buffer; loss and dZ by lmloss's logits path
//           into a second (tokens, vocab) buffer; dX = dZ W; dW = dZ^T X
//   fused:  lmloss_loss_forward_backward(hidden, weight) -> loss, dX, dW
// bf16/f16 inputs: the floor and the naive path multiply f32 copies made in prepare(), untimed
// (counted in the naive path's memory); the fused path reads the half-precision inputs itself.
#include <cblas.h>

#include <array>
#include <fstream>
#include <string>
#include <thread>

#include "bench.hpp"
#include "common.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::tools {
namespace {

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
    }
  }
  return "unknown CPU";
}

class CpuBench final : public BenchBackend {
 public:
  std::string name() const override { return "cpu"; }
  std::string device() const override {
    const int threads =
        p_.threads > 0 ? p_.threads : static_cast<int>(std::thread::hardware_concurrency());
    return cpu_model() + ", " + std::to_string(threads) + " threads";
  }

  void prepare(const BenchProblem& problem, const BenchInputs& inputs) override {
    p_ = problem;
    in_ = &inputs;
    if (p_.threads > 0) {
      openblas_set_num_threads(p_.threads);
      ctx_.set_num_threads(p_.threads);
    }
    if (p_.budget_bytes) ctx_.set_workspace_budget(p_.budget_bytes);
    const size_t n = p_.tokens, v = p_.vocab, h = p_.hidden;
    logits_.assign(n * v, 0.0f);
    grad_logits_.assign(n * v, 0.0f);
    dx_.assign(n * h, 0.0f);
    dw_.assign(v * h, 0.0f);
    floor_dx_.assign(n * h, 0.0f);
    floor_dw_.assign(v * h, 0.0f);
    fused_dx_.assign(n * h * dtype_size(p_.dtype), 0);
    fused_dw_.assign(v * h, 0.0f);
  }

  void floor() override {
    const int n = static_cast<int>(p_.tokens), v = static_cast<int>(p_.vocab),
              h = static_cast<int>(p_.hidden);
    const float* x = in_->hidden_f32.data();
    const float* w = in_->weight_f32.data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, v, h, 1.0f, x, h, w, h, 0.0f,
                logits_.data(), v);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, h, v, 1.0f, logits_.data(), v, w, h,
                0.0f, floor_dx_.data(), h);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, h, n, 1.0f, logits_.data(), v, x, h,
                0.0f, floor_dw_.data(), h);
  }

  void naive() override {
    const int n = static_cast<int>(p_.tokens), v = static_cast<int>(p_.vocab),
              h = static_cast<int>(p_.hidden);
    const float* x = in_->hidden_f32.data();
    const float* w = in_->weight_f32.data();
    const double t0 = now_ms();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, v, h, 1.0f, x, h, w, h, 0.0f,
                logits_.data(), v);
    const double t1 = now_ms();

    const lmloss_head head =
        lmloss::logits_head(Tensor::matrix(logits_.data(), p_.tokens, p_.vocab));
    const lmloss_grads grads =
        lmloss::logits_grads(Tensor::matrix(grad_logits_.data(), p_.tokens, p_.vocab));
    ctx_.reset_peak_workspace();
    lmloss::loss_forward_backward(ctx_, head, targets(), bench_loss_options(p_), Tensor{},
                                  Tensor::scalar(&naive_loss_), Tensor{}, grads);
    const size_t row_pass_peak = ctx_.peak_workspace();
    const double t2 = now_ms();

    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, h, v, 1.0f, grad_logits_.data(), v, w,
                h, 0.0f, dx_.data(), h);
    const double t3 = now_ms();
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, v, h, n, 1.0f, grad_logits_.data(), v, x,
                h, 0.0f, dw_.data(), h);
    const double t4 = now_ms();
    stages_[0].second.push_back(t1 - t0);
    stages_[1].second.push_back(t2 - t1);
    stages_[2].second.push_back(t3 - t2);
    stages_[3].second.push_back(t4 - t3);

    // Half inputs: this BLAS multiplies f32 only, so the f32 copies of X and W are memory the
    // naive path needs (made once, outside the timing, but held).
    const size_t copies = p_.dtype == LMLOSS_F32
                              ? 0
                              : (in_->hidden_f32.size() + in_->weight_f32.size()) * sizeof(float);
    const size_t held =
        (logits_.size() + grad_logits_.size()) * sizeof(float) + copies + row_pass_peak;
    if (held > naive_peak_) naive_peak_ = held;
  }

  void fused() override {
    const lmloss_dtype dt = p_.dtype;
    // The inputs are only read; the C API takes non-const data pointers.
    void* x = const_cast<uint8_t*>(in_->hidden.data());
    void* w = const_cast<uint8_t*>(in_->weight.data());
    const lmloss::Linear linear{Tensor::matrix(x, dt, p_.tokens, p_.hidden),
                                Tensor::matrix(w, dt, p_.vocab, p_.hidden), Tensor{}};
    const lmloss::LinearGrads grads{
        Tensor::matrix(static_cast<void*>(fused_dx_.data()), dt, p_.tokens, p_.hidden),
        Tensor::matrix(fused_dw_.data(), p_.vocab, p_.hidden), Tensor{}};
    ctx_.reset_peak_workspace();
    lmloss::loss_forward_backward(ctx_, lmloss::linear_head(linear), targets(),
                                  bench_loss_options(p_), Tensor{}, Tensor::scalar(&fused_loss_),
                                  Tensor{}, lmloss::linear_grads(grads));
    const size_t peak = ctx_.peak_workspace();
    if (peak > fused_peak_) fused_peak_ = peak;
  }

  std::vector<std::pair<std::string, std::vector<double>>> stage_times() const override {
    return std::vector<std::pair<std::string, std::vector<double>>>(stages_.begin(), stages_.end());
  }

  size_t naive_peak_bytes() const override { return naive_peak_; }
  size_t fused_peak_bytes() const override { return fused_peak_; }

  BenchOutputs naive_outputs() override { return {naive_loss_, dx_, dw_}; }
  BenchOutputs fused_outputs() override {
    BenchOutputs out{fused_loss_, std::vector<float>(dx_.size()), fused_dw_};
    std::vector<double> values(dx_.size());
    decode(p_.dtype, fused_dx_.data(), static_cast<int64_t>(values.size()), values.data());
    for (size_t i = 0; i < values.size(); ++i) out.grad_hidden[i] = static_cast<float>(values[i]);
    return out;
  }

 private:
  lmloss_targets targets() const {
    auto* labels = const_cast<int32_t*>(in_->labels.data());
    const Tensor label_view = Tensor::vector(labels, p_.tokens);
    if (p_.loss != BenchLoss::distill) return lmloss::label_targets(label_view);
    auto* ids = const_cast<int32_t*>(in_->teacher_ids.data());
    auto* probs = const_cast<float*>(in_->teacher_probs.data());
    return lmloss::teacher_targets(
        {Tensor::matrix(ids, p_.tokens, p_.top_k), Tensor::matrix(probs, p_.tokens, p_.top_k)},
        label_view);
  }

  BenchProblem p_;
  const BenchInputs* in_ = nullptr;
  lmloss::Context ctx_;
  std::vector<float> logits_;       // (tokens, vocab): naive's logits, the floor's Z
  std::vector<float> grad_logits_;  // (tokens, vocab): naive's dZ
  std::vector<float> floor_dx_;     // (tokens, hidden)
  std::vector<float> floor_dw_;     // (vocab, hidden)
  std::vector<float> dx_;           // (tokens, hidden): naive
  std::vector<float> dw_;           // (vocab, hidden): naive
  std::vector<uint8_t> fused_dx_;   // (tokens, hidden) in the input dtype
  std::vector<float> fused_dw_;     // (vocab, hidden)
  float naive_loss_ = 0;
  float fused_loss_ = 0;
  size_t naive_peak_ = 0;
  size_t fused_peak_ = 0;
  std::array<std::pair<std::string, std::vector<double>>, 4> stages_ = {{
      {"naive: logits product", {}},
      {"naive: row pass (lmloss, logits input)", {}},
      {"naive: dX product", {}},
      {"naive: dW product", {}},
  }};
};

}  // namespace

std::unique_ptr<BenchBackend> make_cpu_bench() { return std::make_unique<CpuBench>(); }

}  // namespace lmloss::tools
