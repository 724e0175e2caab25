// Bad input, one test per validation rule: the status, a message that starts with the
// argument's name as the header spells it, and every output byte still as it was poisoned.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "harness.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::test {
namespace {

// Every argument of a loss call, as descriptors a test can break one at a time.
struct LossArgs {
  lmloss_head head;
  lmloss_targets targets;
  lmloss_loss_options options;
  lmloss_tensor loss, lse, grad_loss;
  lmloss_grads grads;
};

LossArgs args_of(const LossCase& c) {
  return {c.head(), c.targets(), c.options, c.loss_tensor(), c.lse_tensor(),
          c.grad_loss_tensor(), c.grads()};
}

// Stores `value` in one of the C API's enum fields as a C caller may, whatever its enumerators
// (in C++ a static_cast of such a value is itself undefined).
template <class Enum>
void store_raw(Enum& field, int value) {
  static_assert(sizeof(Enum) == sizeof(int));
  std::memcpy(&field, &value, sizeof value);
}

lmloss_status call(lmloss_context* ctx, Mode mode, const LossArgs& a) {
  switch (mode) {
    case Mode::forward:
      return lmloss_loss_forward(ctx, &a.head, &a.targets, &a.options, &a.loss, &a.lse);
    case Mode::backward:
      return lmloss_loss_backward(ctx, &a.head, &a.targets, &a.options, &a.lse, &a.grad_loss,
                                  &a.grads);
    case Mode::forward_backward:
      return lmloss_loss_forward_backward(ctx, &a.head, &a.targets, &a.options, &a.grad_loss,
                                          &a.loss, &a.lse, &a.grads);
  }
  return LMLOSS_ERROR_INTERNAL;
}

class Validation : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { LMLOSS_REQUIRE_DEVICE(GetParam()); }
  Device device() const { return GetParam(); }

  // CE mixed with distillation from logits: labels, teacher, mask, lse and grad_logits present.
  LossCase logits_case(lmloss_loss_options o = lmloss_loss_options_default()) {
    Generator gen(401);
    o.kd_weight = 0.5;
    LossSetup s;
    s.device = device();
    return LossCase(gen.problem({.n_tokens = 6, .vocab = 37, .top_k = 3, .mask = true}), o, s);
  }
  LossCase linear_case(lmloss_loss_options o = lmloss_loss_options_default()) {
    Generator gen(402);
    LossSetup s;
    s.device = device();
    return LossCase(gen.problem({.n_tokens = 6, .vocab = 37, .hidden = 8, .bias = true}), o, s);
  }
  TopkCase topk_case(int64_t k = 3, int64_t hidden = 0) {
    Generator gen(403);
    lmloss_topk_options o = lmloss_topk_options_default();
    o.k = k;
    o.renormalize = 0;
    TopkSetup s;
    s.device = device();
    return TopkCase(gen.problem({.n_tokens = 6, .vocab = 37, .hidden = hidden, .labels = false}), o, s);
  }

  // The call fails with `status`, names `argument` first, and leaves every output as poisoned.
  template <typename Case>
  void expect_rejected(Case& c, lmloss_status status, const std::string& argument,
                       const std::function<lmloss_status()>& run) {
    const lmloss_status got = c.invoke(ctx.get(), run);
    const std::string message = lmloss_last_error();
    EXPECT_EQ(got, status) << "message: " << message;
    EXPECT_EQ(message.rfind(argument, 0), 0u)
        << "the message should start with \"" << argument << "\": " << message;
    for (const Buffer* b : c.outputs()) EXPECT_TRUE(untouched(*b));
  }
  void expect_loss_rejected(LossCase& c, const LossArgs& a, const std::string& argument,
                            Mode mode = Mode::forward_backward) {
    expect_rejected(c, LMLOSS_ERROR_INVALID_ARGUMENT, argument,
                    [&] { return call(ctx.get(), mode, a); });
  }
  void expect_topk_rejected(TopkCase& c, const lmloss_topk_options& o, const std::string& argument,
                            std::function<void(lmloss_tensor&, lmloss_tensor&, lmloss_tensor&,
                                               lmloss_head&)> edit = {}) {
    expect_rejected(c, LMLOSS_ERROR_INVALID_ARGUMENT, argument, [&] {
      lmloss_head h = c.head();
      lmloss_tensor ids = c.ids.tensor(), probs = c.probs.tensor(), tail = c.tail.tensor();
      if (edit) edit(ids, probs, tail, h);
      return lmloss_topk(ctx.get(), &h, &o, &ids, &probs, &tail);
    });
  }
  // A bad id: caught before writing on the CPU; on a GPU it may instead be found on the device
  // and reported by the synchronize that follows the call (outputs then hold NaN losses).
  void expect_bad_id(LossCase& c, const std::string& argument) {
    const LossArgs a = args_of(c);
    if (device() == Device::cpu) {
      expect_loss_rejected(c, a, argument);
      return;
    }
    const lmloss_status got = c.invoke(ctx.get(), [&] { return call(ctx.get(), Mode::forward_backward, a); });
    EXPECT_TRUE(got == LMLOSS_ERROR_INVALID_ARGUMENT || got == LMLOSS_ERROR_ID_OUT_OF_RANGE)
        << lmloss_status_string(got) << ": " << lmloss_last_error();
    EXPECT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS) << "the flag is cleared";
  }

  lmloss::Context ctx;
};

TEST_P(Validation, NullContext) {
  LossCase c = logits_case();
  const LossArgs a = args_of(c);
  for (Mode mode : {Mode::forward, Mode::backward, Mode::forward_backward}) {
    expect_rejected(c, LMLOSS_ERROR_INVALID_ARGUMENT, "context",
                    [&] { return call(nullptr, mode, a); });
  }
  TopkCase t = topk_case();
  expect_rejected(t, LMLOSS_ERROR_INVALID_ARGUMENT, "context", [&] {
    const lmloss_head h = t.head();
    const lmloss_tensor ids = t.ids.tensor(), probs = t.probs.tensor(), tail = t.tail.tensor();
    return lmloss_topk(nullptr, &h, &t.options, &ids, &probs, &tail);
  });
}

TEST_P(Validation, ShapeMismatchNamesTheArgument) {
  struct Rule {
    const char* argument;
    bool linear;
    std::function<void(LossArgs&)> edit;
  };
  const Rule rules[] = {
      {"targets.labels", false, [](LossArgs& a) { a.targets.labels.shape[0] += 1; }},
      {"targets.teacher_probs", false, [](LossArgs& a) { a.targets.teacher_probs.shape[1] -= 1; }},
      {"targets.teacher_ids", false, [](LossArgs& a) { a.targets.teacher_ids.shape[0] -= 1; }},
      {"targets.token_mask", false, [](LossArgs& a) { a.targets.token_mask.shape[0] -= 1; }},
      {"grads.grad_logits", false, [](LossArgs& a) { a.grads.grad_logits.shape[1] -= 1; }},
      {"lse", false, [](LossArgs& a) { a.lse.shape[0] -= 1; }},
      {"head.weight", true, [](LossArgs& a) { a.head.weight.shape[1] -= 1; }},
      {"head.bias", true, [](LossArgs& a) { a.head.bias.shape[0] += 1; }},
      {"grads.grad_hidden", true, [](LossArgs& a) { a.grads.grad_hidden.shape[0] -= 1; }},
      {"grads.grad_weight", true, [](LossArgs& a) { a.grads.grad_weight.shape[1] -= 1; }},
      {"grads.grad_bias", true, [](LossArgs& a) { a.grads.grad_bias.shape[0] -= 1; }},
  };
  for (const Rule& rule : rules) {
    SCOPED_TRACE(rule.argument);
    LossCase c = rule.linear ? linear_case() : logits_case();
    LossArgs a = args_of(c);
    rule.edit(a);
    expect_loss_rejected(c, a, rule.argument);
  }
}

TEST_P(Validation, WrongDtype) {
  struct Rule {
    const char* argument;
    bool linear;
    std::function<void(LossArgs&)> edit;
  };
  const Rule rules[] = {
      {"targets.labels", false, [](LossArgs& a) { a.targets.labels.dtype = LMLOSS_F32; }},
      {"head.logits", false, [](LossArgs& a) { a.head.logits.dtype = LMLOSS_I32; }},
      {"targets.teacher_probs", false, [](LossArgs& a) { a.targets.teacher_probs.dtype = LMLOSS_BF16; }},
      {"targets.teacher_ids", false, [](LossArgs& a) { a.targets.teacher_ids.dtype = LMLOSS_F32; }},
      {"targets.token_mask", false, [](LossArgs& a) { a.targets.token_mask.dtype = LMLOSS_F32; }},
      {"grads.grad_logits", false, [](LossArgs& a) { a.grads.grad_logits.dtype = LMLOSS_F16; }},
      {"loss", false, [](LossArgs& a) { a.loss.dtype = LMLOSS_BF16; }},
      {"lse", false, [](LossArgs& a) { a.lse.dtype = LMLOSS_I32; }},
      {"head.weight", true, [](LossArgs& a) { a.head.weight.dtype = LMLOSS_BF16; }},
      {"grads.grad_hidden", true, [](LossArgs& a) { a.grads.grad_hidden.dtype = LMLOSS_F16; }},
  };
  for (const Rule& rule : rules) {
    SCOPED_TRACE(rule.argument);
    LossCase c = rule.linear ? linear_case() : logits_case();
    LossArgs a = args_of(c);
    rule.edit(a);
    expect_loss_rejected(c, a, rule.argument);
  }
}

TEST_P(Validation, StrideBelowRowLength) {
  {
    LossCase c = logits_case();
    LossArgs a = args_of(c);
    a.head.logits.stride = a.head.logits.shape[1] - 1;
    expect_loss_rejected(c, a, "head.logits");
  }
  {
    LossCase c = logits_case();
    LossArgs a = args_of(c);
    a.grads.grad_logits.stride = 3;
    expect_loss_rejected(c, a, "grads.grad_logits");
  }
  {
    LossCase c = linear_case();
    LossArgs a = args_of(c);
    a.head.hidden.stride = a.head.hidden.shape[1] - 1;
    expect_loss_rejected(c, a, "head.hidden");
  }
  TopkCase t = topk_case();
  expect_topk_rejected(t, t.options, "head.logits",
                       [](lmloss_tensor&, lmloss_tensor&, lmloss_tensor&, lmloss_head& h) {
                         h.logits.stride = 1;
                       });
  {  // a stride equal to the row length is the contiguous layout, spelled out: taken
    LossCase c = logits_case();
    LossArgs a = args_of(c);
    a.head.logits.stride = a.head.logits.shape[1];
    a.grads.grad_logits.stride = a.grads.grad_logits.shape[1];
    EXPECT_EQ(c.invoke(ctx.get(), [&] { return call(ctx.get(), Mode::forward_backward, a); }), LMLOSS_SUCCESS)
        << lmloss_last_error();
    expect_matches_reference(c, Mode::forward_backward);
  }
}

TEST_P(Validation, TopkKZero) {
  TopkCase t = topk_case();
  lmloss_topk_options o = t.options;
  o.k = 0;
  expect_topk_rejected(t, o, "options.k");
}

TEST_P(Validation, TopkKAboveVocabulary) {
  TopkCase t = topk_case(38);  // vocab 37; outputs sized for k = 38
  expect_topk_rejected(t, t.options, "options.k");
}

TEST_P(Validation, TopkVocabularyBeyondItsIds) {
  // ids are i32: a vocabulary of 2^31 entries is refused before anything is read (the logits
  // described here are far larger than the buffer behind them).
  TopkCase t = topk_case();
  expect_topk_rejected(t, t.options, "head.logits",
                       [](lmloss_tensor&, lmloss_tensor&, lmloss_tensor&, lmloss_head& h) {
                         h.logits.shape[0] = 1;
                         h.logits.shape[1] = int64_t(1) << 31;
                         h.logits.stride = 0;
                       });
}

TEST_P(Validation, TopkRenormalizeNotZeroOrOne) {
  for (const int32_t bad : {2, -1}) {  // a flag in an int: any other value may mean anything
    SCOPED_TRACE(bad);
    TopkCase t = topk_case();
    lmloss_topk_options o = t.options;
    o.renormalize = bad;
    expect_topk_rejected(t, o, "options.renormalize");
  }
}

TEST_P(Validation, TopkOutputs) {
  TopkCase t = topk_case();
  expect_topk_rejected(t, t.options, "ids",
                       [](lmloss_tensor& ids, lmloss_tensor&, lmloss_tensor&, lmloss_head&) {
                         ids.dtype = LMLOSS_F32;
                       });
  expect_topk_rejected(t, t.options, "probs",
                       [](lmloss_tensor&, lmloss_tensor& probs, lmloss_tensor&, lmloss_head&) {
                         probs.shape[1] += 1;
                       });
  expect_topk_rejected(t, t.options, "tail",
                       [](lmloss_tensor&, lmloss_tensor&, lmloss_tensor& tail, lmloss_head&) {
                         tail.shape[0] -= 1;
                       });
}

TEST_P(Validation, LabelOutOfRange) {
  for (const int64_t bad : {int64_t{37}, int64_t{-5}}) {  // vocab 37; -5 is not ignore_index
    SCOPED_TRACE(bad);
    LossCase c = logits_case();
    c.labels.set_id(5, bad);  // the last token: a check that writes as it goes is caught
    expect_bad_id(c, "targets.labels");
  }
  LossCase c = linear_case();
  c.labels.set_id(5, 1000);
  expect_bad_id(c, "targets.labels");
}

TEST_P(Validation, TeacherIdOutOfRange) {
  for (const int64_t bad : {int64_t{37}, int64_t{-1}}) {
    SCOPED_TRACE(bad);
    LossCase c = logits_case();
    c.labels.set_id(5, 4);  // token 5 counted: an uncounted token's teacher row is never read
    c.token_mask.set_id(5, 1);
    c.teacher_ids.set_id(5 * 3 + 2, bad);
    expect_bad_id(c, "targets.teacher_ids");
  }
}

// A teacher's top-k is at most the vocabulary: here vocab + 1 columns, really allocated, of ids
// that are each in range (so only the width is wrong).
TEST_P(Validation, TeacherTopKAboveVocabulary) {
  LossCase c = logits_case();  // vocab 37
  const int64_t n = 6, k = 38;
  std::vector<int64_t> ids(size_t(n * k));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t(i % 37);
  Buffer teacher_ids = Buffer::of_ids(device(), LMLOSS_I32, ids, 2, n, k);
  Buffer teacher_probs = Buffer::of_values(device(), LMLOSS_F32, std::vector<double>(size_t(n * k), 1.0 / k), 2, n, k);
  teacher_ids.upload();
  teacher_probs.upload();
  LossArgs a = args_of(c);
  a.targets.teacher_ids = teacher_ids.tensor();
  a.targets.teacher_probs = teacher_probs.tensor();
  expect_loss_rejected(c, a, "targets.teacher_ids");
}

TEST_P(Validation, TemperatureNotPositive) {
  for (const double t : {0.0, -1.0, double(NAN)}) {
    SCOPED_TRACE(t);
    LossCase c = logits_case();
    LossArgs a = args_of(c);
    a.options.temperature = t;
    expect_loss_rejected(c, a, "options.temperature");
    TopkCase k = topk_case();
    lmloss_topk_options o = k.options;
    o.temperature = t;
    expect_topk_rejected(k, o, "options.temperature");
  }
}

TEST_P(Validation, SoftcapNegative) {
  LossCase c = logits_case();
  LossArgs a = args_of(c);
  a.options.softcap = -1;
  expect_loss_rejected(c, a, "options.softcap");
  TopkCase k = topk_case();
  lmloss_topk_options o = k.options;
  o.softcap = -0.5;
  expect_topk_rejected(k, o, "options.softcap");
}

TEST_P(Validation, LabelSmoothingOutsideUnitInterval) {
  for (const double eps : {-0.1, 1.5, 1.0 + 1e-9}) {  // the interval is closed: just above 1 is out
    SCOPED_TRACE(eps);
    LossCase c = logits_case();
    LossArgs a = args_of(c);
    a.options.label_smoothing = eps;
    expect_loss_rejected(c, a, "options.label_smoothing");
  }
}

// eps = 1, the closed end of [0, 1]: every label's weight spread evenly over the vocabulary.
TEST_P(Validation, LabelSmoothingOfOneIsAccepted) {
  lmloss_loss_options o = lmloss_loss_options_default();
  o.label_smoothing = 1.0;
  LossCase c = logits_case(o);
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  expect_matches_reference(c, Mode::forward_backward);
}

TEST_P(Validation, NegativeZLoss) {
  LossCase c = logits_case();
  LossArgs a = args_of(c);
  a.options.z_loss = -1e-3;
  expect_loss_rejected(c, a, "options.z_loss");
}

TEST_P(Validation, LossShapeMustFitTheReduction) {
  {
    // reduction none wants (n_tokens); a scalar is given.
    lmloss_loss_options o = lmloss_loss_options_default();
    o.reduction = LMLOSS_REDUCTION_NONE;
    LossCase c = logits_case(o);
    LossArgs a = args_of(c);
    a.loss.ndim = 0;
    a.loss.shape[0] = 0;
    expect_loss_rejected(c, a, "loss", Mode::forward);
  }
  {
    LossCase c = logits_case();  // mean wants a scalar; a vector is given
    LossArgs a = args_of(c);
    a.loss.ndim = 1;
    a.loss.shape[0] = 6;
    expect_loss_rejected(c, a, "loss", Mode::forward);
  }
  {
    LossCase c = logits_case();  // an upstream vector for a scalar loss
    LossArgs a = args_of(c);
    Buffer upstream = Buffer::of_values(device(), LMLOSS_F32, std::vector<double>(6, 1.0), 1, 6);
    upstream.upload();
    a.grad_loss = upstream.tensor();
    expect_loss_rejected(c, a, "grad_loss", Mode::backward);
  }
}

// Enum fields holding values no enumerator has (tests/test_c_enums.c calls the functions that
// take an enum by value, which C++ cannot do with such a value).
TEST_P(Validation, UnknownEnumValues) {
  for (int value : {-1, 4, 7, 1 << 20}) {
    SCOPED_TRACE(value);
    {
      LossCase c = logits_case();
      LossArgs a = args_of(c);
      store_raw(a.options.reduction, value);
      expect_loss_rejected(c, a, "options.reduction");
    }
    {
      LossCase c = logits_case();
      LossArgs a = args_of(c);
      store_raw(a.targets.labels.dtype, value + 16);
      expect_loss_rejected(c, a, "targets.labels");
    }
    {
      LossCase c = linear_case();
      LossArgs a = args_of(c);
      store_raw(a.head.weight.dtype, -value - 8);
      expect_loss_rejected(c, a, "head.weight");
    }
    {
      LossCase c = linear_case();
      LossArgs a = args_of(c);
      store_raw(a.grads.grad_hidden.device_type, value);
      expect_loss_rejected(c, a, "grads.grad_hidden");
    }
  }
}

TEST_P(Validation, BadOptionValues) {
  {
    LossCase c = logits_case();
    LossArgs a = args_of(c);
    a.options.struct_size = 3;
    expect_loss_rejected(c, a, "options.struct_size");
  }
  {
    LossCase c = logits_case();
    LossArgs a = args_of(c);
    a.options.normalizer = -2;
    expect_loss_rejected(c, a, "options.normalizer");
  }
  // The weights must be finite; a zero weight alone is fine, so only NaN and inf are bad.
  for (const double bad : {double(NAN), double(INFINITY)}) {
    SCOPED_TRACE(bad);
    {
      LossCase c = logits_case();
      LossArgs a = args_of(c);
      a.options.ce_weight = bad;
      expect_loss_rejected(c, a, "options.ce_weight");
    }
    {
      LossCase c = logits_case();  // has a teacher, so the kd weight is used
      LossArgs a = args_of(c);
      a.options.kd_weight = bad;
      expect_loss_rejected(c, a, "options.kd_weight");
    }
  }
}

TEST_P(Validation, MissingTargets) {
  {
    LossCase c = logits_case();  // cross-entropy weight without labels
    LossArgs a = args_of(c);
    a.targets.labels = lmloss_tensor_none();
    a.targets.token_mask = lmloss_tensor_none();
    a.targets.teacher_ids = lmloss_tensor_none();
    a.targets.teacher_probs = lmloss_tensor_none();
    expect_loss_rejected(c, a, "targets");
  }
  {
    LossCase c = logits_case();  // distillation weight without a teacher
    LossArgs a = args_of(c);
    a.targets.teacher_ids = lmloss_tensor_none();
    a.targets.teacher_probs = lmloss_tensor_none();
    expect_loss_rejected(c, a, "targets.teacher_ids");
  }
}

TEST_P(Validation, GradientOfTheWrongHead) {
  LossCase c = linear_case();
  LossArgs a = args_of(c);
  a.grads.grad_logits = a.head.hidden;  // logits gradients for a linear head
  expect_loss_rejected(c, a, "grads.grad_logits");
}

TEST_P(Validation, GradBiasWithoutHeadBias) {
  LossCase c = linear_case();
  LossArgs a = args_of(c);
  a.head.bias = lmloss_tensor_none();  // grads.grad_bias, of the right shape, stays
  expect_loss_rejected(c, a, "grads.grad_bias");
}

TEST_P(Validation, InPlaceWithAnotherStride) {
  LossSetup s;
  s.device = device();
  s.in_place = true;
  s.row_padding = 3;
  Generator gen(404);
  LossCase c(gen.problem({.n_tokens = 6, .vocab = 37}), lmloss_loss_options_default(), s);
  LossArgs a = args_of(c);
  a.grads.grad_logits.stride = 0;  // same memory, read with another row stride
  expect_loss_rejected(c, a, "grads.grad_logits");
}

TEST_P(Validation, BudgetTooSmallForOneRow) {
  LossCase c = linear_case();
  ctx.set_workspace_budget(64);
  const LossArgs a = args_of(c);
  expect_loss_rejected(c, a, "context workspace budget");
  // Through the head: a chunk of logits needs workspace on every backend (top-k over given
  // logits may need none).
  TopkCase t = topk_case(3, 8);
  expect_topk_rejected(t, t.options, "context workspace budget");
}

TEST_P(Validation, ZeroWorkspaceBudget) {
  ASSERT_EQ(lmloss_context_set_workspace_budget(ctx.get(), size_t(1) << 20), LMLOSS_SUCCESS);
  EXPECT_EQ(lmloss_context_set_workspace_budget(ctx.get(), 0), LMLOSS_ERROR_INVALID_ARGUMENT);
  const std::string message = lmloss_last_error();
  EXPECT_EQ(message.rfind("bytes", 0), 0u) << "the message should start with \"bytes\": " << message;
  size_t budget = 0;
  ASSERT_EQ(lmloss_context_get_workspace_budget(ctx.get(), &budget), LMLOSS_SUCCESS);
  EXPECT_EQ(budget, size_t(1) << 20) << "a refused budget leaves the one before";
}

TEST_P(Validation, CudaTensorsWithoutCuda) {
  if (device() != Device::cpu) GTEST_SKIP() << "a CPU-only check";
  if (lmloss_backend_available(LMLOSS_DEVICE_CUDA)) GTEST_SKIP() << "a CUDA device is available";
  // Host memory described as CUDA memory: it must be refused before anything reads it.
  LossCase c = logits_case();
  LossArgs a = args_of(c);
  for (lmloss_tensor* t : {&a.head.logits, &a.targets.labels, &a.targets.teacher_ids,
                           &a.targets.teacher_probs, &a.targets.token_mask, &a.loss, &a.lse,
                           &a.grads.grad_logits}) {
    t->device_type = LMLOSS_DEVICE_CUDA;
  }
  const lmloss_status got =
      c.invoke(ctx.get(), [&] { return call(ctx.get(), Mode::forward_backward, a); });
  EXPECT_EQ(got, LMLOSS_ERROR_UNSUPPORTED) << lmloss_last_error();
  EXPECT_STRNE(lmloss_last_error(), "");
  for (const Buffer* b : c.outputs()) EXPECT_TRUE(untouched(*b));
}

// One tensor with another device_index than the rest is refused and named (on the CPU, where
// the index must be 0, as the odd one out; on CUDA as on another device than the first tensor).
TEST_P(Validation, TensorOnAnotherDeviceIndex) {
  LossCase c = logits_case();
  LossArgs a = args_of(c);
  a.targets.labels.device_index = a.head.logits.device_index + 1;
  expect_loss_rejected(c, a, "targets.labels");
}

TEST_P(Validation, CpuDeviceIndexNotZero) {
  if (device() != Device::cpu) GTEST_SKIP() << "a CPU-only rule";
  LossCase c = logits_case();
  LossArgs a = args_of(c);
  for (lmloss_tensor* t : {&a.head.logits, &a.targets.labels, &a.targets.teacher_ids, &a.targets.teacher_probs,
                           &a.targets.token_mask, &a.loss, &a.lse, &a.grads.grad_logits}) {
    t->device_index = 1;  // all alike, so only the rule for CPU memory refuses them
  }
  expect_loss_rejected(c, a, "head.logits");
}

// A kept f32 sum of a 16-bit grad_weight (options.grad_weight_sum_tail): every layout rule, and
// the tail's own outputs untouched with the call's.
TEST_P(Validation, KeptWeightSumTail) {
  Generator gen(405);
  const int64_t vocab = 37, hidden = 8, least = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(int64_t(37));  // 21: 16 rows in place
  auto bf16_case = [&](int64_t row_padding = 0) {
    LossSetup s;
    s.device = device();
    s.dtype = LMLOSS_BF16;
    s.grad_dtype = LMLOSS_BF16;
    s.row_padding = row_padding;
    return LossCase(gen.problem({.n_tokens = 6, .vocab = vocab, .hidden = hidden, .bias = true}),
                    lmloss_loss_options_default(), s);
  };
  auto expect_tail_rejected = [&](LossCase& c, Buffer& tail, const std::string& argument,
                                  const std::function<void(LossArgs&)>& edit) {
    tail.poison();
    tail.upload();
    LossArgs a = args_of(c);
    a.options.grad_weight_sum_tail = tail.tensor();
    edit(a);
    expect_loss_rejected(c, a, argument);
    tail.download();
    EXPECT_TRUE(untouched(tail));
  };
  auto no_edit = [](LossArgs&) {};
  {  // too few rows: more than half the vocabulary in grad_weight's bytes
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_F32, 2, vocab / 2, hidden);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", no_edit);
  }
  {  // more rows than the vocabulary
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_F32, 2, vocab + 1, hidden);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", no_edit);
  }
  {  // rows in place not a multiple of 8
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_F32, 2, least + 1, hidden);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", no_edit);
  }
  {  // rows in place a multiple of 4 but not of 8 (37 - 25 = 12)
    LossCase c = bf16_case();
    SCOPED_TRACE("split 12");
    Buffer tail(device(), LMLOSS_F32, 2, 25, hidden);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", no_edit);
  }
  {  // another width
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_F32, 2, least, hidden + 1);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", no_edit);
  }
  {  // not f32
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_BF16, 2, least, hidden);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", no_edit);
  }
  {  // rows in place in a padded grad_weight (a tail of every row would be fine)
    LossCase c = bf16_case(2);
    Buffer tail(device(), LMLOSS_F32, 2, least, hidden);
    expect_tail_rejected(c, tail, "grads.grad_weight", no_edit);
  }
  {  // an f32 grad_weight is the sum itself
    LossCase c = linear_case();
    Buffer tail(device(), LMLOSS_F32, 2, least, hidden);
    expect_tail_rejected(c, tail, "grads.grad_weight", no_edit);
  }
  {  // over grad_weight's own bytes
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_F32, 2, least, hidden);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", [&](LossArgs& a) {
      a.options.grad_weight_sum_tail.data = static_cast<char*>(a.grads.grad_weight.data) + 64;
    });
  }
  // Overlaps in bytes: grad_weight has 2 a weight, the tail 4 (a range counted at 1 byte a weight
  // would cover only the first half or quarter). Both live in one f32 buffer of rows of `hidden`
  // (32 bytes), so that a wrongly accepted call writes only there, and every byte of it is checked.
  const int64_t row_bytes = hidden * 4, grad_bytes = vocab * hidden * 2, tail_bytes = least * row_bytes;
  auto move_into = [&](LossArgs& a, int64_t grad_offset, int64_t tail_offset) {
    char* base = static_cast<char*>(a.options.grad_weight_sum_tail.data);
    a.grads.grad_weight.data = base + grad_offset;
    a.options.grad_weight_sum_tail.data = base + tail_offset;
    a.options.grad_weight_sum_tail.shape[0] = least;
  };
  {  // the tail starts about three quarters into grad_weight's bytes (416 of 592), past its first half
    SCOPED_TRACE("tail inside grad_weight's second half");
    const int64_t start = grad_bytes * 3 / 4 / row_bytes * row_bytes;
    LossCase c = bf16_case();
    Buffer both(device(), LMLOSS_F32, 2, (start + tail_bytes) / row_bytes, hidden);
    expect_tail_rejected(c, both, "options.grad_weight_sum_tail",
                         [&](LossArgs& a) { move_into(a, 0, start); });
  }
  {  // the tail starts before grad_weight and runs into it: grad_weight starts in its last row
    SCOPED_TRACE("tail running into grad_weight");
    const int64_t start = tail_bytes - row_bytes;
    LossCase c = bf16_case();
    Buffer both(device(), LMLOSS_F32, 2, (start + grad_bytes + row_bytes - 1) / row_bytes, hidden);
    expect_tail_rejected(c, both, "options.grad_weight_sum_tail",
                         [&](LossArgs& a) { move_into(a, start, 0); });
  }
  {  // without the grad_weight it belongs to
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_F32, 2, least, hidden);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail",
                         [](LossArgs& a) { a.grads.grad_weight = lmloss_tensor_none(); });
  }
  // A u8 tail: the rests of a bf16 grad_weight's values, one for every weight.
  {  // the rows of an f32 tail, not every row
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_U8, 2, least, hidden);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", no_edit);
  }
  {  // another width
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_U8, 2, vocab, hidden + 1);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", no_edit);
  }
  {  // an f16 grad_weight
    LossSetup s;
    s.device = device();
    s.dtype = LMLOSS_F16;
    s.grad_dtype = LMLOSS_F16;
    LossCase c(gen.problem({.n_tokens = 6, .vocab = vocab, .hidden = hidden}), lmloss_loss_options_default(), s);
    Buffer tail(device(), LMLOSS_U8, 2, vocab, hidden);
    expect_tail_rejected(c, tail, "grads.grad_weight", no_edit);
  }
  {  // an f32 grad_weight
    LossCase c = linear_case();
    Buffer tail(device(), LMLOSS_U8, 2, c.problem().vocab, c.problem().hidden);
    expect_tail_rejected(c, tail, "grads.grad_weight", no_edit);
  }
  {  // over grad_weight's own bytes
    LossCase c = bf16_case();
    Buffer tail(device(), LMLOSS_U8, 2, vocab, hidden);
    expect_tail_rejected(c, tail, "options.grad_weight_sum_tail", [&](LossArgs& a) {
      a.options.grad_weight_sum_tail.data = static_cast<char*>(a.grads.grad_weight.data) + 16;
    });
  }
}

// Options of 0.1's and 0.2's sizes, before grad_weight_sum_tail and before grad_weight_deferred,
// are read without them: the fields' bytes (here pointers to nowhere) are the caller's, not the
// library's to read.
TEST_P(Validation, OptionsOfTheEarlierSizesHaveNoLaterFields) {
  for (const size_t size : {offsetof(lmloss_loss_options, grad_weight_sum_tail),
                            offsetof(lmloss_loss_options, grad_weight_deferred)}) {
    SCOPED_TRACE(cat("struct_size ", size));
    LossCase c = linear_case();
    LossArgs a = args_of(c);
    a.options.struct_size = uint32_t(size);
    if (size < offsetof(lmloss_loss_options, grad_weight_deferred))
      a.options.grad_weight_sum_tail = lmloss_tensor_2d(reinterpret_cast<void*>(uintptr_t(8)), LMLOSS_F32, 1, 1, 0);
    a.options.grad_weight_deferred = lmloss_tensor_1d(reinterpret_cast<void*>(uintptr_t(8)), LMLOSS_U8, 1);
    const lmloss_status got = c.invoke(ctx.get(), [&] { return call(ctx.get(), Mode::forward_backward, a); });
    EXPECT_EQ(got, LMLOSS_SUCCESS) << lmloss_last_error();
    expect_matches_reference(c, Mode::forward_backward);
  }
}

// A buffer for a step's deferred dW product (options.grad_weight_deferred) only where
// lmloss_loss_deferred_bytes sizes one: here none (the CPU defers nothing; on CUDA a vocabulary
// of 37 does not take the store), so any is refused, as are one without a kept sum, on a forward,
// of another dtype or rank, or misaligned; and lmloss_round_grad_weight_deferred's arguments.
TEST_P(Validation, DeferredWeightProductBuffer) {
  Generator gen(406);
  const int64_t vocab = 37, hidden = 8, least = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(int64_t(37));
  LossSetup s;
  s.device = device();
  s.dtype = LMLOSS_BF16;
  s.grad_dtype = LMLOSS_BF16;
  LossCase c(gen.problem({.n_tokens = 6, .vocab = vocab, .hidden = hidden}), lmloss_loss_options_default(), s);
  Buffer tail(device(), LMLOSS_F32, 2, least, hidden);
  Buffer buffer(device(), LMLOSS_U8, 1, 1024), wide(device(), LMLOSS_F32, 1, 256);
  lmloss_tensor aligned = buffer.tensor();  // 768 of its bytes from a multiple of 256 (host memory may not be)
  const uintptr_t skip = (256 - reinterpret_cast<uintptr_t>(aligned.data) % 256) % 256;
  aligned.data = static_cast<char*>(aligned.data) + skip;
  aligned.shape[0] = 768;
  LossArgs kept = args_of(c);
  kept.options.grad_weight_sum_tail = tail.tensor();

  size_t bytes = 1;
  EXPECT_EQ(lmloss_loss_deferred_bytes(ctx.get(), &kept.head, &kept.targets, &kept.options, &kept.grad_loss,
                                       &kept.loss, &kept.lse, &kept.grads, &bytes),
            LMLOSS_SUCCESS)
      << lmloss_last_error();
  EXPECT_EQ(bytes, size_t(0));
  EXPECT_EQ(lmloss_loss_deferred_bytes(ctx.get(), &kept.head, &kept.targets, &kept.options, &kept.grad_loss,
                                       &kept.loss, &kept.lse, &kept.grads, nullptr),
            LMLOSS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(lmloss_loss_deferred_bytes(nullptr, &kept.head, &kept.targets, &kept.options, &kept.grad_loss,
                                       &kept.loss, &kept.lse, &kept.grads, &bytes),
            LMLOSS_ERROR_INVALID_ARGUMENT);

  auto expect_buffer_rejected = [&](const std::function<void(LossArgs&)>& edit, Mode mode = Mode::forward_backward) {
    LossArgs a = kept;
    a.options.grad_weight_deferred = aligned;
    edit(a);
    expect_loss_rejected(c, a, "options.grad_weight_deferred", mode);
  };
  {
    SCOPED_TRACE("where nothing is deferred");
    expect_buffer_rejected([](LossArgs&) {});
    EXPECT_NE(std::string(lmloss_last_error()).find("nothing is deferred"), std::string::npos) << lmloss_last_error();
  }
  {
    SCOPED_TRACE("without a kept sum");
    expect_buffer_rejected([](LossArgs& a) { a.options.grad_weight_sum_tail = lmloss_tensor_none(); });
  }
  {
    SCOPED_TRACE("on a forward");
    expect_buffer_rejected([](LossArgs&) {}, Mode::forward);
  }
  {
    SCOPED_TRACE("not u8");
    expect_buffer_rejected([&](LossArgs& a) { a.options.grad_weight_deferred = wide.tensor(); });
  }
  {
    SCOPED_TRACE("not a vector");
    expect_buffer_rejected([&](LossArgs& a) {
      a.options.grad_weight_deferred = aligned;
      a.options.grad_weight_deferred.ndim = 2;
      a.options.grad_weight_deferred.shape[0] = 3;
      a.options.grad_weight_deferred.shape[1] = 256;
    });
  }
  {
    SCOPED_TRACE("misaligned");
    expect_buffer_rejected([](LossArgs& a) {
      a.options.grad_weight_deferred.data = static_cast<char*>(a.options.grad_weight_deferred.data) + 16;
      a.options.grad_weight_deferred.shape[0] -= 16;
    });
  }

  // The rounding given a deferred product: none to be had for this sum on either device.
  Buffer grad(device(), LMLOSS_BF16, 2, vocab, hidden);
  const int64_t one_row_bytes = 256 + 2 * (vocab + hidden);  // the layout of one token's product
  Buffer one_row(device(), LMLOSS_U8, 1, 256 + one_row_bytes);
  for (Buffer* b : {&grad, &tail, &one_row}) {
    b->poison();
    b->upload();
  }
  const lmloss_tensor g = grad.tensor(), t = tail.tensor();
  lmloss_tensor d = one_row.tensor();
  d.data = static_cast<char*>(d.data) + (256 - reinterpret_cast<uintptr_t>(d.data) % 256) % 256;
  d.shape[0] = one_row_bytes;
  EXPECT_EQ(lmloss_round_grad_weight_deferred(ctx.get(), &g, &t, nullptr, nullptr), LMLOSS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(lmloss_last_error()).rfind("deferred", 0), 0u) << lmloss_last_error();
  EXPECT_EQ(lmloss_round_grad_weight_deferred(ctx.get(), &g, &t, nullptr, &d), LMLOSS_ERROR_UNSUPPORTED);
  EXPECT_EQ(std::string(lmloss_last_error()).rfind("deferred", 0), 0u) << lmloss_last_error();
  const lmloss_tensor f = wide.tensor();
  EXPECT_EQ(lmloss_round_grad_weight_deferred(ctx.get(), &g, &t, nullptr, &f), LMLOSS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(lmloss_last_error()).rfind("deferred", 0), 0u) << lmloss_last_error();
  for (Buffer* b : {&grad, &tail, &one_row}) {
    b->download();
    EXPECT_TRUE(untouched(*b));
  }
}

TEST_P(Validation, RoundGradWeightArguments) {
  const int64_t vocab = 37, hidden = 8, least = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(int64_t(37));
  Buffer grad(device(), LMLOSS_BF16, 2, vocab, hidden);
  Buffer tail(device(), LMLOSS_F32, 2, least, hidden);
  Buffer scale = Buffer::of_values(device(), LMLOSS_F32, {0.5}, 0, 1);
  Buffer bf16_scale = Buffer::of_values(device(), LMLOSS_BF16, {0.5}, 0, 1);
  Buffer f32_grad(device(), LMLOSS_F32, 2, vocab, hidden);
  auto expect_round_rejected = [&](const std::string& argument, const std::function<lmloss_status()>& run) {
    for (Buffer* b : {&grad, &tail, &f32_grad}) {
      b->poison();
      b->upload();
    }
    scale.upload();
    bf16_scale.upload();
    EXPECT_EQ(run(), LMLOSS_ERROR_INVALID_ARGUMENT) << lmloss_last_error();
    const std::string message = lmloss_last_error();
    EXPECT_EQ(message.rfind(argument, 0), 0u) << "the message should start with \"" << argument << "\": " << message;
    for (Buffer* b : {&grad, &tail, &f32_grad}) {
      b->download();
      EXPECT_TRUE(untouched(*b));
    }
  };
  const lmloss_tensor g = grad.tensor(), t = tail.tensor(), s = scale.tensor();
  expect_round_rejected("grad_weight", [&] { return lmloss_round_grad_weight(ctx.get(), nullptr, &t, &s); });
  expect_round_rejected("tail", [&] { return lmloss_round_grad_weight(ctx.get(), &g, nullptr, &s); });
  expect_round_rejected("grad_weight", [&] {
    const lmloss_tensor f = f32_grad.tensor();
    return lmloss_round_grad_weight(ctx.get(), &f, &t, &s);
  });
  expect_round_rejected("tail", [&] {
    lmloss_tensor narrow = t;
    narrow.shape[0] = least - 8;
    return lmloss_round_grad_weight(ctx.get(), &g, &narrow, &s);
  });
  expect_round_rejected("scale", [&] {
    const lmloss_tensor b = bf16_scale.tensor();
    return lmloss_round_grad_weight(ctx.get(), &g, &t, &b);
  });
  EXPECT_EQ(lmloss_round_grad_weight(nullptr, &g, &t, &s), LMLOSS_ERROR_INVALID_ARGUMENT);
  {  // an odd vocabulary: a tail one row short of vocab - vocab / 2 would put 8 f32 rows (128
     // bytes) into the 120 bytes of 15 bf16 rows of 4
    Buffer odd(device(), LMLOSS_BF16, 2, 15, 4);
    Buffer short_tail(device(), LMLOSS_F32, 2, 7, 4);
    for (Buffer* b : {&odd, &short_tail}) {
      b->poison();
      b->upload();
    }
    const lmloss_tensor o = odd.tensor(), st = short_tail.tensor();
    EXPECT_EQ(lmloss_round_grad_weight(ctx.get(), &o, &st, nullptr), LMLOSS_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(lmloss_last_error()).rfind("tail", 0), 0u) << lmloss_last_error();
    for (Buffer* b : {&odd, &short_tail}) {
      b->download();
      EXPECT_TRUE(untouched(*b));
    }
  }
}

// `t` moved `elements` further into its buffer, its shape and stride kept.
lmloss_tensor moved(lmloss_tensor t, int64_t elements) {
  t.data = static_cast<char*>(t.data) + elements * int64_t(dtype_size(t.dtype));
  return t;
}

// An output that shares bytes with an input or another output is refused before anything is
// written (inputs included); rows interleaved with an input's in one buffer are not shared.
TEST_P(Validation, OverlappingOutputs) {
  auto expect_inputs_untouched = [](LossCase& c) {
    for (Buffer* b : {&c.hidden, &c.weight, &c.logits}) {
      if (!b->present()) continue;
      b->download();
      EXPECT_TRUE(b->untouched());
    }
  };
  auto padded_case = [&](int64_t hidden) {  // every matrix's rows padded to twice their length
    Generator gen(406);
    LossSetup s;
    s.device = device();
    s.row_padding = hidden == 0 ? 37 : hidden;
    LossCase c(gen.problem({.n_tokens = 6, .vocab = 37, .hidden = hidden}), lmloss_loss_options_default(), s);
    for (Buffer* b : {&c.hidden, &c.weight, &c.logits}) b->snapshot();
    return c;
  };
  {  // an input itself
    LossCase c = padded_case(8);
    LossArgs a = args_of(c);
    a.grads.grad_hidden = a.head.hidden;
    expect_loss_rejected(c, a, "grads.grad_hidden");
    expect_inputs_untouched(c);
  }
  {  // half of each row of an input
    LossCase c = padded_case(8);
    LossArgs a = args_of(c);
    a.grads.grad_hidden = moved(a.head.hidden, 4);
    expect_loss_rejected(c, a, "grads.grad_hidden");
    expect_inputs_untouched(c);
  }
  {  // the logits a row on: only the same tensor is an in-place gradient
    LossCase c = padded_case(0);
    LossArgs a = args_of(c);
    a.grads.grad_logits = moved(a.head.logits, 1);
    expect_loss_rejected(c, a, "grads.grad_logits");
    expect_inputs_untouched(c);
  }
  {  // two outputs
    LossCase c = linear_case();
    LossArgs a = args_of(c);
    a.grads.grad_bias.data = a.grads.grad_weight.data;
    expect_loss_rejected(c, a, "grads.grad_weight");
    a = args_of(c);
    a.lse.data = a.loss.data;
    expect_loss_rejected(c, a, "loss", Mode::forward);
  }
  {  // the backward's lse is an input
    LossCase c = linear_case();
    LossArgs a = args_of(c);
    a.lse.data = a.grads.grad_hidden.data;
    expect_loss_rejected(c, a, "grads.grad_hidden", Mode::backward);
  }
  {  // rows between an input's rows share nothing: taken, the input left as it was
    LossCase c = padded_case(8);
    LossArgs a = args_of(c);
    a.grads.grad_hidden = moved(a.head.hidden, 8);
    EXPECT_EQ(c.invoke(ctx.get(), [&] { return call(ctx.get(), Mode::forward_backward, a); }), LMLOSS_SUCCESS)
        << lmloss_last_error();
    ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS);
    c.hidden.download();
    for (int64_t i = 0; i < c.hidden.count(); ++i)
      ASSERT_EQ(c.hidden.get(i), c.problem().hidden_states[size_t(i)]) << "element " << i;
  }
  TopkCase t = topk_case();
  expect_topk_rejected(t, t.options, "ids",
                       [](lmloss_tensor& ids, lmloss_tensor& probs, lmloss_tensor&, lmloss_head&) {
                         probs.data = ids.data;
                       });
  expect_topk_rejected(t, t.options, "tail",
                       [](lmloss_tensor&, lmloss_tensor&, lmloss_tensor& tail, lmloss_head& h) {
                         tail.data = h.logits.data;
                       });
}

TEST_P(Validation, SuccessClearsTheLastError) {
  LossCase c = logits_case();
  LossArgs a = args_of(c);
  a.options.temperature = 0;
  expect_loss_rejected(c, a, "options.temperature");
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_STREQ(lmloss_last_error(), "");
}

INSTANTIATE_TEST_SUITE_P(, Validation, all_devices, ParamName{});

// ---- The C++ wrapper (lmloss.hpp): no device involved ------------------------------------

// A failed C call becomes lmloss::Error with the call's status and its last-error message (not
// the generic status string), and the refused setting leaves the context as it was.
TEST(CppApi, FailedCallThrowsErrorWithStatusAndMessage) {
  lmloss::Context ctx;
  ctx.set_workspace_budget(size_t(1) << 20);
  try {
    ctx.set_workspace_budget(0);
    ADD_FAILURE() << "a zero budget did not throw";
  } catch (const lmloss::Error& e) {
    EXPECT_EQ(e.status(), LMLOSS_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(e.what()).rfind("bytes", 0), 0u) << "not the call's message: " << e.what();
  }
  EXPECT_EQ(ctx.workspace_budget(), size_t(1) << 20);
}

// Every setter checks its status: a refused value throws rather than being dropped silently.
TEST(CppApi, RefusedSettingsThrow) {
  lmloss::Context ctx;
  EXPECT_THROW(ctx.set_num_threads(-1), lmloss::Error);  // 0 means all cores; below is refused
  EXPECT_NO_THROW(ctx.set_num_threads(0));
  lmloss_allocator half{};  // alloc without free
  half.alloc = [](void*, size_t, int32_t, void*) -> void* { return nullptr; };
  EXPECT_THROW(ctx.set_allocator(&half), lmloss::Error);
  EXPECT_NO_THROW(ctx.set_allocator(nullptr));
}

// A moved Context hands its handle over: exactly one Context owns each handle afterwards.
TEST(CppApi, ContextMoveTransfersTheHandle) {
  lmloss::Context a;
  a.set_workspace_budget(1000);
  lmloss_context* const handle = a.get();
  lmloss::Context b(std::move(a));
  EXPECT_EQ(b.get(), handle);
  EXPECT_EQ(a.get(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state is the point
  lmloss::Context c;
  c.set_workspace_budget(2000);
  c = std::move(b);
  EXPECT_EQ(c.get(), handle);
  EXPECT_EQ(c.workspace_budget(), 1000u);
  EXPECT_NE(b.get(), handle) << "two Contexts own one handle";  // NOLINT(bugprone-use-after-move)
}

// The tensor helpers describe exactly the view asked for: dtype, shape, stride, device.
TEST(CppApi, TensorHelpersDescribeTheView) {
  float x[24] = {};
  int32_t labels[5] = {};
  EXPECT_FALSE(lmloss::Tensor{}.present());
  const lmloss::Tensor m = lmloss::Tensor::matrix(x, 3, 4, 6);
  EXPECT_TRUE(m.present());
  EXPECT_EQ(m.data, static_cast<void*>(x));
  EXPECT_EQ(m.dtype, LMLOSS_F32);
  EXPECT_EQ(m.ndim, 2);
  EXPECT_EQ(m.shape[0], 3);
  EXPECT_EQ(m.shape[1], 4);
  EXPECT_EQ(m.stride, 6);
  const lmloss::Tensor v = lmloss::Tensor::vector(labels, 5);
  EXPECT_EQ(v.dtype, LMLOSS_I32);
  EXPECT_EQ(v.ndim, 1);
  EXPECT_EQ(v.shape[0], 5);
  const lmloss::Tensor g = m.on_cuda(2);
  EXPECT_EQ(g.device_type, LMLOSS_DEVICE_CUDA);
  EXPECT_EQ(g.device_index, 2);
  EXPECT_EQ(g.stride, 6);
  EXPECT_EQ(m.device_type, LMLOSS_DEVICE_CPU) << "on_cuda changed the original view";
  // Inputs held const describe as their type (the library only reads them).
  const std::vector<double> inputs(6);
  const lmloss::Tensor c = lmloss::Tensor::matrix(inputs.data(), 2, 3);
  EXPECT_EQ(c.data, static_cast<const void*>(inputs.data()));
  EXPECT_EQ(c.dtype, LMLOSS_F64);
  const int64_t ids[2] = {};
  EXPECT_EQ(lmloss::Tensor::vector(ids, 2).dtype, LMLOSS_I64);
  const float one = 1;
  EXPECT_EQ(lmloss::Tensor::scalar(&one).dtype, LMLOSS_F32);
}

}  // namespace
}  // namespace lmloss::test
