// The subcommands of `lmloss`, as main.cpp parses them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lmloss::tools {

struct CheckOptions {
  std::string backend = "all";      // cpu, cuda or all
  std::vector<std::string> dtypes;  // empty: every dtype the backend takes
  size_t budget_bytes = 0;          // 0: the check's own small budget (several chunks per call)
  uint64_t seed = 1;
};

// "f64 1e-10, f32 1e-05, ...": the check's tolerances, for its help.
std::string check_tolerances_text();

// Exit status: 0 iff every operation passed on every backend it ran on.
int run_check(const CheckOptions& options);

struct BenchOptions {
  std::string preset = "small";  // small, llama3-8b, gemma2-2b
  int64_t tokens = 0;            // 0: the preset's
  int64_t hidden = 0;            // 0: the preset's
  int64_t vocab = 0;             // 0: the preset's
  std::string dtype = "f32";     // f32, bf16, f16
  std::string loss = "ce";       // ce, distill
  std::string backend = "auto";  // cpu, cuda, auto
  double budget_mib = 0;         // 0: the library's default workspace budget
  int repeats = 5;
  int threads = 0;              // CPU threads, 0: all cores
  int64_t top_k = 64;           // teacher entries per token for --loss distill
  std::string verify = "auto";  // on, off, auto (on when the float64 reference is affordable)
  std::string json_path;        // empty: no JSON file
  uint64_t seed = 1;
};

int run_bench(const BenchOptions& options);

}  // namespace lmloss::tools
