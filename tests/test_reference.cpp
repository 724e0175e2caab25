// The reference checks itself: its gradients against central finite differences of its own
// loss with every option on, and its values against small cases worked by hand.
#include <cmath>
#include <functional>
#include <numeric>

#include "harness.hpp"

namespace lmloss::test {
namespace {

using reference::Problem;

// Finite differences of a smooth function agree with the analytic gradient to ~h^2 relative.
constexpr double fd_step = 1e-5;
constexpr double fd_tolerance = 1e-6;

// The scalar whose gradient the reference returns: sum_t g_t l_t for "none", g L otherwise.
double objective(const Problem& p, const lmloss_loss_options& o, const std::vector<double>& g) {
  const reference::LossResult r = reference::loss(p, o, g);
  if (o.reduction != LMLOSS_REDUCTION_NONE) return (g.empty() ? 1.0 : g[0]) * r.loss[0];
  double f = 0;
  for (size_t t = 0; t < r.loss.size(); ++t) f += (g.empty() ? 1.0 : g[t]) * r.loss[t];
  return f;
}

std::vector<double> numeric_gradient(Problem p, std::vector<double> Problem::*field,
                                     const lmloss_loss_options& o, const std::vector<double>& g) {
  std::vector<double> grad((p.*field).size());
  for (size_t i = 0; i < grad.size(); ++i) {
    const double x = (p.*field)[i];
    (p.*field)[i] = x + fd_step;
    const double up = objective(p, o, g);
    (p.*field)[i] = x - fd_step;
    const double down = objective(p, o, g);
    (p.*field)[i] = x;
    grad[i] = (up - down) / (2 * fd_step);
  }
  return grad;
}

lmloss_loss_options every_option(lmloss_reduction reduction) {
  lmloss_loss_options o = lmloss_loss_options_default();
  o.reduction = reduction;
  o.ce_weight = 0.6;
  o.kd_weight = 0.8;
  o.label_smoothing = 0.1;
  o.z_loss = 0.01;
  o.softcap = 4.0;
  o.temperature = 1.7;
  return o;
}

ProblemSpec every_input(int64_t hidden) {
  ProblemSpec spec;
  spec.n_tokens = 6;
  spec.vocab = 11;
  spec.hidden = hidden;
  spec.bias = hidden > 0;
  spec.ignore_fraction = 0.3;
  spec.top_k = 3;
  spec.teacher_unnormalized = true;  // the general sum_k P_k form, and a P = 0 entry
  spec.mask = true;
  spec.logit_scale = 1.0;  // outliers stay, but tanh is not saturated everywhere
  return spec;
}

struct Reduction {
  const char* name;
  lmloss_reduction reduction;
  double normalizer;
};

class ReferenceGradient : public ::testing::TestWithParam<int> {};

TEST_P(ReferenceGradient, MatchesFiniteDifferences) {
  const Reduction reductions[] = {{"mean", LMLOSS_REDUCTION_MEAN, 0},
                                  {"mean_normalizer", LMLOSS_REDUCTION_MEAN, 9.5},
                                  {"sum", LMLOSS_REDUCTION_SUM, 0},
                                  {"none", LMLOSS_REDUCTION_NONE, 0}};
  Generator gen(GetParam());
  for (const bool linear : {false, true}) {
    const Problem p = gen.problem(every_input(linear ? 4 : 0));
    for (const Reduction& r : reductions) {
      SCOPED_TRACE(std::string(linear ? "linear " : "logits ") + r.name);
      lmloss_loss_options o = every_option(r.reduction);
      o.normalizer = r.normalizer;
      const std::vector<double> g =
          r.reduction == LMLOSS_REDUCTION_NONE ? gen.uniform(p.n_tokens, -2, 2)
                                               : std::vector<double>{1.3};
      const reference::LossResult res = reference::loss(p, o, g);
      if (!linear) {
        EXPECT_TRUE(close_to(res.grad_logits, numeric_gradient(p, &Problem::logits, o, g),
                             fd_tolerance));
        continue;
      }
      EXPECT_TRUE(close_to(res.grad_hidden, numeric_gradient(p, &Problem::hidden_states, o, g),
                           fd_tolerance));
      EXPECT_TRUE(close_to(res.grad_weight, numeric_gradient(p, &Problem::weight, o, g),
                           fd_tolerance));
      EXPECT_TRUE(close_to(res.grad_bias, numeric_gradient(p, &Problem::bias, o, g),
                           fd_tolerance));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, ReferenceGradient, ::testing::Values(1, 2, 3));

Problem logits_problem(int64_t n, int64_t vocab, std::vector<double> z,
                       std::vector<int64_t> labels) {
  Problem p;
  p.n_tokens = n;
  p.vocab = vocab;
  p.logits = std::move(z);
  p.labels = std::move(labels);
  return p;
}

TEST(ReferenceByHand, UniformLogitsGiveLogV) {
  const int64_t V = 7;
  const Problem p = logits_problem(2, V, std::vector<double>(2 * V, 0.25), {3, 5});
  lmloss_loss_options o = lmloss_loss_options_default();
  const reference::LossResult r = reference::loss(p, o);
  EXPECT_NEAR(r.lse[0], std::log(V) + 0.25, 1e-15);
  EXPECT_NEAR(r.loss[0], std::log(V), 1e-15);
  // dL/dz = (1/V - [j = y]) / N
  EXPECT_NEAR(r.grad_logits[0], (1.0 / V) / 2, 1e-16);
  EXPECT_NEAR(r.grad_logits[3], (1.0 / V - 1) / 2, 1e-16);
  // Label smoothing moves nothing when every logit is equal: s_y = mean(s).
  o.label_smoothing = 0.3;
  EXPECT_NEAR(reference::loss(p, o).loss[0], std::log(V), 1e-14);
}

TEST(ReferenceByHand, TwoClasses) {
  // p = (1/4, 3/4): ce = -log(3/4) for label 1, -log(1/4) for label 0.
  const Problem p = logits_problem(2, 2, {0, std::log(3.0), 0, std::log(3.0)}, {1, 0});
  lmloss_loss_options o = lmloss_loss_options_default();
  o.reduction = LMLOSS_REDUCTION_NONE;
  const reference::LossResult r = reference::loss(p, o);
  EXPECT_NEAR(r.loss[0], std::log(4.0 / 3.0), 1e-15);
  EXPECT_NEAR(r.loss[1], std::log(4.0), 1e-15);
  EXPECT_NEAR(r.lse[0], std::log(4.0), 1e-15);
  EXPECT_NEAR(r.grad_logits[0], 0.25, 1e-15);
  EXPECT_NEAR(r.grad_logits[1], -0.25, 1e-15);
  EXPECT_NEAR(r.grad_logits[2], 0.25 - 1, 1e-15);
  o.reduction = LMLOSS_REDUCTION_SUM;
  EXPECT_NEAR(reference::loss(p, o).loss[0], std::log(16.0 / 3.0), 1e-15);
  o.reduction = LMLOSS_REDUCTION_MEAN;
  o.normalizer = 8;
  EXPECT_NEAR(reference::loss(p, o).loss[0], std::log(16.0 / 3.0) / 8, 1e-15);
}

TEST(ReferenceByHand, ZLossTemperatureSoftcap) {
  const Problem p = logits_problem(1, 2, {0, std::log(3.0)}, {1});
  lmloss_loss_options o = lmloss_loss_options_default();
  o.ce_weight = 0;
  o.z_loss = 0.5;
  EXPECT_NEAR(reference::loss(p, o).loss[0], 0.5 * std::log(4.0) * std::log(4.0), 1e-15);
  // Temperature 2 halves the logits: lse = log(1 + sqrt 3).
  o.temperature = 2;
  EXPECT_NEAR(reference::loss(p, o).lse[0], std::log(1 + std::sqrt(3.0)), 1e-15);
  // Soft-capping at c: s = c tanh(z / c).
  o.temperature = 1;
  o.softcap = 0.5;
  const double s1 = 0.5 * std::tanh(std::log(3.0) / 0.5);
  EXPECT_NEAR(reference::loss(p, o).lse[0], std::log(1 + std::exp(s1)), 1e-15);
}

TEST(ReferenceByHand, DistillationAgainstItsOwnDistributionIsZero) {
  // A teacher holding the student's full distribution: KL = 0 and a zero gradient.
  const std::vector<double> z = {0.3, -1.2, 2.0};
  Problem p = logits_problem(1, 3, z, {});
  const double lse = std::log(std::exp(0.3) + std::exp(-1.2) + std::exp(2.0));
  p.top_k = 3;
  p.teacher_ids = {2, 0, 1};
  p.teacher_probs = {std::exp(2.0 - lse), std::exp(0.3 - lse), std::exp(-1.2 - lse)};
  lmloss_loss_options o = lmloss_loss_options_default();
  o.ce_weight = 0;
  o.kd_weight = 1;
  const reference::LossResult r = reference::loss(p, o);
  EXPECT_NEAR(r.loss[0], 0, 1e-15);
  for (double g : r.grad_logits) EXPECT_NEAR(g, 0, 1e-15);
  // One entry at probability 0 contributes nothing to the loss.
  p.teacher_probs = {1.0, 0.0, 0.0};
  EXPECT_NEAR(reference::loss(p, o).loss[0], -(2.0 - lse), 1e-15);
}

TEST(ReferenceByHand, NothingCountedGivesZero) {
  Problem p = logits_problem(2, 3, {1, 2, 3, 4, 5, 6}, {-100, -100});
  for (lmloss_reduction red : {LMLOSS_REDUCTION_MEAN, LMLOSS_REDUCTION_SUM}) {
    lmloss_loss_options o = lmloss_loss_options_default();
    o.reduction = red;
    const reference::LossResult r = reference::loss(p, o);
    EXPECT_EQ(r.loss[0], 0.0);
    for (double g : r.grad_logits) EXPECT_EQ(g, 0.0);
  }
  // A mask excludes a token the same way.
  p.labels = {1, 2};
  p.token_mask = {0, 1};
  lmloss_loss_options o = lmloss_loss_options_default();
  o.reduction = LMLOSS_REDUCTION_NONE;
  const reference::LossResult r = reference::loss(p, o);
  EXPECT_EQ(r.loss[0], 0.0);
  EXPECT_GT(r.loss[1], 0.0);
}

TEST(ReferenceByHand, TopkTiesGoToTheLowerId) {
  Problem p = logits_problem(1, 4, {1, 3, 3, 2}, {});
  lmloss_topk_options o = lmloss_topk_options_default();
  o.k = 2;
  reference::TopkResult r = reference::topk(p, o);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(r.probs[0], 0.5, 1e-15);
  EXPECT_EQ(r.tail[0], 0.0);
  o.renormalize = 0;
  o.k = 3;
  r = reference::topk(p, o);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2, 3}));
  const double total = std::exp(1.0) + 2 * std::exp(3.0) + std::exp(2.0);
  EXPECT_NEAR(r.probs[0], std::exp(3.0) / total, 1e-15);
  EXPECT_NEAR(r.probs[2], std::exp(2.0) / total, 1e-15);
  EXPECT_NEAR(r.tail[0], std::exp(1.0) / total, 1e-15);
}

TEST(ReferenceByHand, LinearLogits) {
  Problem p;
  p.n_tokens = 1;
  p.vocab = 2;
  p.hidden = 2;
  p.hidden_states = {1, 2};
  p.weight = {3, 4, -1, 0.5};
  p.bias = {0.5, -0.5};
  EXPECT_EQ(reference::logits(p), (std::vector<double>{11.5, -0.5}));
}

TEST(ReferenceByHand, RelativeError) {
  EXPECT_EQ(reference::relative_error({3, 4}, {3, 4}), 0.0);
  EXPECT_NEAR(reference::relative_error({3, 5}, {3, 4}), 0.2, 1e-15);
  EXPECT_EQ(reference::relative_error({0, 2}, {0, 0}), 2.0);  // absolute when ref is zero
  EXPECT_TRUE(std::isnan(reference::relative_error({NAN, 0}, {1, 1})));
}

TEST(Harness, RoundingMatchesTheFormats) {
  EXPECT_EQ(round_to(LMLOSS_BF16, 1.0 + 1.0 / 256), 1.0);         // halfway: to even
  EXPECT_EQ(round_to(LMLOSS_BF16, 1.0 + 3.0 / 256), 1.0 + 4.0 / 256);
  EXPECT_EQ(round_to(LMLOSS_F16, 1.0 + 1.0 / 2048), 1.0);
  EXPECT_EQ(round_to(LMLOSS_F16, 65504.0), 65504.0);
  EXPECT_TRUE(std::isinf(round_to(LMLOSS_F16, 65520.0)));
  EXPECT_EQ(round_to(LMLOSS_F16, std::ldexp(3.0, -24)), std::ldexp(3.0, -24));  // subnormal
  EXPECT_EQ(round_to(LMLOSS_F16, std::ldexp(1.0, -26)), 0.0);
  EXPECT_EQ(round_to(LMLOSS_F32, 0.1), static_cast<double>(0.1f));
}

TEST(Harness, PoisonIsCaught) {
  Buffer b(Device::cpu, LMLOSS_BF16, 2, 2, 3, 5);
  b.poison();
  EXPECT_EQ(b.unwritten(), 6);
  b.set(4, 1.5);
  EXPECT_EQ(b.unwritten(), 5);
  EXPECT_EQ(b.get(4), 1.5);
  EXPECT_TRUE(b.padding_untouched());
  EXPECT_FALSE(b.untouched());
}

}  // namespace
}  // namespace lmloss::test
