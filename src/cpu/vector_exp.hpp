// exp for the CPU row pass, written so that loops over it vectorise: glibc's expf is a scalar
// call, and two of them per logit were most of the row pass's time. Cody-Waite range reduction
// x = n ln2 + r, a degree-6 polynomial for e^r on [-ln2/2, ln2/2] (the classic Cephes
// coefficients), and 2^n put straight into the exponent bits. Within 2 ulp of std::exp over the
// normal range; results that would be subnormal are flushed to 0 (an absolute change below
// 1.2e-38), overflow gives inf and NaN stays NaN. double keeps std::exp: f64 is for exact checks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace lmloss::cpu {

inline float vector_exp(float x) {
  constexpr float max_arg = 88.72283905206835f;   // log(FLT_MAX)
  constexpr float min_arg = -87.33654475055310f;  // log(FLT_MIN)
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
  constexpr float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float xc = x > max_arg ? max_arg : (x < min_arg ? min_arg : (x == x ? x : 0.0f));
  const float n = (xc * log2e + round_magic) - round_magic;
  float r = xc - n * ln2_hi;
  r = r - n * ln2_lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * r * r + r + 1.0f;
  // 2^n as 2^(n/2) 2^(n - n/2): each factor stays a normal float for n in [-126, 128].
  const int32_t n_int = int32_t(n);
  const int32_t half = n_int >> 1;
  const int32_t bits_a = (half + 127) << 23, bits_b = (n_int - half + 127) << 23;
  float scale_a, scale_b;
  std::memcpy(&scale_a, &bits_a, 4);
  std::memcpy(&scale_b, &bits_b, 4);
  float y = er * scale_a * scale_b;
  y = x > max_arg ? std::numeric_limits<float>::infinity() : y;
  y = x < min_arg ? 0.0f : y;
  return x == x ? y : x;
}

inline double vector_exp(double x) { return std::exp(x); }

}  // namespace lmloss::cpu
