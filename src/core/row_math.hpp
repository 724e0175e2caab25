// The per-token math of docs/contract.md, in one place for every backend (host and device).
//
// A row of logits z (vocab) becomes scaled logits s = cap(z) / T, cap(z) = c tanh(z / c) when
// soft-capping is on. With lse = log sum exp(s) and p = exp(s - lse), the token's loss is
//   l = alpha (lse - (1 - eps) s_y - (eps / V) sum_j s_j) + lambda lse^2
//       + beta (sum_k P_k log P_k - sum_k P_k s_{I_k} + lse sum_k P_k)
// and its gradient with respect to s is dense plus sparse:
//   dl/ds_j = g (alpha + 2 lambda lse + beta sum_k P_k) p_j - g alpha eps / V     (every j)
//             - g alpha (1 - eps) [j = y] - g beta sum_k P_k [j = I_k]           (a few j)
// chained to z by ds/dz = (1 - (cap(z) / c)^2) / T. Backends form the row statistics their own
// way (one pass, online max, tiles) and call these for the arithmetic.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define LMLOSS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LMLOSS_HOST_DEVICE inline
#endif

namespace lmloss::core {

// T is float (f32/f16/bf16 inputs) or double (f64 inputs).
template <typename T>
struct LogitScale {
  T softcap;          // 0: off
  T inv_softcap;
  T inv_temperature;

  static LogitScale make(double softcap, double temperature) {
    return {T(softcap), softcap > 0 ? T(1.0 / softcap) : T(0), T(1.0 / temperature)};
  }
  // s = cap(z) / T
  LMLOSS_HOST_DEVICE T apply(T z) const {
    if (softcap > T(0)) z = softcap * std::tanh(z * inv_softcap);
    return z * inv_temperature;
  }
  // ds/dz, given s = apply(z).
  LMLOSS_HOST_DEVICE T derivative(T s) const {
    if (softcap > T(0)) {
      const T capped_over_c = s / (inv_temperature * softcap);  // cap(z) / c
      return inv_temperature * (T(1) - capped_over_c * capped_over_c);
    }
    return inv_temperature;
  }
};

template <typename T>
struct LossWeights {
  T alpha;            // cross-entropy weight
  T beta;             // distillation weight
  T label_smoothing;  // eps
  T z_loss;           // lambda
  T inv_vocab;

  static LossWeights make(double alpha, double beta, double eps, double lambda, int64_t vocab) {
    return {T(alpha), T(beta), T(eps), T(lambda), T(1.0 / double(vocab))};
  }

  // What a row contributes. s_label: s_y (unused when alpha = 0); sum_s: sum_j s_j (only read
  // when eps > 0); teacher_cross: sum_k P_k (log P_k - s_{I_k}) with 0 log 0 = 0; teacher_mass:
  // sum_k P_k.
  LMLOSS_HOST_DEVICE T loss(T lse, T s_label, T sum_s, T teacher_cross, T teacher_mass) const {
    T l = z_loss != T(0) ? z_loss * lse * lse : T(0);  // absent at 0, not 0 inf^2 for an infinite lse
    if (alpha != T(0)) {
      T ce = lse - (T(1) - label_smoothing) * s_label;
      if (label_smoothing != T(0)) ce -= label_smoothing * inv_vocab * sum_s;
      l += alpha * ce;
    }
    if (beta != T(0)) l += beta * (teacher_cross + lse * teacher_mass);
    return l;
  }
  // dl/ds_j = p_coef * p_j + offset, before the sparse corrections.
  LMLOSS_HOST_DEVICE T p_coef(T g, T lse, T teacher_mass) const {
    return g * (alpha + (z_loss != T(0) ? T(2) * z_loss * lse : T(0)) + beta * teacher_mass);
  }
  LMLOSS_HOST_DEVICE T offset(T g) const { return -g * alpha * label_smoothing * inv_vocab; }
  // Added to dl/ds at the label, and at each teacher id (times P_k).
  LMLOSS_HOST_DEVICE T label_correction(T g) const { return -g * alpha * (T(1) - label_smoothing); }
  LMLOSS_HOST_DEVICE T teacher_correction(T g, T prob) const { return -g * beta * prob; }
};

// P log P with 0 log 0 = 0 (a teacher entry of probability 0 contributes nothing).
template <typename T>
LMLOSS_HOST_DEVICE T xlogx(T x) {
  return x > T(0) ? x * std::log(x) : T(0);
}

// A teacher entry's part of sum_k P_k (log P_k - s_k): nothing for P = 0, even at an id whose
// logit is -inf (masked), where P s would be 0 x inf.
template <typename T>
LMLOSS_HOST_DEVICE T teacher_cross_term(T prob, T s) {
  return prob != T(0) ? xlogx(prob) - prob * s : T(0);
}

}  // namespace lmloss::core
