#include "cpu/row_loops.hpp"

#include "core/dtype.hpp"
#include "cpu/vector_exp.hpp"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LMLOSS_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LMLOSS_VECTOR_CLONES
#endif

namespace lmloss::cpu {

LMLOSS_VECTOR_CLONES double sum_exp(const float* z, int64_t n, float shift) {
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += double(vector_exp(z[j] - shift));
  return sum;
}

double sum_exp(const double* z, int64_t n, double shift) {
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += vector_exp(z[j] - shift);
  return sum;
}

LMLOSS_VECTOR_CLONES void dense_grad(float* z, int64_t n, float lse, float coef, float offset) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) z[j] = coef * vector_exp(z[j] - lse) + offset;
}

void dense_grad(double* z, int64_t n, double lse, double coef, double offset) {
  for (int64_t j = 0; j < n; ++j) z[j] = coef * vector_exp(z[j] - lse) + offset;
}

// The dtype switch sits outside the loops so that each loop is one conversion, which vectorises.
template <typename C>
void load_row_as(const void* src, lmloss_dtype dtype, C* dst, int64_t n) {
  switch (dtype) {
    case LMLOSS_F32: {
      const float* s = static_cast<const float*>(src);
      for (int64_t j = 0; j < n; ++j) dst[j] = C(s[j]);
      break;
    }
    case LMLOSS_F64: {
      const double* s = static_cast<const double*>(src);
      for (int64_t j = 0; j < n; ++j) dst[j] = C(s[j]);
      break;
    }
    case LMLOSS_BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t j = 0; j < n; ++j) dst[j] = C(core::bf16_to_float(s[j]));
      break;
    }
    case LMLOSS_F16: {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (int64_t j = 0; j < n; ++j) dst[j] = C(core::f16_to_float(s[j]));
      break;
    }
    default: break;
  }
}

template <typename C>
void store_row_as(const C* src, void* dst, lmloss_dtype dtype, int64_t n) {
  switch (dtype) {
    case LMLOSS_F32: {
      float* d = static_cast<float*>(dst);
      for (int64_t j = 0; j < n; ++j) d[j] = float(src[j]);
      break;
    }
    case LMLOSS_F64: {
      double* d = static_cast<double*>(dst);
      for (int64_t j = 0; j < n; ++j) d[j] = double(src[j]);
      break;
    }
    case LMLOSS_BF16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t j = 0; j < n; ++j) d[j] = core::float_to_bf16(float(src[j]));
      break;
    }
    case LMLOSS_F16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (int64_t j = 0; j < n; ++j) d[j] = core::float_to_f16(float(src[j]));
      break;
    }
    default: break;
  }
}

LMLOSS_VECTOR_CLONES void load_row(const void* src, lmloss_dtype dtype, float* dst, int64_t n) {
  load_row_as(src, dtype, dst, n);
}
void load_row(const void* src, lmloss_dtype dtype, double* dst, int64_t n) { load_row_as(src, dtype, dst, n); }
LMLOSS_VECTOR_CLONES void store_row(const float* src, void* dst, lmloss_dtype dtype, int64_t n) {
  store_row_as(src, dst, dtype, n);
}
void store_row(const double* src, void* dst, lmloss_dtype dtype, int64_t n) { store_row_as(src, dst, dtype, n); }

}  // namespace lmloss::cpu
