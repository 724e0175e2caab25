// Every loss operation (forward with lse, backward from that lse, fused forward+backward) against
// the float64 reference, for logits and linear heads, cross-entropy and top-k distillation, on
// every input dtype, gradient dtype, label dtype and option, on every device.
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "harness.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::test {
namespace {

struct NamedOptions {
  std::string name;
  lmloss_loss_options options;
  std::vector<double> upstream;  // grad_loss; empty: absent
};

// The option sets every operation runs under. `n_tokens` sizes the per-token upstream.
std::vector<NamedOptions> option_sets(Generator& gen, int64_t n_tokens) {
  std::vector<NamedOptions> sets;
  auto add = [&](std::string name, auto&& edit, std::vector<double> upstream = {}) {
    lmloss_loss_options o = lmloss_loss_options_default();
    edit(o);
    sets.push_back({std::move(name), o, std::move(upstream)});
  };
  add("mean", [](lmloss_loss_options&) {});
  add("smoothing_zloss", [](lmloss_loss_options& o) {
    o.label_smoothing = 0.1;
    o.z_loss = 1e-2;
  });
  add("softcap_temperature", [](lmloss_loss_options& o) {
    o.softcap = 5.0;
    o.temperature = 1.5;
  });
  add("temperature", [](lmloss_loss_options& o) { o.temperature = 1.7; });  // without soft-capping
  add("sum_upstream", [](lmloss_loss_options& o) { o.reduction = LMLOSS_REDUCTION_SUM; }, {0.7});
  add("sum_ignores_normalizer", [](lmloss_loss_options& o) {  // sum: D = 1 whatever is set
    o.reduction = LMLOSS_REDUCTION_SUM;
    o.normalizer = 3;
  });
  add("none_upstream", [](lmloss_loss_options& o) { o.reduction = LMLOSS_REDUCTION_NONE; },
      gen.uniform(n_tokens, -1.5, 1.5));
  add("normalizer", [&](lmloss_loss_options& o) { o.normalizer = 2.5 * n_tokens; });
  add("ignore_index_7", [](lmloss_loss_options& o) { o.ignore_index = 7; });
  add("everything", [](lmloss_loss_options& o) {
    o.label_smoothing = 0.05;
    o.z_loss = 1e-3;
    o.softcap = 8.0;
    o.temperature = 0.8;
    o.normalizer = 20;
  }, {1.3});
  return sets;
}

// Gradient dtypes the contract allows: grad_logits has the logits' dtype; a linear head's
// gradients are the input's dtype or f32 (f64 inputs: f64 only).
std::vector<lmloss_dtype> grad_dtypes(lmloss_dtype input, bool linear) {
  if (!linear || input == LMLOSS_F32 || input == LMLOSS_F64) return {input};
  return {LMLOSS_F32, input};
}

class Loss : public DeviceDtypeTest {
 protected:
  // Forward (saving lse), backward from that lse, then the fused call, each checked.
  void check_every_mode(const reference::Problem& problem, const lmloss_loss_options& options,
                        const LossSetup& setup) {
    LossCase c(problem, options, setup);
    ASSERT_EQ(c.forward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    {
      SCOPED_TRACE("forward");
      expect_matches_reference(c, Mode::forward);
    }
    ASSERT_EQ(c.backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    {
      SCOPED_TRACE("backward from the forward's lse");
      expect_matches_reference(c, Mode::backward);
    }
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    {
      SCOPED_TRACE("forward_backward");
      expect_matches_reference(c, Mode::forward_backward);
    }
  }

  LossSetup base_setup() const {
    LossSetup s;
    s.device = device();
    s.dtype = dtype();
    return s;
  }

  lmloss::Context ctx;
};

std::string trace(const std::string& options, lmloss_dtype grad, lmloss_dtype ids) {
  return cat("options ", options, ", grad ", dtype_name(grad), ", ids ", dtype_name(ids));
}

TEST_P(Loss, LogitsCrossEntropy) {
  Generator gen(101);
  const int64_t n = 9;
  for (const NamedOptions& set : option_sets(gen, n)) {
    ProblemSpec spec{.n_tokens = n, .vocab = 1031};
    spec.ignore_index = set.options.ignore_index;
    const reference::Problem p = gen.problem(spec);
    for (lmloss_dtype grad : grad_dtypes(dtype(), false)) {
      for (lmloss_dtype label : {LMLOSS_I32, LMLOSS_I64}) {
        SCOPED_TRACE(trace(set.name, grad, label));
        LossSetup s = base_setup();
        s.grad_dtype = grad;
        s.label_dtype = label;
        s.upstream = set.upstream;
        check_every_mode(p, set.options, s);
      }
    }
  }
}

TEST_P(Loss, LogitsCrossEntropyInPlace) {
  Generator gen(102);
  const int64_t n = 7;
  for (const NamedOptions& set : option_sets(gen, n)) {
    SCOPED_TRACE(cat("options ", set.name));
    ProblemSpec spec{.n_tokens = n, .vocab = 523};
    spec.ignore_index = set.options.ignore_index;
    LossSetup s = base_setup();
    s.grad_dtype = dtype();
    s.in_place = true;  // grad_logits.data == logits.data
    s.upstream = set.upstream;
    check_every_mode(gen.problem(spec), set.options, s);
  }
}

TEST_P(Loss, LinearCrossEntropy) {
  Generator gen(103);
  const int64_t n = 12;
  for (const NamedOptions& set : option_sets(gen, n)) {
    for (const bool with_bias : {true, false}) {
      ProblemSpec spec{.n_tokens = n, .vocab = 517, .hidden = 24, .bias = with_bias};
      spec.ignore_index = set.options.ignore_index;
      const reference::Problem p = gen.problem(spec);
      for (lmloss_dtype grad : grad_dtypes(dtype(), true)) {
        for (lmloss_dtype label : {LMLOSS_I32, LMLOSS_I64}) {
          SCOPED_TRACE(trace(set.name, grad, label) + (with_bias ? ", bias" : ", no bias"));
          LossSetup s = base_setup();
          s.grad_dtype = grad;
          s.label_dtype = label;
          s.upstream = set.upstream;
          check_every_mode(p, set.options, s);
        }
      }
    }
  }
}

TEST_P(Loss, LinearCrossEntropyAccumulates) {
  Generator gen(104);
  ProblemSpec spec{.n_tokens = 10, .vocab = 301, .hidden = 16, .bias = true};
  const reference::Problem p = gen.problem(spec);
  for (lmloss_dtype grad : grad_dtypes(dtype(), true)) {
    for (uint32_t flags : {LMLOSS_ACCUMULATE_GRAD_WEIGHT, LMLOSS_ACCUMULATE_GRAD_BIAS,
                           LMLOSS_ACCUMULATE_GRAD_WEIGHT | LMLOSS_ACCUMULATE_GRAD_BIAS,
                           LMLOSS_ACCUMULATE_GRAD_WEIGHT | LMLOSS_SUM_GRAD_WEIGHT_IN_F32}) {
      SCOPED_TRACE(cat("grad ", dtype_name(grad), ", flags ", flags));
      lmloss_loss_options o = lmloss_loss_options_default();
      o.flags = flags;
      o.z_loss = 1e-3;
      // Old gradients of the same size as the new ones: a dropped or doubled term shows.
      const reference::LossResult ref = reference::loss(rounded(p, dtype()), o);
      const double w_scale = std::sqrt(std::inner_product(ref.grad_weight.begin(),
                                                          ref.grad_weight.end(),
                                                          ref.grad_weight.begin(), 0.0) /
                                       static_cast<double>(ref.grad_weight.size()));
      LossSetup s = base_setup();
      s.grad_dtype = grad;
      s.grad_weight_initial = gen.normal(p.vocab * p.hidden, w_scale);
      s.grad_bias_initial = gen.normal(p.vocab, w_scale);
      check_every_mode(p, o, s);
    }
  }
}

lmloss_loss_options distill_options(double alpha, double beta) {
  lmloss_loss_options o = lmloss_loss_options_default();
  o.ce_weight = alpha;
  o.kd_weight = beta;
  return o;
}

// Distillation option sets: mixed with CE, with the shared scaling and reductions.
std::vector<NamedOptions> distill_sets(Generator& gen, int64_t n, bool labels) {
  const double alpha = labels ? 0.4 : 0.0;
  std::vector<NamedOptions> sets;
  sets.push_back({"mean", distill_options(alpha, 0.9), {}});
  NamedOptions t{"softcap_temperature_zloss", distill_options(alpha, 1.0), {0.5}};
  t.options.softcap = 6.0;
  t.options.temperature = 2.0;
  t.options.z_loss = 1e-2;
  sets.push_back(t);
  NamedOptions temperature{"temperature", distill_options(alpha, 0.8), {}};  // without soft-capping
  temperature.options.temperature = 2.5;
  sets.push_back(temperature);
  NamedOptions none{"none_upstream", distill_options(alpha, 0.7), gen.uniform(n, -1, 1)};
  none.options.reduction = LMLOSS_REDUCTION_NONE;
  sets.push_back(none);
  NamedOptions sum{"sum_smoothing", distill_options(alpha, 0.6), {}};
  sum.options.reduction = LMLOSS_REDUCTION_SUM;
  sum.options.label_smoothing = labels ? 0.1 : 0.0;
  sets.push_back(sum);
  return sets;
}

// Every other token's label becomes one of its teacher ids: both sparse corrections then land
// on the same logit.
void overlap_teacher_and_labels(reference::Problem& p) {
  const int64_t K = p.top_k;
  for (int64_t t = 0; t < p.n_tokens; t += 2) {
    const int64_t y = p.labels[t];
    if (y < 0) continue;
    bool present = false;
    for (int64_t k = 0; k < K; ++k) present |= p.teacher_ids[t * K + k] == y;
    if (!present) p.teacher_ids[t * K + (t / 2) % K] = y;
  }
}

TEST_P(Loss, LinearDistillWithLabels) {
  Generator gen(105);
  const int64_t n = 11;
  for (const NamedOptions& set : distill_sets(gen, n, true)) {
    for (const bool unnormalized : {false, true}) {
      ProblemSpec spec{.n_tokens = n, .vocab = 389, .hidden = 20, .bias = true};
      spec.top_k = 5;
      spec.teacher_unnormalized = unnormalized;
      spec.mask = true;
      reference::Problem p = gen.problem(spec);
      overlap_teacher_and_labels(p);
      for (lmloss_dtype grad : grad_dtypes(dtype(), true)) {
        for (lmloss_dtype ids : {LMLOSS_I32, LMLOSS_I64}) {
          SCOPED_TRACE(trace(set.name, grad, ids) + (unnormalized ? ", unnormalized" : ""));
          LossSetup s = base_setup();
          s.grad_dtype = grad;
          s.label_dtype = ids;
          s.teacher_id_dtype = ids;
          s.upstream = set.upstream;
          check_every_mode(p, set.options, s);
        }
      }
    }
  }
}

TEST_P(Loss, LinearDistillWithoutLabels) {
  Generator gen(106);
  const int64_t n = 11;
  for (const NamedOptions& set : distill_sets(gen, n, false)) {
    ProblemSpec spec{.n_tokens = n, .vocab = 389, .hidden = 20};
    spec.labels = false;
    spec.top_k = 4;
    spec.mask = true;
    const reference::Problem p = gen.problem(spec);
    for (lmloss_dtype grad : grad_dtypes(dtype(), true)) {
      for (lmloss_dtype ids : {LMLOSS_I32, LMLOSS_I64}) {
        SCOPED_TRACE(trace(set.name, grad, ids));
        LossSetup s = base_setup();
        s.grad_dtype = grad;
        s.teacher_id_dtype = ids;
        s.upstream = set.upstream;
        check_every_mode(p, set.options, s);
      }
    }
  }
}

TEST_P(Loss, LogitsDistill) {
  Generator gen(107);
  const int64_t n = 9;
  for (const bool labels : {true, false}) {
    for (const NamedOptions& set : distill_sets(gen, n, labels)) {
      ProblemSpec spec{.n_tokens = n, .vocab = 1031};
      spec.labels = labels;
      spec.top_k = 8;
      spec.mask = !labels;
      reference::Problem p = gen.problem(spec);
      if (labels) overlap_teacher_and_labels(p);
      for (lmloss_dtype grad : grad_dtypes(dtype(), false)) {
        SCOPED_TRACE(trace(set.name, grad, LMLOSS_I32) + (labels ? ", labels" : ", mask only"));
        LossSetup s = base_setup();
        s.grad_dtype = grad;
        s.upstream = set.upstream;
        check_every_mode(p, set.options, s);
      }
    }
  }
}

TEST_P(Loss, OptionalArgumentsMayBeNull) {
  // lse and grad_loss are optional: a NULL pointer means absent (grad_loss: 1).
  Generator gen(108);
  LossSetup s = base_setup();
  s.grad_dtype = dtype();
  s.want_lse = false;
  for (const int64_t hidden : {0, 12}) {
    SCOPED_TRACE(hidden ? "linear" : "logits");
    const reference::Problem p = gen.problem({.n_tokens = 8, .vocab = 211, .hidden = hidden});
    LossCase c(p, lmloss_loss_options_default(), s);
    const lmloss_head h = c.head();
    const lmloss_targets t = c.targets();
    const lmloss_grads g = c.grads();
    const lmloss_tensor loss = c.loss_tensor();
    ASSERT_EQ(c.invoke(ctx.get(), [&] {
      return lmloss_loss_forward(ctx.get(), &h, &t, &c.options, &loss, nullptr);
    }), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_matches_reference(c, Mode::forward);
    ASSERT_EQ(c.invoke(ctx.get(), [&] {
      return lmloss_loss_forward_backward(ctx.get(), &h, &t, &c.options, nullptr, &loss, nullptr,
                                          &g);
    }), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_matches_reference(c, Mode::forward_backward);
  }
}

INSTANTIATE_TEST_SUITE_P(, Loss,
                         ::testing::Combine(all_devices,
                                            ::testing::Values(LMLOSS_F64, LMLOSS_F32, LMLOSS_BF16,
                                                              LMLOSS_F16)),
                         ParamName{});

}  // namespace
}  // namespace lmloss::test
