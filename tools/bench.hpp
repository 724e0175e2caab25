// The seam between `lmloss bench` (bench.cpp: problem, timing, verification, report) and the
// backends it times. A backend implements the three paths on its own device:
//   floor()  the three bare products of one training step of the head, no loss;
//   naive()  the full logits materialised (as framework autograd holds them and their gradient);
//   fused()  lmloss_loss_forward_backward on the linear head.
// bench_cpu.cpp is the CPU backend (OpenBLAS); a CUDA one (cuBLASLt) goes in bench_cuda.cu and
// is picked up by tools/CMakeLists.txt when that file exists.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "lmloss/lmloss.h"

namespace lmloss::tools {

// The heads the benches run on, by name (N, H, V). small: the whole CPU bench (three paths,
// warm-up and 5 repeats, and the reference) in well under a minute on two cores.
struct BenchPreset {
  const char* name;
  int64_t tokens, hidden, vocab;
};
inline constexpr BenchPreset kBenchPresets[] = {
    {"small", 512, 1024, 32000},
    {"llama3-8b", 8192, 4096, 128256},
    {"gemma2-2b", 8192, 2304, 256000},
};
inline const BenchPreset& find_preset(const std::string& name) {
  for (const BenchPreset& p : kBenchPresets)
    if (name == p.name) return p;
  throw std::invalid_argument("unknown preset " + name);
}

enum class BenchLoss { cross_entropy, distill };

struct BenchProblem {
  int64_t tokens = 0;               // N
  int64_t hidden = 0;               // H
  int64_t vocab = 0;                // V
  int64_t top_k = 0;                // teacher entries per token (distill)
  lmloss_dtype dtype = LMLOSS_F32;  // of X and W
  BenchLoss loss = BenchLoss::cross_entropy;
  size_t budget_bytes = 0;  // lmloss workspace budget, 0: the library's default
  int threads = 0;          // CPU threads, 0: all cores
};

// The inputs, on the host. Every backend times the same values.
struct BenchInputs {
  std::vector<uint8_t> hidden;    // (tokens, hidden) in problem.dtype
  std::vector<uint8_t> weight;    // (vocab, hidden) in problem.dtype
  std::vector<float> hidden_f32;  // the same values in f32
  std::vector<float> weight_f32;
  std::vector<int32_t> labels;       // (tokens), all counted
  std::vector<int32_t> teacher_ids;  // (tokens, top_k), distinct per row (distill)
  std::vector<float> teacher_probs;  // (tokens, top_k), rows sum to 1 (distill)
};

// What a path produced, on the host, for verification.
struct BenchOutputs {
  double loss = 0;
  std::vector<float> grad_hidden;  // (tokens, hidden)
  std::vector<float> grad_weight;  // (vocab, hidden)
};

// The options every path passes to lmloss (the loss the problem asks for, mean over tokens).
lmloss_loss_options bench_loss_options(const BenchProblem& problem);

class BenchBackend {
 public:
  virtual ~BenchBackend() = default;
  virtual std::string name() const = 0;    // "cpu", "cuda"
  virtual std::string device() const = 0;  // the hardware, in words
  // Uploads the inputs and allocates every buffer the paths use; not timed.
  virtual void prepare(const BenchProblem& problem, const BenchInputs& inputs) = 0;
  virtual void floor() = 0;
  virtual void naive() = 0;
  virtual void fused() = 0;
  // Waits for the work the last path enqueued; the driver times a path up to its return.
  virtual void synchronize() {}
  // Before each timed run (e.g. flush a GPU's L2 so runs do not warm each other).
  virtual void flush_caches() {}
  // The most extra bytes a path held at once over its runs so far, beyond the inputs and the
  // caller's gradient buffers.
  virtual size_t naive_peak_bytes() const = 0;
  virtual size_t fused_peak_bytes() const = 0;
  // Times of the stages inside a path, one entry per run, for a profile of where time goes
  // (e.g. "naive: row pass"); empty when the backend does not split its paths.
  virtual std::vector<std::pair<std::string, std::vector<double>>> stage_times() const {
    return {};
  }
  // The last run's loss and gradients.
  virtual BenchOutputs naive_outputs() = 0;
  virtual BenchOutputs fused_outputs() = 0;
};

std::unique_ptr<BenchBackend> make_cpu_bench();
// nullptr, with `reason` set, when this build or machine has no CUDA bench.
std::unique_ptr<BenchBackend> make_cuda_bench(std::string& reason);

}  // namespace lmloss::tools
