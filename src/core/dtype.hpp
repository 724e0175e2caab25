// Storage dtypes and their conversion to the compute type. bf16 and f16 are converted by bit
// manipulation (round to nearest even, NaN kept a NaN), so the host path needs no compiler support
// for half types.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "lmloss/lmloss.h"

namespace lmloss::core {

inline const char* dtype_name(lmloss_dtype dtype) {
  switch (dtype) {
    case LMLOSS_F32: return "f32";
    case LMLOSS_F16: return "f16";
    case LMLOSS_BF16: return "bf16";
    case LMLOSS_F64: return "f64";
    case LMLOSS_I32: return "i32";
    case LMLOSS_I64: return "i64";
    case LMLOSS_U8: return "u8";
    default: return "unknown";
  }
}

inline size_t dtype_size(lmloss_dtype dtype) {
  switch (dtype) {
    case LMLOSS_F32: case LMLOSS_I32: return 4;
    case LMLOSS_F16: case LMLOSS_BF16: return 2;
    case LMLOSS_F64: case LMLOSS_I64: return 8;
    case LMLOSS_U8: return 1;
    default: return 0;
  }
}

inline bool is_float(lmloss_dtype dtype) {
  return dtype == LMLOSS_F32 || dtype == LMLOSS_F16 || dtype == LMLOSS_BF16 || dtype == LMLOSS_F64;
}
inline bool is_index(lmloss_dtype dtype) { return dtype == LMLOSS_I32 || dtype == LMLOSS_I64; }

// The arithmetic type of a float storage type: double for f64, float for the rest.
inline lmloss_dtype compute_dtype_of(lmloss_dtype storage) {
  return storage == LMLOSS_F64 ? LMLOSS_F64 : LMLOSS_F32;
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_float(uint16_t bits) {
  const uint32_t sign = uint32_t(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0) {
    const float magnitude = float(mantissa) * 5.9604644775390625e-8f;  // subnormal: m * 2^-24
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) u = sign | 0x7f800000u | (mantissa << 13);
  else u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return sign | 0x7c00u | (u > 0x7f800000u ? 0x200u : 0u);  // inf, NaN
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: inf
  if (u < 0x38800000u) {                         // below 2^-14: a subnormal half (or zero)
    float magnitude;
    std::memcpy(&magnitude, &u, 4);
    return sign | uint16_t(std::nearbyint(magnitude * 16777216.0f));
  }
  u += 0xfffu + ((u >> 13) & 1u);  // round to nearest even at the 13 dropped bits
  u -= 112u << 23;
  return sign | uint16_t(u >> 13);
}

// Element i of a float tensor's row as the compute type C.
template <typename C>
inline C load_float(const void* row, lmloss_dtype dtype, int64_t i) {
  switch (dtype) {
    case LMLOSS_F32: return C(static_cast<const float*>(row)[i]);
    case LMLOSS_F64: return C(static_cast<const double*>(row)[i]);
    case LMLOSS_BF16: return C(bf16_to_float(static_cast<const uint16_t*>(row)[i]));
    case LMLOSS_F16: return C(f16_to_float(static_cast<const uint16_t*>(row)[i]));
    default: return C(0);
  }
}

template <typename C>
inline void store_float(void* row, lmloss_dtype dtype, int64_t i, C value) {
  switch (dtype) {
    case LMLOSS_F32: static_cast<float*>(row)[i] = float(value); break;
    case LMLOSS_F64: static_cast<double*>(row)[i] = double(value); break;
    case LMLOSS_BF16: static_cast<uint16_t*>(row)[i] = float_to_bf16(float(value)); break;
    case LMLOSS_F16: static_cast<uint16_t*>(row)[i] = float_to_f16(float(value)); break;
    default: break;
  }
}

inline int64_t load_index(const void* data, lmloss_dtype dtype, int64_t i) {
  return dtype == LMLOSS_I64 ? static_cast<const int64_t*>(data)[i]
                             : int64_t(static_cast<const int32_t*>(data)[i]);
}

// The effective first-dimension stride of a tensor (0 means contiguous).
inline int64_t row_stride(const lmloss_tensor& t) {
  if (t.stride != 0) return t.stride;
  return t.ndim == 2 ? t.shape[1] : 1;
}

// A tensor of rank 0 to 2 as rows: a matrix's, or one row (a vector's elements, a scalar).
inline int64_t row_count(const lmloss_tensor& t) { return t.ndim == 2 ? t.shape[0] : 1; }
inline int64_t row_length(const lmloss_tensor& t) { return t.ndim == 2 ? t.shape[1] : t.ndim == 1 ? t.shape[0] : 1; }

// Address of row r (2-D) or element r (1-D) of t.
inline const void* row_ptr(const lmloss_tensor& t, int64_t r) {
  return static_cast<const char*>(t.data) + r * row_stride(t) * int64_t(dtype_size(t.dtype));
}
inline void* row_ptr_mut(const lmloss_tensor& t, int64_t r) {
  return static_cast<char*>(t.data) + r * row_stride(t) * int64_t(dtype_size(t.dtype));
}

}  // namespace lmloss::core
