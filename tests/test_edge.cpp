// Edge cases against the reference: one token, vocabularies of 50257 and 128256, k = 1, V - 1 and
// V, nothing counted, huge, infinite and NaN logits, strided rows and vectors, and chunking forced
// by a small budget.
#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "harness.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::test {
namespace {

class Edge : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { LMLOSS_REQUIRE_DEVICE(GetParam()); }
  LossSetup setup(lmloss_dtype dtype = LMLOSS_F32) const {
    LossSetup s;
    s.device = GetParam();
    s.dtype = dtype;
    s.grad_dtype = dtype;
    return s;
  }
  TopkSetup topk_setup(lmloss_dtype dtype = LMLOSS_F32) const {
    TopkSetup s;
    s.device = GetParam();
    s.dtype = dtype;
    return s;
  }
  void check_every_mode(const reference::Problem& p, const lmloss_loss_options& o,
                        const LossSetup& s) {
    LossCase c(p, o, s);
    for (Mode mode : {Mode::forward, Mode::backward, Mode::forward_backward}) {
      SCOPED_TRACE(mode == Mode::forward ? "forward" : mode == Mode::backward ? "backward" : "fused");
      ASSERT_EQ(c.run(ctx.get(), mode), LMLOSS_SUCCESS) << lmloss_last_error();
      expect_matches_reference(c, mode);
    }
  }
  lmloss::Context ctx;
};

lmloss_loss_options some_options() {
  lmloss_loss_options o = lmloss_loss_options_default();
  o.label_smoothing = 0.1;
  o.z_loss = 1e-3;
  o.softcap = 10;
  return o;
}

TEST_P(Edge, OneToken) {
  Generator gen(301);
  for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    ProblemSpec spec{.n_tokens = 1, .vocab = 1031};
    check_every_mode(gen.problem(spec), some_options(), setup(dtype));
    spec.hidden = 16;
    spec.bias = true;
    check_every_mode(gen.problem(spec), some_options(), setup(dtype));
  }
}

TEST_P(Edge, OddVocabulary50257) {
  Generator gen(302);
  for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    check_every_mode(gen.problem({.n_tokens = 8, .vocab = 50257}), some_options(), setup(dtype));
    check_every_mode(gen.problem({.n_tokens = 4, .vocab = 50257, .hidden = 8, .bias = true}),
                     some_options(), setup(dtype));
  }
  lmloss_topk_options o = lmloss_topk_options_default();
  o.k = 20;
  o.renormalize = 0;
  TopkCase c(gen.problem({.n_tokens = 3, .vocab = 50257, .tie_rank = 20}), o, topk_setup());
  ASSERT_EQ(c.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  expect_topk_matches_reference(c, tolerance(LMLOSS_F32));
}

TEST_P(Edge, LargeVocabulary128256) {
  // A current tokenizer's vocabulary: long rows are where f32 sums lose accuracy.
  Generator gen(310);
  lmloss_loss_options o = lmloss_loss_options_default();
  check_every_mode(gen.problem({.n_tokens = 6, .vocab = 128256}), o, setup());
  lmloss_topk_options t = lmloss_topk_options_default();
  t.k = 8;
  t.renormalize = 0;
  TopkCase c(gen.problem({.n_tokens = 4, .vocab = 128256}), t, topk_setup());
  ASSERT_EQ(c.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  expect_topk_matches_reference(c, tolerance(LMLOSS_F32));
}

TEST_P(Edge, TopkOfOneAndOfTheWholeVocabulary) {
  Generator gen(303);
  const int64_t V = 97;
  reference::Problem p = gen.problem({.n_tokens = 6, .vocab = V, .tie_rank = 1});
  p.logits[V - 1] = 50;  // the last id the largest: k = V - 1 must still look at it
  for (const int64_t k : {int64_t{1}, V - 1, V}) {
    for (const int renormalize : {1, 0}) {
      SCOPED_TRACE(cat("k ", k, ", renormalize ", renormalize));
      lmloss_topk_options o = lmloss_topk_options_default();
      o.k = k;
      o.renormalize = renormalize;
      TopkCase c(p, o, topk_setup());
      ASSERT_EQ(c.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      expect_topk_matches_reference(c, 0.0);  // unscaled f32 logits: exact ids
    }
  }
}

TEST_P(Edge, NothingCountedGivesExactZeros) {
  Generator gen(304);
  reference::Problem p = gen.problem({.n_tokens = 5, .vocab = 211, .hidden = 8, .bias = true});
  for (int64_t& y : p.labels) y = -100;
  for (const lmloss_reduction reduction :
       {LMLOSS_REDUCTION_MEAN, LMLOSS_REDUCTION_SUM, LMLOSS_REDUCTION_NONE}) {
    for (const double normalizer : {0.0, 7.0}) {
      SCOPED_TRACE(cat("reduction ", reduction, ", normalizer ", normalizer));
      lmloss_loss_options o = some_options();
      o.reduction = reduction;
      o.normalizer = normalizer;
      LossCase c(p, o, setup());
      ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      for (double l : c.loss.values()) EXPECT_EQ(l, 0.0);  // not NaN from 0 / 0
      for (const Buffer* g : {&c.grad_hidden, &c.grad_weight, &c.grad_bias}) {
        EXPECT_TRUE(fully_written(*g));
        for (double x : g->values()) ASSERT_EQ(x, 0.0);
      }
    }
  }
  // Distillation with every token masked out.
  reference::Problem d = gen.problem({.n_tokens = 4, .vocab = 211, .labels = false, .top_k = 3,
                                      .mask = true});
  for (uint8_t& m : d.token_mask) m = 0;
  lmloss_loss_options o = lmloss_loss_options_default();
  o.ce_weight = 0;
  o.kd_weight = 1;
  LossSetup s = setup();
  LossCase c(d, o, s);
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_EQ(c.loss.get(0), 0.0);
  for (double x : c.grad_logits.values()) ASSERT_EQ(x, 0.0);
}

// A call over no tokens (an empty batch) computes nothing and succeeds: a reduced loss is 0, as
// when nothing is counted, the weight and bias gradients 0 (their poison overwritten) unless added
// to, a kept f32 sum 0 and rounded to 0, and top-k and the gradient scaling have no rows to write.
// Empty tensors still take a non-null address (a null one means absent), here one nothing reads.
TEST_P(Edge, NoTokens) {
  const int64_t vocab = 40, hidden = 8;
  Generator gen(305);
  const reference::Problem p = gen.problem({.n_tokens = 1, .vocab = vocab, .hidden = hidden, .bias = true});
  for (const lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    Buffer w = Buffer::of_values(GetParam(), dtype, p.weight, 2, vocab, hidden);
    Buffer b = Buffer::of_values(GetParam(), dtype, p.bias, 1, vocab);
    w.upload();
    b.upload();
    // An empty tensor: rows of nothing at an address nothing reads.
    auto empty = [&](lmloss_dtype dt, int ndim, int64_t cols = 0) {
      lmloss_tensor t = w.tensor();
      t.dtype = dt;
      t.ndim = ndim;
      t.shape[0] = 0;
      t.shape[1] = ndim == 2 ? cols : 0;
      t.stride = 0;
      return t;
    };
    const lmloss_dtype compute = compute_dtype(dtype);
    const lmloss_head head{lmloss_tensor_none(), empty(dtype, 2, hidden), w.tensor(), b.tensor()};
    const lmloss_targets targets{empty(LMLOSS_I64, 1), lmloss_tensor_none(), lmloss_tensor_none(), lmloss_tensor_none()};
    for (const lmloss_reduction reduction : {LMLOSS_REDUCTION_MEAN, LMLOSS_REDUCTION_SUM, LMLOSS_REDUCTION_NONE}) {
      // Each accumulate flag on its own too: the gradient it names is kept, the other zeroed.
      for (const uint32_t flags : {0u, LMLOSS_ACCUMULATE_GRAD_WEIGHT, LMLOSS_ACCUMULATE_GRAD_BIAS,
                               LMLOSS_ACCUMULATE_GRAD_WEIGHT | LMLOSS_ACCUMULATE_GRAD_BIAS}) {
        const bool keep_weight = flags & LMLOSS_ACCUMULATE_GRAD_WEIGHT;
        const bool keep_bias = flags & LMLOSS_ACCUMULATE_GRAD_BIAS;
        SCOPED_TRACE(cat(dtype_name(dtype), " reduction ", reduction, " accumulating weight ", keep_weight,
                         " bias ", keep_bias));
        lmloss_loss_options o = some_options();
        o.reduction = reduction;
        o.flags |= flags;
        Buffer loss(GetParam(), compute, 0, 1), gw(GetParam(), LMLOSS_F32, 2, vocab, hidden),
            gb(GetParam(), LMLOSS_F32, 1, vocab);
        const std::vector<double> initial(size_t(vocab * hidden), 0.25);
        for (Buffer* g : {&loss, &gw, &gb}) g->poison();
        gw.fill(initial);
        gb.fill(std::vector<double>(size_t(vocab), 0.5));
        for (Buffer* g : {&loss, &gw, &gb}) g->upload();
        const bool reduced = reduction != LMLOSS_REDUCTION_NONE;
        const lmloss_tensor loss_t = reduced ? loss.tensor() : empty(compute, 1), lse_t = empty(compute, 1);
        const lmloss_tensor grad_loss = reduced ? lmloss_tensor_none() : empty(compute, 1);
        const lmloss_grads grads{lmloss_tensor_none(), empty(dtype, 2, hidden), gw.tensor(), gb.tensor()};
        ASSERT_EQ(lmloss_loss_forward_backward(ctx.get(), &head, &targets, &o, &grad_loss, &loss_t, &lse_t, &grads),
                  LMLOSS_SUCCESS)
            << lmloss_last_error();
        ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS);
        for (Buffer* g : {&loss, &gw, &gb}) g->download();
        if (reduced) {
          EXPECT_EQ(loss.get(0), 0.0);
        }
        EXPECT_EQ(gw.values(), keep_weight ? initial : std::vector<double>(initial.size(), 0.0));
        EXPECT_EQ(gb.values(), std::vector<double>(size_t(vocab), keep_bias ? 0.5 : 0.0));
        ASSERT_EQ(lmloss_loss_forward(ctx.get(), &head, &targets, &o, &loss_t, &lse_t), LMLOSS_SUCCESS)
            << lmloss_last_error();
        ASSERT_EQ(lmloss_loss_backward(ctx.get(), &head, &targets, &o, &lse_t, &grad_loss, &grads), LMLOSS_SUCCESS)
            << lmloss_last_error();
      }
    }
    if (dtype == LMLOSS_BF16) {  // a kept f32 sum over no tokens, rounded
      const int64_t tail_rows = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(vocab);
      Buffer gw(GetParam(), dtype, 2, vocab, hidden), tail(GetParam(), LMLOSS_F32, 2, tail_rows, hidden);
      gw.poison();
      tail.poison();
      gw.upload();
      tail.upload();
      lmloss_loss_options o = some_options();
      o.grad_weight_sum_tail = tail.tensor();
      Buffer loss(GetParam(), LMLOSS_F32, 0, 1);
      const lmloss_tensor loss_t = loss.tensor(), lse_t = lmloss_tensor_none();
      const lmloss_grads grads{lmloss_tensor_none(), lmloss_tensor_none(), gw.tensor(), lmloss_tensor_none()};
      ASSERT_EQ(lmloss_loss_forward_backward(ctx.get(), &head, &targets, &o, nullptr, &loss_t, &lse_t, &grads),
                LMLOSS_SUCCESS)
          << lmloss_last_error();
      const lmloss_tensor gw_t = gw.tensor(), tail_t = tail.tensor();
      ASSERT_EQ(lmloss_round_grad_weight(ctx.get(), &gw_t, &tail_t, nullptr), LMLOSS_SUCCESS) << lmloss_last_error();
      ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS);
      gw.download();
      EXPECT_EQ(gw.values(), std::vector<double>(size_t(vocab * hidden), 0.0));
    }
    // Top-k and the gradient scaling over no rows.
    lmloss_topk_options t = lmloss_topk_options_default();
    t.k = 3;
    const lmloss_tensor ids = empty(LMLOSS_I32, 2, 3), probs = empty(compute, 2, 3);
    EXPECT_EQ(lmloss_topk(ctx.get(), &head, &t, &ids, &probs, nullptr), LMLOSS_SUCCESS) << lmloss_last_error();
    const lmloss_tensor rows = empty(dtype, 2, hidden);
    EXPECT_EQ(lmloss_scale_gradient(ctx.get(), &rows, nullptr, &rows), LMLOSS_SUCCESS) << lmloss_last_error();
  }
}

TEST_P(Edge, HugeLogitsStayFinite) {
  Generator gen(305);
  for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16}) {
    SCOPED_TRACE(dtype_name(dtype));
    reference::Problem p = gen.problem({.n_tokens = 6, .vocab = 333});
    for (size_t i = 0; i < p.logits.size(); ++i) p.logits[i] = i % 3 == 0 ? 1e4 : -1e4;
    p.logits[5] = 1e4 - 3;  // a second value at the top, so the softmax is not one-hot
    lmloss_loss_options o = lmloss_loss_options_default();
    o.z_loss = 1e-4;
    LossCase c(p, o, setup(dtype));
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_TRUE(std::isfinite(c.loss.get(0)));
    for (double x : c.grad_logits.values()) ASSERT_TRUE(std::isfinite(x));
    expect_matches_reference(c, Mode::forward_backward,
                             tolerance_at_magnitude(dtype, dtype, 1e4));
  }
}

TEST_P(Edge, NanLogitsGiveNanLoss) {
  Generator gen(306);
  reference::Problem p = gen.problem({.n_tokens = 4, .vocab = 129, .ignore_fraction = 0});
  p.logits[2 * 129 + 17] = NAN;
  for (const lmloss_reduction reduction : {LMLOSS_REDUCTION_MEAN, LMLOSS_REDUCTION_NONE}) {
    lmloss_loss_options o = lmloss_loss_options_default();
    o.reduction = reduction;
    LossCase c(p, o, setup());
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    if (reduction == LMLOSS_REDUCTION_MEAN) {
      EXPECT_TRUE(std::isnan(c.loss.get(0)));
    } else {
      EXPECT_TRUE(std::isnan(c.loss.get(2)));
      EXPECT_TRUE(std::isfinite(c.loss.get(0)));  // the other tokens are unaffected
      EXPECT_TRUE(std::isfinite(c.loss.get(3)));
    }
  }
}

TEST_P(Edge, StridedRows) {
  // Rows of every 2-D input and output sit 5 elements apart from the next row's end; the gaps
  // hold NaN in the inputs (so reading them shows) and must stay untouched in the outputs.
  Generator gen(307);
  for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    LossSetup s = setup(dtype);
    s.row_padding = 5;
    check_every_mode(gen.problem({.n_tokens = 7, .vocab = 301}), some_options(), s);
    check_every_mode(gen.problem({.n_tokens = 7, .vocab = 301, .hidden = 12, .bias = true}),
                     some_options(), s);
    s.in_place = true;
    check_every_mode(gen.problem({.n_tokens = 7, .vocab = 301}), some_options(), s);
    s.in_place = false;
    s.row_padding = 3;
    ProblemSpec distill{.n_tokens = 7, .vocab = 301, .hidden = 12, .top_k = 4};
    lmloss_loss_options o = some_options();
    o.kd_weight = 0.5;
    check_every_mode(gen.problem(distill), o, s);

    TopkSetup ts = topk_setup(dtype);
    ts.row_padding = 5;
    lmloss_topk_options to = lmloss_topk_options_default();
    to.k = 6;
    to.renormalize = 0;
    for (const int64_t hidden : {0, 12}) {
      TopkCase c(gen.problem({.n_tokens = 7, .vocab = 301, .hidden = hidden}), to, ts);
      ASSERT_EQ(c.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      expect_topk_matches_reference(c, tolerance(dtype, LMLOSS_F32));
    }
  }
}

TEST_P(Edge, StridedVectors) {
  // Every vector (labels, mask, bias, per-token loss and upstream, lse, grad_bias, top-k's tail)
  // with its elements 3 apart: the gaps hold NaN or -1 in the inputs (so reading them shows) and
  // must stay untouched in the outputs. The CUDA backend takes contiguous vectors only, and says so.
  Generator gen(311);
  const int64_t n = 7;
  lmloss_loss_options none = some_options();
  none.reduction = LMLOSS_REDUCTION_NONE;
  LossSetup s = setup();
  s.vector_stride = 3;
  s.upstream = gen.uniform(n, -1.5, 1.5);
  const reference::Problem linear = gen.problem({.n_tokens = n, .vocab = 301, .hidden = 12, .bias = true});
  if (GetParam() == Device::cuda) {
    LossCase c(linear, none, s);
    EXPECT_EQ(c.forward(ctx.get()), LMLOSS_ERROR_UNSUPPORTED);
    EXPECT_NE(std::string(lmloss_last_error()).find("contiguous vector"), std::string::npos) << lmloss_last_error();
    for (const Buffer* b : c.outputs()) EXPECT_TRUE(b->untouched());
    return;
  }
  check_every_mode(gen.problem({.n_tokens = n, .vocab = 301, .mask = true}), none, s);
  check_every_mode(linear, none, s);
  s.upstream = {0.6};
  check_every_mode(linear, some_options(), s);  // a scalar loss beside the strided lse and grad_bias
  lmloss_loss_options distill = none;
  distill.kd_weight = 0.5;
  s.upstream = gen.uniform(n, -1.5, 1.5);
  check_every_mode(gen.problem({.n_tokens = n, .vocab = 301, .hidden = 12, .top_k = 4, .mask = true}), distill, s);

  TopkSetup ts = topk_setup();
  ts.vector_stride = 3;
  lmloss_topk_options to = lmloss_topk_options_default();
  to.k = 6;
  to.renormalize = 0;
  for (const int64_t hidden : {0, 12}) {
    TopkCase c(gen.problem({.n_tokens = n, .vocab = 301, .hidden = hidden, .bias = hidden > 0}), to, ts);
    ASSERT_EQ(c.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_topk_matches_reference(c, tolerance(LMLOSS_F32));
  }
}

TEST_P(Edge, LogitsMaskedWithMinusInfinity) {
  // Logits a caller masked with -inf (tokens it rules out): exp(-inf) = 0, so they take no
  // probability and no gradient, and the rest is as without them. A row masked whole belongs to
  // an ignored token: its lse is -inf, its loss and gradient 0.
  Generator gen(312);
  for (const lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t n = 6, vocab = 263;
    reference::Problem p = gen.problem({.n_tokens = n, .vocab = vocab, .ignore_fraction = 0});
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t j = t % 3; j < vocab; j += 3) {
        if (j != p.labels[t]) p.logits[t * vocab + j] = -INFINITY;
      }
    }
    for (int64_t j = 0; j < vocab; ++j) p.logits[4 * vocab + j] = -INFINITY;
    p.labels[4] = -100;
    for (const lmloss_reduction reduction : {LMLOSS_REDUCTION_MEAN, LMLOSS_REDUCTION_NONE}) {
      lmloss_loss_options o = lmloss_loss_options_default();
      o.reduction = reduction;
      o.label_smoothing = 0;  // smoothing reads every logit: -inf ones would make the loss inf
      LossSetup s = setup(dtype);
      if (reduction == LMLOSS_REDUCTION_NONE) s.upstream = gen.uniform(n, -1, 1);
      check_every_mode(p, o, s);
      LossCase c(p, o, s);
      ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      EXPECT_EQ(c.lse.get(4), -INFINITY);
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t j = t % 3; j < vocab; j += 3) {
          if (j == p.labels[t]) continue;
          ASSERT_EQ(c.grad_logits.get(t * vocab + j), 0.0) << "token " << t << " id " << j;
        }
      }
    }
  }
}

TEST_P(Edge, TeacherEntryOfZeroAtAMaskedLogit) {
  // A teacher entry of probability 0 contributes nothing (0 log 0 = 0), also at an id the caller
  // masked with -inf, where P (log P - s) would be 0 x inf.
  Generator gen(313);
  const int64_t n = 5, vocab = 97, k = 4;
  reference::Problem p = gen.problem({.n_tokens = n, .vocab = vocab, .top_k = k});
  for (int64_t t = 0; t < n; ++t) {
    const int64_t id = p.teacher_ids[t * k + k - 1];
    if (p.labels[t] == id) p.labels[t] = -100;
    p.teacher_probs[t * k + k - 1] = 0;
    p.logits[t * vocab + id] = -INFINITY;
  }
  lmloss_loss_options o = lmloss_loss_options_default();
  o.ce_weight = 0.5;
  o.kd_weight = 0.5;
  check_every_mode(p, o, setup());
  LossCase c(p, o, setup());
  ASSERT_EQ(c.forward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_TRUE(std::isfinite(c.loss.get(0))) << c.loss.get(0);
}

TEST_P(Edge, MaskBytesOtherThanZeroAllCount) {
  // Only 0 leaves a token out: a mask of 2s and 255s gives bitwise what one of 1s gives.
  Generator gen(314);
  reference::Problem p = gen.problem({.n_tokens = 6, .vocab = 211, .hidden = 8, .mask = true});
  for (int64_t t = 0; t < 6; ++t) p.token_mask[t] = t == 1 ? 0 : 1;
  LossCase ones(p, some_options(), setup());
  ASSERT_EQ(ones.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  for (int64_t t = 0; t < 6; ++t) p.token_mask[t] = t == 1 ? 0 : t % 2 ? 2 : 255;
  LossCase bytes(p, some_options(), setup());
  ASSERT_EQ(bytes.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_TRUE(bitwise_equal(ones.output_values(), bytes.output_values()));
}

TEST_P(Edge, DistillationOverTheWholeVocabulary) {
  // A teacher of k = V entries: every id once.
  Generator gen(315);
  const int64_t vocab = 37;
  reference::Problem p = gen.problem({.n_tokens = 4, .vocab = vocab, .labels = false, .top_k = vocab});
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t k = 0; k < vocab; ++k) p.teacher_ids[t * vocab + k] = (k * 7 + t) % vocab;
  lmloss_loss_options o = lmloss_loss_options_default();
  o.ce_weight = 0;
  o.kd_weight = 1;
  check_every_mode(p, o, setup());
}

TEST_P(Edge, RepeatedTeacherIdsAddTheirTerms) {
  // A teacher may name an id more than once, and the label: each entry adds its term there, with
  // and without the label's term. k on both sides of 256 entries, where the CUDA rows stop
  // searching their entries for repeats and take them in (id, entry) order.
  Generator gen(316);
  const int64_t n = 6, vocab = 311;
  for (const int64_t k : {5, 300}) {
    reference::Problem p = gen.problem({.n_tokens = n, .vocab = vocab, .top_k = k});
    repeat_teacher_ids(p, n, k);
    for (const double ce_weight : {0.5, 0.0}) {
      SCOPED_TRACE(cat("k ", k, " ce_weight ", ce_weight));
      lmloss_loss_options o = lmloss_loss_options_default();
      o.ce_weight = ce_weight;
      o.kd_weight = 0.7;
      check_every_mode(p, o, setup());
    }
  }
}

TEST_P(Edge, InfiniteLogitGivesInfiniteLse) {
  // A logit of +inf (an overflow upstream): its row's lse is +inf and so its loss (its label
  // elsewhere), with or without the z-loss (absent at 0, not 0 inf^2 = NaN); so with two of them
  // (not inf - inf); the other rows are as without them. Top-k puts the id first, its probability
  // inf / inf (NaN) and the others' 0.
  Generator gen(313);
  const int64_t n = 4, vocab = 129;
  reference::Problem p = gen.problem({.n_tokens = n, .vocab = vocab, .ignore_fraction = 0});
  p.logits[1 * vocab + 17] = INFINITY;
  p.labels[1] = 5;
  p.logits[2 * vocab + 3] = p.logits[2 * vocab + 90] = INFINITY;  // two: inf, not inf - inf
  p.labels[2] = 5;
  for (const double z_loss : {0.0, 1e-3}) {
    SCOPED_TRACE(cat("z_loss ", z_loss));
    lmloss_loss_options o = lmloss_loss_options_default();
    o.reduction = LMLOSS_REDUCTION_NONE;
    o.label_smoothing = 0;
    o.z_loss = z_loss;
    LossCase c(p, o, setup());
    ASSERT_EQ(c.forward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    for (const int64_t t : {1, 2}) {
      EXPECT_EQ(c.lse.get(t), INFINITY) << "token " << t;
      EXPECT_EQ(c.loss.get(t), INFINITY) << "token " << t;
    }
    const reference::LossResult ref = c.reference();
    EXPECT_EQ(ref.loss[1], INFINITY);
    for (const int64_t t : {0, 3}) {
      EXPECT_NEAR(c.lse.get(t), ref.lse[t], 1e-5 * std::abs(ref.lse[t])) << "token " << t;
      EXPECT_NEAR(c.loss.get(t), ref.loss[t], 1e-5 * std::abs(ref.loss[t])) << "token " << t;
    }
  }
  for (const int renormalize : {1, 0}) {
    lmloss_topk_options to = lmloss_topk_options_default();
    to.k = 2;
    to.renormalize = renormalize;
    SCOPED_TRACE(cat("renormalize ", renormalize));
    TopkCase tc(p, to, topk_setup());
    ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_EQ(tc.ids.get_id(1 * 2), 17);
    EXPECT_EQ(tc.probs.get(1 * 2 + 1), 0.0);
    const auto [low, high] = std::minmax({tc.ids.get_id(2 * 2), tc.ids.get_id(2 * 2 + 1)});
    EXPECT_EQ(low, 3);
    EXPECT_EQ(high, 90);
    const reference::TopkResult ref = tc.reference();  // row 1's first probability: inf / inf
    for (const int64_t t : {0, 3}) {
      for (int64_t i = 0; i < 2; ++i) {
        EXPECT_EQ(tc.ids.get_id(t * 2 + i), ref.ids[t * 2 + i]) << "token " << t;
        EXPECT_NEAR(tc.probs.get(t * 2 + i), ref.probs[t * 2 + i], 1e-5) << "token " << t;
      }
    }
  }
}

// Runs `c` fused under the default budget, then under one small enough to force several chunks.
// Returns the two runs' results (loss, lse, then every gradient), and checks the small run
// really chunked and stayed within its budget.
struct ChunkedRuns {
  std::vector<double> one_chunk, many_chunks;
};

ChunkedRuns run_chunked(LossCase& c) {
  auto results = [&] {
    std::vector<double> r;
    for (const Buffer* b : c.outputs()) {
      const std::vector<double> v = b->values();
      r.insert(r.end(), v.begin(), v.end());
    }
    return r;
  };
  ChunkedRuns runs;
  lmloss::Context big;
  EXPECT_EQ(c.forward_backward(big.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  runs.one_chunk = results();
  const size_t peak_one = big.peak_workspace();
  EXPECT_GT(peak_one, 0u);
  // About an eighth of the rows per chunk; more if the fixed part needs it.
  size_t budget = std::max<size_t>(peak_one / 8, 64);
  for (int attempt = 0; attempt < 8; ++attempt, budget *= 2) {
    lmloss::Context small;
    small.set_workspace_budget(budget);
    const lmloss_status status = c.forward_backward(small.get());
    if (status == LMLOSS_ERROR_INVALID_ARGUMENT) continue;  // not even one row fits yet
    EXPECT_EQ(status, LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_LE(small.peak_workspace(), budget);
    EXPECT_LT(small.peak_workspace(), peak_one / 2) << "the small budget did not split the rows";
    runs.many_chunks = results();
    return runs;
  }
  ADD_FAILURE() << "no budget below the one-chunk peak of " << peak_one << " bytes worked";
  return runs;
}

TEST_P(Edge, ChunkingChangesNothingForLogits) {
  Generator gen(308);
  lmloss_loss_options o = some_options();
  o.reduction = LMLOSS_REDUCTION_MEAN;
  o.kd_weight = 0.3;
  for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    LossCase c(gen.problem({.n_tokens = 64, .vocab = 1031, .top_k = 4}), o, setup(dtype));
    const ChunkedRuns runs = run_chunked(c);
    // Each row's arithmetic is the same whatever chunk it falls in: bitwise equal.
    EXPECT_TRUE(bitwise_equal(runs.one_chunk, runs.many_chunks));
  }
}

TEST_P(Edge, ChunkingStaysWithinToleranceForLinear) {
  Generator gen(309);
  for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    LossSetup s = setup(dtype);
    s.grad_dtype = LMLOSS_F32;
    LossCase c(gen.problem({.n_tokens = 64, .vocab = 1031, .hidden = 32, .bias = true}),
               some_options(), s);
    const ChunkedRuns runs = run_chunked(c);
    // dW and db are sums over chunks: the order of the f32 additions changes, nothing else.
    EXPECT_TRUE(close_to(runs.many_chunks, runs.one_chunk, tolerance(LMLOSS_F32)));
    expect_matches_reference(c, Mode::forward_backward);
  }
}

TEST_P(Edge, ChunkingChangesNothingForTopk) {
  Generator gen(311);
  lmloss_topk_options o = lmloss_topk_options_default();
  o.k = 7;
  o.renormalize = 0;
  o.softcap = 20;
  for (const int64_t hidden : {0, 16}) {
    SCOPED_TRACE(hidden ? "linear" : "logits");
    TopkCase c(gen.problem({.n_tokens = 64, .vocab = 1031, .hidden = hidden, .tie_rank = 7}), o,
               topk_setup());
    lmloss::Context big;
    ASSERT_EQ(c.run(big.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    const std::vector<int64_t> ids = c.ids.ids();
    const std::vector<double> probs = c.probs.values(), tail = c.tail.values();
    if (big.peak_workspace() == 0) {  // this backend selects over the given logits in place
      expect_topk_matches_reference(c, tolerance(LMLOSS_F32));
      continue;
    }
    lmloss::Context small;
    small.set_workspace_budget(std::max<size_t>(big.peak_workspace() / 8, 1));
    lmloss_status status = LMLOSS_ERROR_INVALID_ARGUMENT;
    for (int attempt = 0; attempt < 8 && status == LMLOSS_ERROR_INVALID_ARGUMENT; ++attempt) {
      status = c.run(small.get());
      if (status == LMLOSS_ERROR_INVALID_ARGUMENT) {
        small.set_workspace_budget(small.workspace_budget() * 2);
      }
    }
    ASSERT_EQ(status, LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_LT(small.peak_workspace(), big.peak_workspace() / 2) << "the rows were not split";
    if (hidden == 0) {  // a product per chunk may round differently: linear ids are checked below
      EXPECT_EQ(c.ids.ids(), ids);
      EXPECT_TRUE(bitwise_equal(c.probs.values(), probs));
      EXPECT_TRUE(bitwise_equal(c.tail.values(), tail));
    }
    expect_topk_matches_reference(c, tolerance(LMLOSS_F32));
  }
}

// ---- Budget planning and the peak (docs/contract.md, "Memory and the budget (CPU)") --------

// The bytes a budget refusal says one row needs ("... needs at least N bytes ...").
size_t stated_minimum(const std::string& message) {
  const std::string key = "needs at least ";
  const size_t at = message.find(key);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no stated minimum in: " << message;
    return 0;
  }
  return size_t(std::stoull(message.substr(at + key.size())));
}

// The minimum a budget refusal states is the true one on the CPU: that budget runs (within it,
// one row a chunk) and one byte less is refused. A plan that under-counts anything (the bias, the
// logits, a row's loss, top-k's per-thread order) exceeds it.
TEST_P(Edge, BudgetOfTheStatedMinimumRunsWithinIt) {
  if (GetParam() != Device::cpu) GTEST_SKIP() << "the CPU's workspace plan";
  Generator gen(312);
  auto expect_minimum_holds = [&](const std::function<lmloss_status(lmloss_context*)>& run,
                                  const std::function<void()>& check) {
    lmloss::Context small;
    small.set_num_threads(2);  // the per-thread parts count even on a one-core machine
    small.set_workspace_budget(64);
    ASSERT_EQ(run(small.get()), LMLOSS_ERROR_INVALID_ARGUMENT);
    const size_t minimum = stated_minimum(lmloss_last_error());
    small.set_workspace_budget(minimum);
    small.reset_peak_workspace();
    ASSERT_EQ(run(small.get()), LMLOSS_SUCCESS) << "the stated minimum " << minimum << ": " << lmloss_last_error();
    EXPECT_LE(small.peak_workspace(), minimum);
    check();
    small.set_workspace_budget(minimum - 1);
    EXPECT_EQ(run(small.get()), LMLOSS_ERROR_INVALID_ARGUMENT) << "the stated minimum is not the least";
  };
  {
    SCOPED_TRACE("logits f32");
    LossCase c(gen.problem({.n_tokens = 6, .vocab = 1031, .top_k = 3}), some_options(), setup());
    expect_minimum_holds([&](lmloss_context* ctx) { return c.forward_backward(ctx); },
                         [&] { expect_matches_reference(c, Mode::forward_backward); });
  }
  {
    SCOPED_TRACE("linear f32 with bias");
    LossCase c(gen.problem({.n_tokens = 6, .vocab = 1031, .hidden = 16, .bias = true}), some_options(), setup());
    expect_minimum_holds([&](lmloss_context* ctx) { return c.forward_backward(ctx); },
                         [&] { expect_matches_reference(c, Mode::forward_backward); });
  }
  {
    SCOPED_TRACE("linear bf16, W converted in slices the budget sizes");
    LossCase c(gen.problem({.n_tokens = 6, .vocab = 1031, .hidden = 16}), some_options(), setup(LMLOSS_BF16));
    expect_minimum_holds([&](lmloss_context* ctx) { return c.forward_backward(ctx); },
                         [&] { expect_matches_reference(c, Mode::forward_backward); });
  }
  {
    SCOPED_TRACE("top-k over f32 logits");
    lmloss_topk_options o = lmloss_topk_options_default();
    o.k = 5;
    TopkCase c(gen.problem({.n_tokens = 6, .vocab = 1031, .labels = false}), o, topk_setup());
    expect_minimum_holds([&](lmloss_context* ctx) { return c.run(ctx); },
                         [&] { expect_topk_matches_reference(c, tolerance(LMLOSS_F32)); });
  }
  {
    SCOPED_TRACE("top-k of a linear bf16 head, W converted in slices the budget sizes");
    lmloss_topk_options o = lmloss_topk_options_default();
    o.k = 5;
    TopkCase c(gen.problem({.n_tokens = 6, .vocab = 1031, .hidden = 16, .labels = false}), o,
               topk_setup(LMLOSS_BF16));
    expect_minimum_holds([&](lmloss_context* ctx) { return c.run(ctx); },
                         [&] { expect_topk_matches_reference(c, tolerance(LMLOSS_BF16)); });
  }
}

// Chunks take as many rows as the budget holds: less than one row of it is left unused.
TEST_P(Edge, ChunksTakeEveryRowTheBudgetHolds) {
  if (GetParam() != Device::cpu) GTEST_SKIP() << "the CPU's workspace plan";
  Generator gen(313);
  const int64_t vocab = 1031;
  const size_t row_bytes = size_t(vocab) * 4;  // a row of f32 logits
  LossCase c(gen.problem({.n_tokens = 64, .vocab = vocab}), some_options(), setup());
  lmloss::Context small;
  small.set_workspace_budget(64);
  ASSERT_EQ(c.forward_backward(small.get()), LMLOSS_ERROR_INVALID_ARGUMENT);
  // Room for three more rows and their O(1) statistics: chunks of four rows.
  const size_t budget = stated_minimum(lmloss_last_error()) + 3 * row_bytes + 64;
  small.set_workspace_budget(budget);
  small.reset_peak_workspace();
  ASSERT_EQ(c.forward_backward(small.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_LE(small.peak_workspace(), budget);
  EXPECT_GT(small.peak_workspace(), budget - row_bytes) << "a chunk took fewer rows than fit";
  expect_matches_reference(c, Mode::forward_backward);
}

// A bf16 W whose f32 copy exceeds a quarter of the budget is converted in slices of an eighth
// of it, not whole (few tokens, so the slice shows in the peak); with many tokens the chunks
// still fit beside the slice, each row counted with its converted X and its bf16 dX's f32 row.
TEST_P(Edge, WeightBeyondAQuarterOfTheBudgetIsConvertedInSlices) {
  if (GetParam() != Device::cpu) GTEST_SKIP() << "the CPU's workspace plan";
  Generator gen(314);
  const int64_t vocab = 1024, hidden = 64;
  const size_t weight_f32 = size_t(vocab) * size_t(hidden) * 4;  // 256 KiB
  const size_t budget = weight_f32 * 5 / 2;                      // W is 0.4 of it
  for (const int64_t n : {2, 256}) {
    SCOPED_TRACE(cat(n, " tokens"));
    LossCase c(gen.problem({.n_tokens = n, .vocab = vocab, .hidden = hidden, .bias = true}), some_options(),
               setup(LMLOSS_BF16));
    lmloss::Context small;
    small.set_workspace_budget(budget);
    const Mode mode = n == 2 ? Mode::forward : Mode::forward_backward;
    ASSERT_EQ(c.run(small.get(), mode), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_LE(small.peak_workspace(), budget);
    if (n == 2) {
      EXPECT_LT(small.peak_workspace(), weight_f32 / 2) << "W was not sliced to an eighth of the budget";
    }
    expect_matches_reference(c, mode);
  }
}

// The peak restarts at what is held (nothing, between calls on the CPU): a smaller call after a
// reset reports its own peak, not the larger one before.
TEST_P(Edge, ResetPeakStartsAfreshForTheNextCall) {
  Generator gen(315);
  LossCase big(gen.problem({.n_tokens = 64, .vocab = 1031}), some_options(), setup());
  LossCase little(gen.problem({.n_tokens = 2, .vocab = 37}), some_options(), setup());
  ASSERT_EQ(big.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  const size_t big_peak = ctx.peak_workspace();
  ASSERT_EQ(little.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_EQ(ctx.peak_workspace(), big_peak) << "without a reset the peak stays";
  ctx.reset_peak_workspace();
  if (GetParam() == Device::cpu) {
    EXPECT_EQ(ctx.peak_workspace(), 0u) << "workspace held between calls";
  }
  ASSERT_EQ(little.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_LT(ctx.peak_workspace(), big_peak);
  ASSERT_EQ(little.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  const size_t little_peak = ctx.peak_workspace();
  ctx.reset_peak_workspace();
  ASSERT_EQ(little.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_EQ(ctx.peak_workspace(), little_peak) << "the same call after a reset reports the same peak";
}

// set_num_threads sizes the per-thread workspace (top-k's order buffer): one thread needs less
// than two.
TEST_P(Edge, PerThreadWorkspaceFollowsTheThreadCount) {
  if (GetParam() != Device::cpu) GTEST_SKIP() << "the CPU's thread count";
  Generator gen(316);
  lmloss_topk_options o = lmloss_topk_options_default();
  o.k = 5;
  TopkCase c(gen.problem({.n_tokens = 6, .vocab = 1031, .labels = false}), o, topk_setup());
  auto minimum_with = [&](int threads) {
    lmloss::Context small;
    small.set_num_threads(threads);
    small.set_workspace_budget(64);
    EXPECT_EQ(c.run(small.get()), LMLOSS_ERROR_INVALID_ARGUMENT);
    return stated_minimum(lmloss_last_error());
  };
  EXPECT_LT(minimum_with(1), minimum_with(2));
}

// A scalar upstream gradient may come as shape (1): it is read once, not once per token (here it
// is the first element of a longer buffer whose other values would show if read).
TEST_P(Edge, ScalarUpstreamOfShapeOne) {
  Generator gen(307);
  LossSetup s = setup();
  s.upstream = {0.75};
  for (const lmloss_reduction reduction : {LMLOSS_REDUCTION_MEAN, LMLOSS_REDUCTION_SUM}) {
    SCOPED_TRACE(cat("reduction ", reduction));
    lmloss_loss_options o = lmloss_loss_options_default();
    o.reduction = reduction;
    LossCase c(gen.problem({.n_tokens = 4, .vocab = 37, .hidden = 8}), o, s);
    Buffer longer = Buffer::of_values(GetParam(), LMLOSS_F32, {0.75, 1000, -5000, 7e6}, 1, 4);
    longer.upload();
    lmloss_tensor upstream = longer.tensor();
    upstream.shape[0] = 1;
    ASSERT_EQ(c.invoke(ctx.get(), [&] {
      const lmloss_head h = c.head();
      const lmloss_targets t = c.targets();
      const lmloss_grads g = c.grads();
      const lmloss_tensor loss = c.loss_tensor(), lse = c.lse_tensor();
      return lmloss_loss_forward_backward(ctx.get(), &h, &t, &c.options, &upstream, &loss, &lse, &g);
    }), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_matches_reference(c, Mode::forward_backward);
  }
}

INSTANTIATE_TEST_SUITE_P(, Edge, all_devices, ParamName{});

}  // namespace
}  // namespace lmloss::test
