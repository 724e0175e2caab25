// A bf16 head's weight gradient over micro-batches, summed in f32 and rounded once: the sum is
// kept in the bf16 gradient's own bytes and an f32 tail (options.grad_weight_sum_tail), each
// micro-batch adds into it, and lmloss_round_grad_weight rounds it with the 1 / micro-batches scale
// the mean over them wants. Checked against the same calls into an f32 gradient.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "lmloss/lmloss.hpp"

namespace {
uint16_t to_bf16(float f) {  // round to nearest even (no NaNs here)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

int main() {
  const int64_t micro_batches = 4, tokens = 16, hidden = 32, vocab = 1000;  // tokens per micro-batch
  std::vector<uint16_t> x(micro_batches * tokens * hidden), w(vocab * hidden);
  for (size_t i = 0; i < x.size(); ++i) x[i] = to_bf16(std::sin(0.37f * float(i)));
  for (size_t i = 0; i < w.size(); ++i) w[i] = to_bf16(0.3f * std::cos(0.11f * float(i)));
  std::vector<int32_t> labels(micro_batches * tokens);
  for (size_t t = 0; t < labels.size(); ++t) labels[t] = int32_t((t * 37) % vocab);

  const int64_t tail_rows = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(vocab);
  std::vector<uint16_t> grad_w(vocab * hidden);   // the bf16 gradient (its bytes hold half the sum)
  std::vector<float> tail(tail_rows * hidden);    // the rest of the f32 sum
  std::vector<float> grad_w_f32(vocab * hidden);  // the check: the same sum in an f32 gradient
  float loss = 0, scale = 1.0f / float(micro_batches);
  using lmloss::Tensor;
  try {
    lmloss::Context ctx;
    for (int64_t m = 0; m < micro_batches; ++m) {
      const lmloss::Linear head{Tensor::matrix(&x[m * tokens * hidden], LMLOSS_BF16, tokens, hidden),
                                Tensor::matrix(w.data(), LMLOSS_BF16, vocab, hidden), Tensor{}};
      const Tensor y = Tensor::vector(&labels[m * tokens], tokens);
      lmloss::LossOptions options;
      if (m > 0) options.flags |= LMLOSS_ACCUMULATE_GRAD_WEIGHT;  // add into the sum
      lmloss::LossOptions kept = options;
      kept.grad_weight_sum_tail = Tensor::matrix(tail.data(), tail_rows, hidden);
      lmloss::linear_cross_entropy(ctx, head, y, kept, Tensor::scalar(&loss), Tensor{},
                                   {.grad_weight = Tensor::matrix(grad_w.data(), LMLOSS_BF16, vocab, hidden)});
      lmloss::linear_cross_entropy(ctx, head, y, options, Tensor::scalar(&loss), Tensor{},
                                   {.grad_weight = Tensor::matrix(grad_w_f32.data(), vocab, hidden)});
    }
    lmloss::round_grad_weight(ctx, Tensor::matrix(grad_w.data(), LMLOSS_BF16, vocab, hidden),
                              Tensor::matrix(tail.data(), tail_rows, hidden), Tensor::scalar(&scale));
  } catch (const lmloss::Error& e) {
    std::fprintf(stderr, "lmloss: %s\n", e.what());
    return 1;
  }
  int64_t differ = 0;
  for (size_t i = 0; i < grad_w.size(); ++i) differ += grad_w[i] != to_bf16(grad_w_f32[i] * scale);
  std::printf("grad_w[0] %.6g: %lld of %zu elements differ from the f32 sum rounded once\n", from_bf16(grad_w[0]),
              (long long)differ, grad_w.size());
  return differ * 100 <= int64_t(grad_w.size()) ? 0 : 1;  // the two f32 sums may straddle a rounding
}
