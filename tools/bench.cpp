// `lmloss bench`: one training step of the loss head (loss, dX, dW), timed three ways on one
// backend (bench.hpp), verified against a float64 reference, reported as a table and JSON.
#include "bench.hpp"

#include <cblas.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "commands.hpp"
#include "common.hpp"
#include "reference.hpp"
#include "tolerances.hpp"

namespace lmloss::tools {

lmloss_loss_options bench_loss_options(const BenchProblem& problem) {
  lmloss_loss_options o = lmloss_loss_options_default();
  if (problem.loss == BenchLoss::distill) {
    o.ce_weight = 0.0;
    o.kd_weight = 1.0;
  }
  return o;
}

#if !defined(LMLOSS_TOOLS_BENCH_CUDA)
std::unique_ptr<BenchBackend> make_cuda_bench(std::string& reason) {
  reason = cuda_unavailable_reason();
  if (reason.empty()) reason = "the CUDA paths of the bench are not built yet";
  return nullptr;
}
#endif

namespace {

// --verify auto: the float64 reference costs three double products of the problem's size.
constexpr double kAutoVerifyMaxFlops = 2e11;
constexpr double kMiB = 1024.0 * 1024.0;

// X ~ N(0, 1), W ~ N(0, 4 / H): logits of standard deviation ~2, as a trained head gives.
BenchInputs make_inputs(const BenchProblem& p, uint64_t seed) {
  Rng rng(seed);
  BenchInputs in;
  const size_t esize = dtype_size(p.dtype);
  auto fill = [&](int64_t count, double stddev, std::vector<uint8_t>& stored,
                  std::vector<float>& f32) {
    std::vector<double> values(count);
    for (double& x : values) x = rng.normal(stddev);
    stored.resize(count * esize);
    encode(p.dtype, values.data(), count, stored.data());
    decode(p.dtype, stored.data(), count, values.data());  // the rounded values, for f32 copies
    f32.assign(values.begin(), values.end());
  };
  fill(p.tokens * p.hidden, 1.0, in.hidden, in.hidden_f32);
  fill(p.vocab * p.hidden, 2.0 / std::sqrt(double(p.hidden)), in.weight, in.weight_f32);
  in.labels.resize(p.tokens);
  for (int32_t& y : in.labels) y = static_cast<int32_t>(rng.index(p.vocab));
  if (p.loss == BenchLoss::distill) {
    in.teacher_ids.resize(p.tokens * p.top_k);
    in.teacher_probs.resize(p.tokens * p.top_k);
    std::vector<double> raw(p.top_k);
    for (int64_t t = 0; t < p.tokens; ++t) {
      const std::vector<int64_t> ids = rng.distinct(p.top_k, p.vocab);
      double mass = 0;
      for (double& r : raw) mass += r = rng.uniform(0.0, 1.0);
      for (int64_t k = 0; k < p.top_k; ++k) {
        in.teacher_ids[t * p.top_k + k] = static_cast<int32_t>(ids[k]);
        in.teacher_probs[t * p.top_k + k] = static_cast<float>(raw[k] / mass);
      }
    }
  }
  return in;
}

// ---- the float64 reference -------------------------------------------------------------------

struct Reference {
  double loss = 0;
  std::vector<double> grad_hidden;  // (tokens, hidden)
  std::vector<double> grad_weight;  // (vocab, hidden)
};

const char* kReferenceText =
    "float64: logits X W^T by dgemm from the rounded inputs, loss and dZ by the float64 "
    "reference (tests/reference) a block of tokens at a time, dX = dZ W and dW = dZ^T X by dgemm";

// Every token is counted (all labels valid), so the mean's divisor is the token count: each block
// is summed with upstream 1/N and the blocks add up to the mean and its gradient.
Reference compute_reference(const BenchProblem& p, const BenchInputs& in) {
  namespace ref = lmloss::reference;
  const int64_t n = p.tokens, v = p.vocab, h = p.hidden;
  const std::vector<double> x(in.hidden_f32.begin(), in.hidden_f32.end());  // (n, h)
  const std::vector<double> w(in.weight_f32.begin(), in.weight_f32.end());  // (v, h)
  Reference r;
  r.grad_hidden.assign(n * h, 0.0);
  r.grad_weight.assign(v * h, 0.0);
  lmloss_loss_options o = bench_loss_options(p);
  o.reduction = LMLOSS_REDUCTION_SUM;
  const std::vector<double> upstream = {1.0 / double(n)};
  // Blocks of ~8M logits: the reference holds a few copies of them in double.
  const int64_t block = std::max<int64_t>(1, std::min<int64_t>(n, (int64_t{8} << 20) / v));
  double loss_sum = 0;
  for (int64_t t0 = 0; t0 < n; t0 += block) {
    const int64_t rows = std::min(block, n - t0);
    ref::Problem prob;
    prob.n_tokens = rows;
    prob.vocab = v;
    prob.logits.assign(rows * v, 0.0);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(v), int(h), 1.0, &x[t0 * h],
                int(h), w.data(), int(h), 0.0, prob.logits.data(), int(v));
    prob.labels.assign(in.labels.begin() + t0, in.labels.begin() + t0 + rows);
    if (p.loss == BenchLoss::distill) {
      prob.top_k = p.top_k;
      prob.teacher_ids.assign(in.teacher_ids.begin() + t0 * p.top_k,
                              in.teacher_ids.begin() + (t0 + rows) * p.top_k);
      prob.teacher_probs.assign(in.teacher_probs.begin() + t0 * p.top_k,
                                in.teacher_probs.begin() + (t0 + rows) * p.top_k);
    }
    const ref::LossResult block_result = ref::loss(prob, o, upstream);
    loss_sum += block_result.loss.at(0);
    const double* dz = block_result.grad_logits.data();  // (rows, v)
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), int(h), int(v), 1.0, dz,
                int(v), w.data(), int(h), 0.0, &r.grad_hidden[t0 * h], int(h));
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(v), int(h), int(rows), 1.0, dz, int(v),
                &x[t0 * h], int(h), 1.0, r.grad_weight.data(), int(h));
  }
  r.loss = loss_sum / double(n);
  return r;
}

struct Errors {
  double loss = NAN, grad_hidden = NAN, grad_weight = NAN;
  double grad() const {
    return std::isnan(grad_hidden) || std::isnan(grad_weight) ? NAN
                                                              : std::max(grad_hidden, grad_weight);
  }
};

Errors errors_against(const BenchOutputs& out, const Reference& r) {
  namespace ref = lmloss::reference;
  Errors e;
  e.loss = ref::relative_error({out.loss}, {r.loss});
  e.grad_hidden = ref::relative_error(
      std::vector<double>(out.grad_hidden.begin(), out.grad_hidden.end()), r.grad_hidden);
  e.grad_weight = ref::relative_error(
      std::vector<double>(out.grad_weight.begin(), out.grad_weight.end()), r.grad_weight);
  return e;
}

// ---- timing ----------------------------------------------------------------------------------

struct Path {
  const char* name;
  void (BenchBackend::*run)();
  std::vector<double> times;      // wall clock, ms
  std::vector<double> cpu_times;  // this process's CPU time (all threads), ms
};

double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) * 1e-6;
}

// A warm-up run of each path, then `repeats` rounds of one run of each, so that a change of load
// on the machine during the bench falls on every path alike. A progress line on stderr.
void time_paths(BenchBackend& backend, std::vector<Path>& paths, int repeats) {
  const bool tty = isatty(fileno(stderr));
  for (int round = 0; round <= repeats; ++round) {
    for (Path& path : paths) {
      if (tty) {
        std::fprintf(stderr, "\rbench: %s %d/%d, %-7s", round == 0 ? "warm-up" : "round", round,
                     repeats, path.name);
      } else if (&path == &paths.front()) {
        std::fprintf(stderr, "bench: %s %d/%d\n", round == 0 ? "warm-up" : "round", round, repeats);
      }
      std::fflush(stderr);
      backend.flush_caches();
      const double cpu_start = process_cpu_ms();
      const double start = now_ms();
      (backend.*path.run)();
      backend.synchronize();
      const double elapsed = now_ms() - start;
      const double cpu_elapsed = process_cpu_ms() - cpu_start;
      if (round > 0) {
        path.times.push_back(elapsed);
        path.cpu_times.push_back(cpu_elapsed);
      }
    }
  }
  if (tty) std::fprintf(stderr, "\n");
}

// "-" when the reference did not run; a NaN from a path that did run shows as nan.
std::string format_error(bool verified, double e) {
  if (!verified) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.2e", e);
  return text;
}

nlohmann::json json_number(double x) {
  return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr);
}

}  // namespace

int run_bench(const BenchOptions& options) {
  const BenchPreset& preset = find_preset(options.preset);
  BenchProblem p;
  p.tokens = options.tokens > 0 ? options.tokens : preset.tokens;
  p.hidden = options.hidden > 0 ? options.hidden : preset.hidden;
  p.vocab = options.vocab > 0 ? options.vocab : preset.vocab;
  p.loss = options.loss == "distill" ? BenchLoss::distill : BenchLoss::cross_entropy;
  p.top_k = p.loss == BenchLoss::distill ? options.top_k : 0;
  p.dtype = parse_dtype(options.dtype).value();
  p.budget_bytes = static_cast<size_t>(options.budget_mib * kMiB);
  p.threads = options.threads;
  if (p.top_k > p.vocab) throw std::invalid_argument("--top-k exceeds the vocabulary");

  std::unique_ptr<BenchBackend> backend;
  if (options.backend != "cpu") {
    std::string reason;
    backend = make_cuda_bench(reason);
    if (!backend) {
      std::fprintf(stderr, "cuda: not built/available (%s)\n", reason.c_str());
      if (options.backend == "cuda") return 1;
    }
  }
  if (!backend) backend = make_cpu_bench();

  const double flops = 2.0 * double(p.tokens) * double(p.hidden) * double(p.vocab);
  const bool verify =
      options.verify == "on" || (options.verify == "auto" && flops <= kAutoVerifyMaxFlops);

  const BenchInputs inputs = make_inputs(p, options.seed);
  backend->prepare(p, inputs);
  std::fprintf(stderr, "bench: %s (%s), N %lld H %lld V %lld, %s %s\n", backend->name().c_str(),
               backend->device().c_str(), static_cast<long long>(p.tokens),
               static_cast<long long>(p.hidden), static_cast<long long>(p.vocab),
               dtype_name(p.dtype), options.loss.c_str());

  std::vector<Path> paths = {{"floor", &BenchBackend::floor, {}, {}},
                             {"naive", &BenchBackend::naive, {}, {}},
                             {"lmloss", &BenchBackend::fused, {}, {}}};
  time_paths(*backend, paths, options.repeats);
  const std::vector<double>& floor_times = paths[0].times;
  const std::vector<double>& fused_times = paths[2].times;
  const BenchOutputs naive_out = backend->naive_outputs();
  const BenchOutputs fused_out = backend->fused_outputs();

  Errors naive_err, fused_err;
  if (verify) {
    std::fprintf(stderr, "bench: float64 reference...\n");
    const Reference r = compute_reference(p, inputs);
    naive_err = errors_against(naive_out, r);
    fused_err = errors_against(fused_out, r);
  }

  const double floor_ms = median(floor_times);
  const double floor_cpu = median(paths[0].cpu_times);
  struct Result {
    const char* name;
    const Path* path;
    size_t peak;
    Errors err;
  };
  const Result results[] = {
      {"lmloss", &paths[2], backend->fused_peak_bytes(), fused_err},
      {"naive", &paths[1], backend->naive_peak_bytes(), naive_err},
  };

  const double logits_bytes = double(p.tokens) * double(p.vocab) * 4.0;
  std::printf(
      "lmloss bench: %s (%s); N %lld, H %lld, V %lld, %s, %s; median of %d; floor %.1f ms\n",
      backend->name().c_str(), backend->device().c_str(), static_cast<long long>(p.tokens),
      static_cast<long long>(p.hidden), static_cast<long long>(p.vocab), dtype_name(p.dtype),
      options.loss.c_str(), options.repeats, floor_ms);
  const double floor_min = *std::min_element(floor_times.begin(), floor_times.end());
  std::printf("%-7s %10s %8s %10s %8s %10s %8s %10s %13s %13s\n", "name", "median ms", "x floor",
              "min ms", "x floor", "cpu ms", "x floor", "peak MiB", "loss_rel_err", "grad_rel_err");
  std::printf("%-7s %10.1f %8.3f %10.1f %8.3f %10.1f %8.3f %10s %13s %13s\n", "floor", floor_ms,
              1.0, floor_min, 1.0, floor_cpu, 1.0, "-", "-", "-");
  nlohmann::json json_results = nlohmann::json::array();
  for (const Result& r : results) {
    const double ms = median(r.path->times);
    const double min_ms = *std::min_element(r.path->times.begin(), r.path->times.end());
    const double cpu_ms = median(r.path->cpu_times);
    std::printf("%-7s %10.1f %8.3f %10.1f %8.3f %10.1f %8.3f %10.1f %13s %13s\n", r.name, ms,
                ms / floor_ms, min_ms, min_ms / floor_min, cpu_ms, cpu_ms / floor_cpu,
                r.peak / kMiB, format_error(verify, r.err.loss).c_str(),
                format_error(verify, r.err.grad()).c_str());
    json_results.push_back({{"name", r.name},
                            {"median_ms", ms},
                            {"min_ms", min_ms},
                            {"times_ms", r.path->times},
                            {"median_cpu_ms", cpu_ms},
                            {"peak_bytes", r.peak},
                            {"loss_rel_err", json_number(r.err.loss)},
                            {"grad_rel_err", json_number(r.err.grad())},
                            {"grad_hidden_rel_err", json_number(r.err.grad_hidden)},
                            {"grad_weight_rel_err", json_number(r.err.grad_weight)},
                            {"ratio_to_floor", ms / floor_ms}});
  }
  // The target is judged on medians; the ratio of minima beside it is what a quiet machine gives.
  const double fused_ratio = median(fused_times) / floor_ms;
  const double fused_min_ratio =
      *std::min_element(fused_times.begin(), fused_times.end()) / floor_min;
  const double saved = double(backend->naive_peak_bytes()) - double(backend->fused_peak_bytes());
  // The CPU backend's acceptance target; the GPU's targets are per mode and against the peers
  // (docs/performance.md), so a CUDA run prints no verdict here.
  if (backend->name() == "cpu")
    std::printf(
        "target: lmloss within 1.3x of the floor: %s (median %.3fx, min %.3fx); peak below "
        "naive by at least the logits (%.1f MiB): %s (%.1f MiB less)\n",
        fused_ratio <= 1.3 ? "met" : "missed", fused_ratio, fused_min_ratio, logits_bytes / kMiB,
        saved >= logits_bytes ? "met" : "missed", saved / kMiB);
  nlohmann::json json_stages = nlohmann::json::object();
  for (const auto& [stage, times] : backend->stage_times()) {
    std::printf("  %-40s %10.1f ms median %10.1f ms min\n", stage.c_str(), median(times),
                *std::min_element(times.begin(), times.end()));
    json_stages[stage] = median(times);
  }

  // A bench that times wrong answers says so: its exit status fails past the check's tolerance.
  const double tolerance = tolerance_for(p.dtype);
  bool accurate = true;
  if (verify) {
    for (const Result& r : results) {
      const bool ok = r.err.loss <= tolerance && r.err.grad() <= tolerance;
      if (!ok)
        std::printf("error: %s is off the float64 reference by more than %.0e\n", r.name,
                    tolerance);
      accurate = accurate && ok;
    }
  }

  if (!options.json_path.empty()) {
    nlohmann::json doc = {
        {"backend", backend->name()},
        {"device", backend->device()},
        {"problem",
         {{"tokens", p.tokens},
          {"hidden", p.hidden},
          {"vocab", p.vocab},
          {"dtype", dtype_name(p.dtype)},
          {"loss", options.loss},
          {"top_k", p.top_k}}},
        {"repeats", options.repeats},
        {"budget_bytes", p.budget_bytes},
        {"floor_ms", floor_ms},
        {"floor_min_ms", floor_min},
        {"floor_times_ms", floor_times},
        {"floor_median_cpu_ms", floor_cpu},
        {"reference", verify ? nlohmann::json(kReferenceText) : nlohmann::json(nullptr)},
        {"tolerance", verify ? nlohmann::json(tolerance) : nlohmann::json(nullptr)},
        {"results", json_results},
        {"stages_ms", json_stages},
    };
    std::ofstream file(options.json_path);
    if (!file) throw std::runtime_error("cannot write " + options.json_path);
    file << doc.dump(2) << "\n";
  }
  return accurate ? 0 : 1;
}

}  // namespace lmloss::tools
