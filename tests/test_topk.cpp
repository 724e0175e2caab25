// Teacher top-k against the reference: from logits and through the head, renormalised or with
// the tail mass, ties at the boundary going to the lower id, on every dtype and device.
#include <string>

#include "harness.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::test {
namespace {

class Topk : public DeviceDtypeTest {
 protected:
  TopkSetup setup() const {
    TopkSetup s;
    s.device = device();
    s.dtype = dtype();
    return s;
  }
  // Scaled logits are formed in the compute dtype: near-ties within its rounding may swap.
  double id_tolerance() const { return tolerance(compute_dtype(dtype())); }

  void check(const reference::Problem& p, const lmloss_topk_options& o, TopkSetup s,
             double id_tol) {
    TopkCase c(p, o, s);
    ASSERT_EQ(c.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_topk_matches_reference(c, id_tol);
  }

  lmloss::Context ctx;
};

struct Scaling {
  const char* name;
  double softcap;
  double temperature;
};
constexpr Scaling scalings[] = {{"plain", 0.0, 1.0}, {"softcap_temperature", 6.0, 1.7}, {"temperature", 0.0, 1.7}};

TEST_P(Topk, FromLogits) {
  Generator gen(201);
  for (const int64_t k : {1, 5, 64}) {
    // A tie straddling the k-th place: the lower id must win it.
    const reference::Problem p = gen.problem({.n_tokens = 9, .vocab = 1031, .tie_rank = k});
    for (const Scaling& sc : scalings) {
      for (const int renormalize : {1, 0}) {
        SCOPED_TRACE(cat("k ", k, ", ", sc.name, ", renormalize ", renormalize));
        lmloss_topk_options o = lmloss_topk_options_default();
        o.k = k;
        o.softcap = sc.softcap;
        o.temperature = sc.temperature;
        o.renormalize = renormalize;
        check(p, o, setup(), id_tolerance());
      }
    }
  }
}

TEST_P(Topk, ExactTiesGoToTheLowerId) {
  // Unscaled logits are compared as stored, so every tie is exact and the ids must match the
  // reference exactly; 16-bit dtypes add many ties of their own.
  Generator gen(202);
  for (const int64_t k : {1, 3, 17}) {
    SCOPED_TRACE(cat("k ", k));
    ProblemSpec spec{.n_tokens = 16, .vocab = 769, .tie_rank = k};
    spec.logit_scale = 0.5;
    lmloss_topk_options o = lmloss_topk_options_default();
    o.k = k;
    check(gen.problem(spec), o, setup(), 0.0);
  }
}

TEST_P(Topk, ThroughTheHead) {
  Generator gen(203);
  const reference::Problem p =
      gen.problem({.n_tokens = 10, .vocab = 517, .hidden = 24, .bias = true, .labels = false});
  for (const int64_t k : {1, 8}) {
    for (const Scaling& sc : scalings) {
      for (const int renormalize : {1, 0}) {
        SCOPED_TRACE(cat("k ", k, ", ", sc.name, ", renormalize ", renormalize));
        lmloss_topk_options o = lmloss_topk_options_default();
        o.k = k;
        o.softcap = sc.softcap;
        o.temperature = sc.temperature;
        o.renormalize = renormalize;
        // Logits formed by a product: their error follows the input dtype.
        check(p, o, setup(), tolerance(dtype(), compute_dtype(dtype())));
      }
    }
  }
}

TEST_P(Topk, WithoutTail) {
  Generator gen(204);
  TopkSetup s = setup();
  s.want_tail = false;
  lmloss_topk_options o = lmloss_topk_options_default();
  o.k = 4;
  o.renormalize = 0;
  check(gen.problem({.n_tokens = 5, .vocab = 300}), o, s, id_tolerance());
}

INSTANTIATE_TEST_SUITE_P(, Topk,
                         ::testing::Combine(all_devices,
                                            ::testing::Values(LMLOSS_F64, LMLOSS_F32, LMLOSS_BF16,
                                                              LMLOSS_F16)),
                         ParamName{});

}  // namespace
}  // namespace lmloss::test
