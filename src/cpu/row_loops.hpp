// The two loops over a whole row of logits that dominate the CPU row pass, kept apart so they can
// be compiled for vector units: this file's .cpp is built with -fno-trapping-math (so the
// branch-free exp's selects vectorise; no floating-point exception is ever read) and each
// function is cloned for x86-64-v3 (AVX2, FMA), picked at load time where the CPU has it.
#pragma once

#include <cstdint>

namespace lmloss::cpu {

// sum_j exp(z_j - shift), accumulated in double.
double sum_exp(const float* z, int64_t n, float shift);
double sum_exp(const double* z, int64_t n, double shift);

// z_j <- coef * exp(z_j - lse) + offset: the dense part of the gradient, in place.
void dense_grad(float* z, int64_t n, float lse, float coef, float offset);
void dense_grad(double* z, int64_t n, double lse, double coef, double offset);

}  // namespace lmloss::cpu
