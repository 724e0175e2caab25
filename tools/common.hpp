// What the `lmloss` subcommands share: dtype names and conversions for the storage types, a
// seeded generator, buffers that live on the CPU or on a CUDA device, and a wall clock.
#pragma once

#include <bit>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "lmloss/lmloss.h"

namespace lmloss::tools {

// ---- dtypes --------------------------------------------------------------------------------

// The library's dtype table and bf16/f16 conversions (src/core/dtype.hpp).
using core::bf16_to_float;
using core::dtype_name;
using core::dtype_size;
using core::f16_to_float;
using core::float_to_bf16;
using core::float_to_f16;
std::optional<lmloss_dtype> parse_dtype(const std::string& name);
// f32, or f64 for f64 inputs: the dtype of losses, lse and teacher probabilities.
inline lmloss_dtype compute_dtype(lmloss_dtype input) { return core::compute_dtype_of(input); }

// Values in double <-> storage bytes of `dtype` (a float dtype or an integer one).
void encode(lmloss_dtype dtype, const double* values, int64_t n, void* out);
void decode(lmloss_dtype dtype, const void* in, int64_t n, double* values);
// The value `x` takes once stored as `dtype`.
double round_to(lmloss_dtype dtype, double x);

// ---- random data ---------------------------------------------------------------------------

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  double normal(double stddev = 1.0) {
    return std::normal_distribution<double>(0.0, stddev)(engine_);
  }
  double uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(engine_);
  }
  int64_t index(int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(engine_); }
  // `k` distinct ids in [0, n), in random order.
  std::vector<int64_t> distinct(int64_t k, int64_t n);

 private:
  std::mt19937_64 engine_;
};

// ---- memory on either side -----------------------------------------------------------------

// Why the CUDA side cannot be used here, or "" when it can: the build, the library and a device.
std::string cuda_unavailable_reason();

// Bytes on the CPU or on CUDA device 0. Copies block: the tool times around them, never through.
class Buffer {
 public:
  Buffer(lmloss_device_type device, size_t bytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  lmloss_device_type device() const { return device_; }
  void upload(const void* host, size_t bytes, size_t offset = 0);
  void download(void* host, size_t bytes, size_t offset = 0) const;

 private:
  lmloss_device_type device_;
  size_t bytes_;
  void* data_ = nullptr;
};

// Waits for every queued CUDA operation (a no-op without CUDA).
void device_synchronize();

// ---- time ----------------------------------------------------------------------------------

inline double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
double median(std::vector<double> values);

}  // namespace lmloss::tools
