// A 16-bit grad_weight's f32 sum kept across calls (options.grad_weight_sum_tail) and rounded
// once by lmloss_round_grad_weight, on every device: micro-batches added into the kept sum give,
// rounded with a scale, what the same calls into an f32 grad_weight give rounded once on the host
// (but for the rare element whose two f32 sums straddle a rounding boundary), and the float64
// reference within the dtype's tolerance.
#include <cmath>
#include <string>
#include <vector>

#include "core/weight_sum_rest.hpp"
#include "harness.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::test {
namespace {

class KeptWeightSum : public DeviceDtypeTest {
 protected:
  // Rows [r0, r1) of a linear problem's tokens: one micro-batch.
  static reference::Problem tokens_of(const reference::Problem& p, int64_t r0, int64_t r1) {
    reference::Problem q = p;
    q.n_tokens = r1 - r0;
    q.hidden_states.assign(p.hidden_states.begin() + r0 * p.hidden, p.hidden_states.begin() + r1 * p.hidden);
    if (!p.labels.empty()) q.labels.assign(p.labels.begin() + r0, p.labels.begin() + r1);
    if (p.top_k > 0) {
      q.teacher_ids.assign(p.teacher_ids.begin() + r0 * p.top_k, p.teacher_ids.begin() + r1 * p.top_k);
      q.teacher_probs.assign(p.teacher_probs.begin() + r0 * p.top_k, p.teacher_probs.begin() + r1 * p.top_k);
    }
    return q;
  }

  // A budget of about `rows` token rows (a few chunks a call on either device).
  static size_t budget_for_rows(int64_t rows, int64_t vocab, int64_t hidden) {
    return 64 * 1024 + size_t(rows) * size_t(vocab + hidden) * 8;
  }

  // The losses each micro-batch test runs: cross-entropy with every option, and distillation
  // (a top-k of 4) mixed with it.
  struct Loss {
    const char* name;
    lmloss_loss_options options;
    int64_t top_k;
  };
  static std::vector<Loss> losses() {
    lmloss_loss_options everything = lmloss_loss_options_default();
    everything.label_smoothing = 0.05;
    everything.z_loss = 1e-3;
    everything.softcap = 8.0;
    everything.temperature = 0.8;
    lmloss_loss_options distill_mixed = lmloss_loss_options_default();
    distill_mixed.ce_weight = 0.4;
    distill_mixed.kd_weight = 0.9;
    return {{"everything", everything, 0}, {"distill_mixed", distill_mixed, 4}};
  }

  // The first micro-batch's tokens: a third, or one of two.
  static int64_t first_batch_rows(int64_t n_tokens) { return n_tokens == 2 ? 1 : n_tokens / 3; }

  // A linear problem's inputs on the test's device, its tokens in two micro-batches, [0, n1) and
  // [n1, N), each a view of the inputs' rows.
  struct TwoBatches {
    const reference::Problem& p;
    int64_t n1;
    Device device;
    Buffer x, w, labels, ids, probs, loss;

    TwoBatches(const reference::Problem& problem, int64_t first_rows, Device on, lmloss_dtype dtype)
        : p(problem), n1(first_rows), device(on), loss(on, LMLOSS_F32, 0, 1) {
      x = Buffer::of_values(device, dtype, p.hidden_states, 2, p.n_tokens, p.hidden);
      w = Buffer::of_values(device, dtype, p.weight, 2, p.vocab, p.hidden);
      labels = Buffer::of_ids(device, LMLOSS_I64, p.labels, 1, p.n_tokens);
      if (p.top_k > 0) {
        ids = Buffer::of_ids(device, LMLOSS_I32, p.teacher_ids, 2, p.n_tokens, p.top_k);
        probs = Buffer::of_values(device, LMLOSS_F32, p.teacher_probs, 2, p.n_tokens, p.top_k);
      }
      for (Buffer* b : {&x, &w, &labels, &ids, &probs})
        if (b->present()) b->upload();
    }

    static lmloss_tensor rows_of(lmloss_tensor t, int64_t r0, int64_t r1) {
      t.data = static_cast<char*>(t.data) + r0 * (t.ndim == 2 ? t.shape[1] : 1) * int64_t(dtype_size(t.dtype));
      t.shape[0] = r1 - r0;
      return t;
    }

    // Both micro-batches' fused steps into `grad_weight`, the second with
    // LMLOSS_ACCUMULATE_GRAD_WEIGHT.
    void run(lmloss_context* ctx, const lmloss_tensor& grad_weight, lmloss_loss_options options) const {
      for (const auto& [r0, r1] : {std::pair<int64_t, int64_t>{0, n1}, {n1, p.n_tokens}}) {
        const lmloss_head head{lmloss_tensor_none(), rows_of(x.tensor(), r0, r1), w.tensor(), lmloss_tensor_none()};
        const lmloss_targets targets{rows_of(labels.tensor(), r0, r1),
                                     ids.present() ? rows_of(ids.tensor(), r0, r1) : lmloss_tensor_none(),
                                     probs.present() ? rows_of(probs.tensor(), r0, r1) : lmloss_tensor_none(),
                                     lmloss_tensor_none()};
        const lmloss_grads grads{lmloss_tensor_none(), lmloss_tensor_none(), grad_weight, lmloss_tensor_none()};
        const lmloss_tensor loss_t = loss.tensor(), none = lmloss_tensor_none();
        if (r0 > 0) options.flags |= LMLOSS_ACCUMULATE_GRAD_WEIGHT;
        ASSERT_EQ(lmloss_loss_forward_backward(ctx, &head, &targets, &options, nullptr, &loss_t, &none, &grads),
                  LMLOSS_SUCCESS)
            << lmloss_last_error();
      }
    }

    // The same calls into an f32 grad_weight: the sum a kept one is checked against.
    Buffer f32_sum(lmloss_context* ctx, const lmloss_loss_options& options) const {
      Buffer wide(device, LMLOSS_F32, 2, p.vocab, p.hidden);
      wide.poison();
      wide.upload();
      run(ctx, wide.tensor(), options);
      EXPECT_EQ(lmloss_context_synchronize(ctx), LMLOSS_SUCCESS) << lmloss_last_error();
      wide.download();
      return wide;
    }

    // The float64 reference's dW of both micro-batches, times `scale`.
    std::vector<double> reference_sum(const lmloss_loss_options& options, double scale) const {
      const reference::LossResult first = reference::loss(tokens_of(p, 0, n1), options);
      const reference::LossResult second = reference::loss(tokens_of(p, n1, p.n_tokens), options);
      std::vector<double> want(first.grad_weight.size());
      for (size_t i = 0; i < want.size(); ++i) want[i] = scale * (first.grad_weight[i] + second.grad_weight[i]);
      return want;
    }
  };

  lmloss::Context ctx;
};

// Where the tail lies: a buffer of its own, or in one buffer with grad_weight's rows (dense), right
// after them (one f32 matrix), after them past a gap, or before them.
enum class Tail { own, after_rows, after_gap, before_rows };

struct SumShape {
  int64_t n_tokens, vocab, hidden, tail_rows, row_padding;
  Tail tail = Tail::own;
};

// Two micro-batches, the second added with LMLOSS_ACCUMULATE_GRAD_WEIGHT, in a few chunks each:
// the smallest tail; a tail of every row (grad_weight's rows padded, its bytes not the library's
// until the rounding); one between; an odd width; a vocabulary too narrow for rows in place; one
// token in the first micro-batch; equal halves (a vocabulary of a multiple of 16) with the tail in
// each place: right after the rows in place (one f32 matrix, one product a chunk), past a gap
// after them (on CUDA one product batched over both), before them, or anywhere. Cross-entropy with
// every option, and distillation mixed with it.
TEST_P(KeptWeightSum, MicroBatchesRoundedOnceMatchTheirF32Sum) {
  if (dtype() != LMLOSS_BF16 && dtype() != LMLOSS_F16) GTEST_SKIP() << "a kept f32 sum is for a 16-bit grad_weight";
  Generator gen(5101);
  const int64_t least_1999 = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(int64_t(1999));
  for (const SumShape shape : {SumShape{300, 1999, 72, least_1999, 0}, SumShape{300, 1999, 72, 1999, 8},
                               SumShape{300, 1999, 72, least_1999 + 24, 0}, SumShape{200, 1000, 37, 504, 0},
                               SumShape{40, 15, 64, 15, 0}, SumShape{2, 503, 16, 255, 0},
                               SumShape{300, 2000, 40, 1000, 0, Tail::after_rows},
                               SumShape{300, 2000, 40, 1000, 0, Tail::after_gap},
                               SumShape{300, 2000, 40, 1000, 0, Tail::before_rows}, SumShape{300, 2000, 40, 1000, 0}}) {
    for (const Loss& loss : losses()) {
      SCOPED_TRACE(cat(loss.name, " N ", shape.n_tokens, " V ", shape.vocab, " H ", shape.hidden, " tail rows ",
                       shape.tail_rows, " padding ", shape.row_padding, " tail placed ", int(shape.tail)));
      const lmloss_loss_options& o = loss.options;
      const reference::Problem p =
          rounded(gen.problem({.n_tokens = shape.n_tokens, .vocab = shape.vocab, .hidden = shape.hidden,
                               .top_k = loss.top_k}),
                  dtype());
      const int64_t vocab = p.vocab, hidden = p.hidden, ld = hidden + shape.row_padding;
      ctx.set_workspace_budget(budget_for_rows(64, vocab, hidden));
      const TwoBatches batches(p, first_batch_rows(shape.n_tokens), device(), dtype());

      // The kept sum, then rounded with a scale. Where the tail shares grad_weight's buffer, its
      // bytes there are 2 rows of 16-bit values per f32 row; a gap is 8 such rows.
      const int64_t tail_rows16 = 2 * shape.tail_rows, gap_rows16 = 8;
      int64_t grad_row0 = 0, tail_row0 = 0, arena_rows = vocab;
      if (shape.tail == Tail::after_rows || shape.tail == Tail::after_gap) {
        tail_row0 = vocab + (shape.tail == Tail::after_gap ? gap_rows16 : 0);
        arena_rows = tail_row0 + tail_rows16;
      } else if (shape.tail == Tail::before_rows) {
        grad_row0 = tail_rows16 + gap_rows16;
        arena_rows = grad_row0 + vocab;
      }
      Buffer kept(device(), dtype(), 2, arena_rows, hidden, ld);
      Buffer tail(device(), LMLOSS_F32, 2, shape.tail_rows, hidden);
      Buffer scale = Buffer::of_values(device(), LMLOSS_F32, {0.75}, 0, 1);
      kept.poison();
      tail.poison();
      for (Buffer* b : {&kept, &tail, &scale}) b->upload();
      lmloss_tensor kept_t = kept.tensor(), tail_t = tail.tensor();
      const int64_t row16_bytes = hidden * int64_t(dtype_size(dtype()));
      kept_t.data = static_cast<char*>(kept_t.data) + grad_row0 * row16_bytes;
      kept_t.shape[0] = vocab;
      if (shape.tail != Tail::own)
        tail_t = lmloss_tensor{static_cast<char*>(kept.tensor().data) + tail_row0 * row16_bytes, LMLOSS_F32, 2,
                               {shape.tail_rows, hidden}, 0, kept_t.device_type, kept_t.device_index};
      lmloss_loss_options kept_options = o;
      kept_options.grad_weight_sum_tail = tail_t;
      ASSERT_NO_FATAL_FAILURE(batches.run(ctx.get(), kept_t, kept_options));
      const lmloss_tensor scale_t = scale.tensor();
      ASSERT_EQ(lmloss_round_grad_weight(ctx.get(), &kept_t, &tail_t, &scale_t), LMLOSS_SUCCESS) << lmloss_last_error();
      ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      kept.download();
      const int64_t grad_first = grad_row0 * hidden;  // the gradient's first element in `kept`
      int64_t unwritten = 0;  // the gradient's elements still as poisoned (0xFFFF)
      for (int64_t i = 0; i < vocab * hidden; ++i) unwritten += std::isnan(kept.get(grad_first + i)) ? 1 : 0;
      EXPECT_EQ(unwritten, 0);
      if (shape.tail == Tail::own) {
        EXPECT_TRUE(kept.padding_untouched());
      } else if (shape.tail != Tail::after_rows) {  // the gap left as it was
        const int64_t gap_first = (shape.tail == Tail::after_gap ? vocab : tail_rows16) * hidden;
        int64_t gap_written = 0;
        for (int64_t i = 0; i < gap_rows16 * hidden; ++i) gap_written += std::isnan(kept.get(gap_first + i)) ? 0 : 1;
        EXPECT_EQ(gap_written, 0);
      }

      // The same calls into an f32 grad_weight, rounded here; the float64 reference, scaled.
      const Buffer wide = batches.f32_sum(ctx.get(), o);
      const int64_t count = vocab * hidden;
      EXPECT_TRUE(rounded_once_from(kept, wide, count, 0.75f, grad_first));
      const std::vector<double> all = kept.values();  // the gradient's elements, not the tail's bytes
      const std::vector<double> got(all.begin() + grad_first, all.begin() + grad_first + count);
      EXPECT_TRUE(close_to(got, batches.reference_sum(o, 0.75), tolerance(dtype())));
    }
  }
}

// Without a scale, from one call's kept sum: every element written, the tail only read, and the
// same bytes from a second call and rounding.
TEST_P(KeptWeightSum, RoundingReadsTheTailOnly) {
  if (dtype() != LMLOSS_BF16 && dtype() != LMLOSS_F16) GTEST_SKIP() << "a kept f32 sum is for a 16-bit grad_weight";
  Generator gen(5102);
  const int64_t vocab = 77, hidden = 24, tail_rows = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(vocab);
  const reference::Problem p = rounded(gen.problem({.n_tokens = 9, .vocab = vocab, .hidden = hidden}), dtype());
  LossSetup s;
  s.device = device();
  s.dtype = dtype();
  s.grad_dtype = dtype();
  s.want_grad_hidden = false;
  LossCase c(p, lmloss_loss_options_default(), s);
  Buffer tail(device(), LMLOSS_F32, 2, tail_rows, hidden);
  c.options.grad_weight_sum_tail = tail.tensor();
  std::vector<std::vector<double>> rounds;
  for (int round = 0; round < 2; ++round) {
    tail.poison();
    tail.upload();
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    tail.download();
    EXPECT_EQ(tail.unwritten(), 0);
    tail.snapshot();
    const lmloss_tensor grad_t = c.grad_weight.tensor(), tail_t = tail.tensor();
    ASSERT_EQ(lmloss_round_grad_weight(ctx.get(), &grad_t, &tail_t, nullptr), LMLOSS_SUCCESS) << lmloss_last_error();
    ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS);
    c.grad_weight.download();
    tail.download();
    EXPECT_TRUE(tail.untouched());
    EXPECT_TRUE(fully_written(c.grad_weight));
    rounds.push_back(c.grad_weight.values());
  }
  EXPECT_EQ(rounds[0], rounds[1]);
  EXPECT_TRUE(close_to(rounds[0], c.reference().grad_weight, tolerance(dtype())));
}

// On the CPU a bf16/f16 grad_weight is otherwise summed in an f32 copy counted in the workspace
// budget: a budget smaller than that copy is refused, naming it and the way around it, and the
// same call with a tail of the caller's runs within the budget.
TEST_P(KeptWeightSum, TailServesWhereTheBudgetCannotHoldTheSum) {
  if (device() != Device::cpu) GTEST_SKIP() << "the CPU's accumulator";
  if (dtype() != LMLOSS_BF16 && dtype() != LMLOSS_F16) GTEST_SKIP() << "a kept f32 sum is for a 16-bit grad_weight";
  Generator gen(5103);
  const int64_t vocab = 4099, hidden = 64;  // the f32 sum: 1 MiB
  const reference::Problem p = rounded(gen.problem({.n_tokens = 32, .vocab = vocab, .hidden = hidden}), dtype());
  LossSetup s;
  s.device = device();
  s.dtype = dtype();
  s.grad_dtype = dtype();
  LossCase c(p, lmloss_loss_options_default(), s);
  ctx.set_workspace_budget(256 * 1024);
  EXPECT_EQ(c.forward_backward(ctx.get()), LMLOSS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lmloss_last_error()).find("options.grad_weight_sum_tail"), std::string::npos)
      << lmloss_last_error();
  Buffer tail(device(), LMLOSS_F32, 2, LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(vocab), hidden);
  c.options.grad_weight_sum_tail = tail.tensor();
  ctx.reset_peak_workspace();
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_LE(ctx.peak_workspace(), ctx.workspace_budget());
  const lmloss_tensor grad_t = c.grad_weight.tensor(), tail_t = tail.tensor();
  ASSERT_EQ(lmloss_round_grad_weight(ctx.get(), &grad_t, &tail_t, nullptr), LMLOSS_SUCCESS) << lmloss_last_error();
  c.grad_weight.download();
  EXPECT_TRUE(close_to(c.grad_weight.values(), c.reference().grad_weight, tolerance(dtype())));
}

// The sum kept as a bf16 grad_weight's values and a u8 tail of their 8-bit rests: after two
// micro-batches in a few chunks each, the pair reads back as the same calls' f32 sum within
// ~1e-5 (the bf16 values alone are ~1e-3 from it: the rests must be written and read), rounds with
// a scale exactly as its arithmetic says, and so as that sum rounded once (but for values on a
// rounding boundary), every value written,
// each tensor's padding untouched and the tail only read by the rounding; the float64 reference
// within bf16's tolerance. Cross-entropy with every option, and distillation mixed with it; an
// odd vocabulary and width, one token in the first micro-batch, a vocabulary narrower than a
// vector, padded rows; on sm_90a the last three shapes take the one-kernel products (vocab a
// multiple of 8, width of 16), the others the products in slices.
TEST_P(KeptWeightSum, RestsBesideTheValuesHoldTheF32Sum) {
  if (dtype() != LMLOSS_BF16) GTEST_SKIP() << "rests are kept beside a bf16 grad_weight";
  Generator gen(5104);
  struct RestShape {
    int64_t n_tokens, vocab, hidden, row_padding;
  };
  for (const RestShape shape : {RestShape{300, 1999, 72, 0}, RestShape{200, 1000, 37, 0}, RestShape{2, 503, 16, 0},
                                RestShape{40, 5, 64, 0}, RestShape{300, 1024, 64, 8}, RestShape{300, 2000, 64, 0},
                                RestShape{2, 504, 16, 0}}) {
    for (const Loss& loss : losses()) {
      SCOPED_TRACE(cat(loss.name, " N ", shape.n_tokens, " V ", shape.vocab, " H ", shape.hidden, " padding ",
                       shape.row_padding));
      const lmloss_loss_options& o = loss.options;
      const reference::Problem p = rounded(
          gen.problem({.n_tokens = shape.n_tokens, .vocab = shape.vocab, .hidden = shape.hidden, .top_k = loss.top_k}),
          dtype());
      const int64_t vocab = p.vocab, hidden = p.hidden, ld = hidden + shape.row_padding;
      ctx.set_workspace_budget(budget_for_rows(64, vocab, hidden));

      const TwoBatches batches(p, first_batch_rows(shape.n_tokens), device(), dtype());

      // The pair, its rests first set to +127 (half an ulp), which a value left unwritten would show.
      Buffer kept(device(), dtype(), 2, vocab, hidden, ld);
      Buffer rests(device(), LMLOSS_U8, 2, vocab, hidden, hidden + 2 * shape.row_padding);
      kept.poison();
      rests.poison();
      for (int64_t i = 0; i < vocab * hidden; ++i) rests.set_id(i, 127);
      rests.snapshot();
      kept.upload();
      rests.upload();
      lmloss_loss_options kept_options = o;
      kept_options.grad_weight_sum_tail = rests.tensor();
      ASSERT_NO_FATAL_FAILURE(batches.run(ctx.get(), kept.tensor(), kept_options));
      ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      kept.download();
      rests.download();
      EXPECT_TRUE(fully_written(kept));
      EXPECT_TRUE(rests.padding_untouched());

      const Buffer wide = batches.f32_sum(ctx.get(), o);

      // The pair read back against the f32 sum, relative over all of dW; the values alone beside it.
      const int64_t count = vocab * hidden;
      double err = 0, err_values = 0, norm = 0;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t byte = rests.get_id(i);
        const auto rest = int8_t(byte >= 128 ? byte - 256 : byte);
        const double want = wide.get(i), value = kept.get(i);
        const double pair = lmloss::core::rest_join(float(value), rest);
        err += (pair - want) * (pair - want);
        err_values += (value - want) * (value - want);
        norm += want * want;
      }
      EXPECT_LT(std::sqrt(err / norm), 3e-5) << "the values alone: " << std::sqrt(err_values / norm);
      EXPECT_GT(std::sqrt(err_values / norm), 3e-4);  // what the check tells apart

      // Rounded with a scale: each value bf16(0.75 (hi + r unit)) of the pair as read above, exactly
      // (the same f32 arithmetic on every device); the rests only read.
      const std::vector<double> values_before = kept.values();
      rests.snapshot();
      Buffer scale = Buffer::of_values(device(), LMLOSS_F32, {0.75}, 0, 1);
      scale.upload();
      const lmloss_tensor kept_t = kept.tensor(), rests_t = rests.tensor(), scale_t = scale.tensor();
      ASSERT_EQ(lmloss_round_grad_weight(ctx.get(), &kept_t, &rests_t, &scale_t), LMLOSS_SUCCESS)
          << lmloss_last_error();
      ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      kept.download();
      rests.download();
      EXPECT_TRUE(rests.untouched());
      EXPECT_TRUE(kept.padding_untouched());
      int64_t misrounded = 0;
      for (int64_t i = 0; i < count; ++i) {
        const int64_t byte = rests.get_id(i);
        const float joined = lmloss::core::rest_join(float(values_before[i]), int8_t(byte >= 128 ? byte - 256 : byte));
        misrounded += kept.get(i) != double(lmloss::core::rest_bf16_value(lmloss::core::rest_bf16_bits(0.75f * joined)));
      }
      EXPECT_EQ(misrounded, 0);
      // And so as the f32 sum rounds, but for values the pair's ~1e-5 puts across a rounding
      // boundary: most where the chunks cancel (4 of 320 at V 5 on an H100), where a small value
      // may be ulps off (the pair's error is relative to the running sum).
      EXPECT_TRUE(rounded_once_from(kept, wide, count, 0.75f, 0, 0.03, 0x1p-13));

      EXPECT_TRUE(close_to(kept.values(), batches.reference_sum(o, 0.75), tolerance(dtype())));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(, KeptWeightSum,
                         ::testing::Combine(all_devices, ::testing::Values(LMLOSS_BF16, LMLOSS_F16)), ParamName{});

}  // namespace
}  // namespace lmloss::test
