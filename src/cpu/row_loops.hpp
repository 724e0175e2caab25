// The loops over whole rows that dominate the CPU backend (the row pass's exponentials, and the
// conversions of 16-bit storage), kept apart so they can be compiled for vector units: this file's .cpp is built with -fno-trapping-math (so the
// branch-free exp's selects vectorise; no floating-point exception is ever read) and each
// function is cloned for x86-64-v3 (AVX2, FMA), picked at load time where the CPU has it.
#pragma once

#include <cstdint>

#include "lmloss/lmloss.h"

namespace lmloss::cpu {

// sum_j exp(z_j - shift), accumulated in double.
double sum_exp(const float* z, int64_t n, float shift);
double sum_exp(const double* z, int64_t n, double shift);

// z_j <- coef * exp(z_j - lse) + offset: the dense part of the gradient, in place.
void dense_grad(float* z, int64_t n, float lse, float coef, float offset);
void dense_grad(double* z, int64_t n, double lse, double coef, double offset);

// dst[j] = src[j] converted from the storage dtype, for a contiguous row of n values.
void load_row(const void* src, lmloss_dtype dtype, float* dst, int64_t n);
void load_row(const void* src, lmloss_dtype dtype, double* dst, int64_t n);
// dst[j] = src[j] converted to the storage dtype (round to nearest even).
void store_row(const float* src, void* dst, lmloss_dtype dtype, int64_t n);
void store_row(const double* src, void* dst, lmloss_dtype dtype, int64_t n);

}  // namespace lmloss::cpu
