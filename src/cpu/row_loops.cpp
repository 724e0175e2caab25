#include "cpu/row_loops.hpp"

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

}  // namespace lmloss::cpu
