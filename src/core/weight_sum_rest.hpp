// A bf16 dW's sum kept as its bf16 values, in grad_weight's own bytes, and an 8-bit rest of each,
// in a u8 (vocab, hidden) tail of the caller's (options.grad_weight_sum_tail): 3 bytes a weight
// where an f32 sum costs 4, and ~16 significant bits, against bf16's 8. Each value s of the sum is
// held as hi = bf16(s) and the integer r nearest (s - hi) / unit(hi), |r| <= 127, where unit(hi)
// = ulp(hi) / 254 (ulp: hi's bf16 spacing, floored at 2^-100, below which nothing is worth a
// rest); it reads back as join(hi, r) = hi + r unit(hi), within unit(hi) / 2 of s. A sum of a
// few chunks so kept stays within ~1e-5 of the f32 sum (docs/performance.md), and rounds to the
// same bf16 dW but for the rare value that lies on a rounding boundary. The arithmetic, one place
// for every backend (host and device), in f32 with the same roundings on both.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/row_math.hpp"  // LMLOSS_HOST_DEVICE

namespace lmloss::core {

constexpr float kRestUnitsPerUlp = 254.f;  // |r| <= 127: the rest of a value within ulp / 2 of hi
constexpr int kRestLeastUlpExponent = 27;  // the ulp's floor as an f32 exponent field: 2^-100

LMLOSS_HOST_DEVICE uint32_t rest_bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

LMLOSS_HOST_DEVICE float rest_float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// ulp(hi) as the exponent field of an f32: hi's exponent field E puts |hi| in [2^(E-127),
// 2^(E-126)), where bf16's 7 fraction bits step by 2^(E-134).
LMLOSS_HOST_DEVICE int rest_ulp_exponent(float hi) {
  const int e = int((rest_bits_of(hi) >> 23) & 0xffu) - 7;
  return e < kRestLeastUlpExponent ? kRestLeastUlpExponent : e;
}

// bf16(s) as its bits, rounded to nearest even (NaN kept quiet), as lmloss stores bf16 elsewhere.
LMLOSS_HOST_DEVICE uint16_t rest_bf16_bits(float s) {
  uint32_t u = rest_bits_of(s);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

LMLOSS_HOST_DEVICE float rest_bf16_value(uint16_t bits) { return rest_float_of(uint32_t(bits) << 16); }

// hi + r unit(hi), rounded once.
LMLOSS_HOST_DEVICE float rest_join(float hi, int8_t rest) {
  const float unit = rest_float_of(uint32_t(rest_ulp_exponent(hi)) << 23) * (1.f / kRestUnitsPerUlp);
  return fmaf(float(rest), unit, hi);
}

// The rest of s beside hi = bf16(s). s - hi is exact in f32 and its scaling by 1 / ulp a power of
// two; a NaN or infinite s leaves hi NaN or infinite, which the sum reads back as such.
LMLOSS_HOST_DEVICE int8_t rest_of(float s, float hi) {
  const float inverse_ulp = rest_float_of(uint32_t(254 - rest_ulp_exponent(hi)) << 23);
  const float r = rintf((s - hi) * inverse_ulp * kRestUnitsPerUlp);
  return int8_t(r >= 127.f ? 127.f : r >= -127.f ? r : -127.f);  // NaN to -127: hi carries it
}

// s stored as the pair: hi's bits and its rest.
struct RestPair {
  uint16_t hi;
  int8_t rest;
};
LMLOSS_HOST_DEVICE RestPair rest_split(float s) {
  const uint16_t hi = rest_bf16_bits(s);
  return {hi, rest_of(s, rest_bf16_value(hi))};
}

}  // namespace lmloss::core
