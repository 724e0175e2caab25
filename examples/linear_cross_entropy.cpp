// A complete lmloss call from C++: the mean cross-entropy of 4 tokens over a 10-entry vocabulary,
// from hidden states and the head's weight, with the gradients of both, without the logits.
#include <cmath>
#include <cstdio>
#include <vector>

#include "lmloss/lmloss.hpp"

int main() {
  const int64_t n_tokens = 4, hidden = 8, vocab = 10;
  std::vector<float> x(n_tokens * hidden), w(vocab * hidden);  // (n_tokens, hidden), (vocab, hidden)
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * float(i));
  for (size_t i = 0; i < w.size(); ++i) w[i] = std::cos(0.11f * float(i));
  std::vector<int64_t> labels = {3, 7, -100, 1};  // -100: ignored, as in PyTorch

  std::vector<float> grad_x(x.size()), grad_w(w.size());
  float loss = 0;
  try {
    lmloss::Context ctx;  // CPU tensors: runs on the CPU backend
    using lmloss::Tensor;
    lmloss::linear_cross_entropy(
        ctx, {Tensor::matrix(x.data(), n_tokens, hidden), Tensor::matrix(w.data(), vocab, hidden)},
        Tensor::vector(labels.data(), n_tokens), lmloss::LossOptions{}, Tensor::scalar(&loss),
        Tensor{}, {Tensor::matrix(grad_x.data(), n_tokens, hidden), Tensor::matrix(grad_w.data(), vocab, hidden)});
  } catch (const lmloss::Error& e) {
    std::fprintf(stderr, "lmloss: %s\n", e.what());
    return 1;
  }
  std::printf("loss %.6f  grad_x[0] %.6f  grad_w[0] %.6f\n", loss, grad_x[0], grad_w[0]);
  // The ignored token gets no gradient.
  for (int64_t h = 0; h < hidden; ++h)
    if (grad_x[2 * hidden + h] != 0.0f) return 1;
  return std::isfinite(loss) && loss > 0 ? 0 : 1;
}
