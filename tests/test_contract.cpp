// The rules of docs/contract.md section 6 that every backend keeps, one test each, named after
// the rule.
#include <cblas.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <string>

#include "harness.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::test {
namespace {

class Contract : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override { LMLOSS_REQUIRE_DEVICE(GetParam()); }
  Device device() const { return GetParam(); }
  LossSetup setup(lmloss_dtype dtype = LMLOSS_F32) const {
    LossSetup s;
    s.device = device();
    s.dtype = dtype;
    s.grad_dtype = dtype;
    return s;
  }
  lmloss::Context ctx;
};

lmloss_loss_options training_options() {
  lmloss_loss_options o = lmloss_loss_options_default();
  o.label_smoothing = 0.1;
  o.z_loss = 1e-4;
  o.softcap = 30;
  return o;
}

// Rule 1: the logits exist a chunk at a time, within the caller's budget.
TEST_P(Contract, NeverFullLogits) {
  Generator gen(501);
  const int64_t n = 256, V = 4099;
  const size_t full_logits = size_t(n) * size_t(V) * 4;
  const size_t budget = full_logits / 4;
  for (const bool linear : {true, false}) {
    for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
      SCOPED_TRACE(cat(linear ? "linear " : "logits ", dtype_name(dtype)));
      ProblemSpec spec{.n_tokens = n, .vocab = V, .hidden = linear ? 32 : 0, .bias = linear};
      LossCase c(gen.problem(spec), training_options(), setup(dtype));
      ctx.set_workspace_budget(budget);
      ctx.reset_peak_workspace();
      ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      const size_t peak = ctx.peak_workspace();
      EXPECT_GT(peak, 0u) << "workspace is not reported";
      EXPECT_LE(peak, budget);
      EXPECT_LT(peak, full_logits);
      expect_matches_reference(c, Mode::forward_backward);
    }
  }
}

// Rule 2: forward saves lse; a backward from it gives what the fused call gives.
TEST_P(Contract, SavesLse) {
  Generator gen(502);
  lmloss_loss_options o = training_options();
  o.kd_weight = 0.5;
  for (const int64_t hidden : {0, 16}) {
    SCOPED_TRACE(hidden ? "linear" : "logits");
    LossCase c(gen.problem({.n_tokens = 20, .vocab = 613, .hidden = hidden, .bias = hidden > 0,
                            .top_k = 4}),
               o, setup());
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    const std::vector<double> fused_lse = c.lse.values();
    std::vector<std::vector<double>> fused_grads;
    for (const Buffer* g : {&c.grad_logits, &c.grad_hidden, &c.grad_weight, &c.grad_bias}) {
      fused_grads.push_back(g->values());
    }
    ASSERT_EQ(c.forward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_TRUE(bitwise_equal(c.lse.values(), fused_lse)) << "forward and fused lse differ";
    ASSERT_EQ(c.backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    size_t i = 0;
    for (const Buffer* g : {&c.grad_logits, &c.grad_hidden, &c.grad_weight, &c.grad_bias}) {
      EXPECT_TRUE(bitwise_equal(g->values(), fused_grads[i])) << "gradient " << i;
      ++i;
    }
    expect_matches_reference(c, Mode::backward);
  }
}

// Rule 3: the gradient of a logits input may be written over it.
TEST_P(Contract, InPlaceGradient) {
  Generator gen(503);
  const reference::Problem p = gen.problem({.n_tokens = 12, .vocab = 1031, .top_k = 3});
  lmloss_loss_options o = training_options();
  o.kd_weight = 0.5;
  for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    LossCase apart(p, o, setup(dtype));
    ASSERT_EQ(apart.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    LossSetup s = setup(dtype);
    s.in_place = true;
    LossCase over(p, o, s);
    ASSERT_EQ(over.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_TRUE(bitwise_equal(over.logits.values(), apart.grad_logits.values()));
    EXPECT_TRUE(bitwise_equal(over.loss.values(), apart.loss.values()));
    expect_matches_reference(over, Mode::forward_backward);
  }
}

// Rule 5: a bad argument, found anywhere in the inputs, leaves every output unwritten.
TEST_P(Contract, ValidateBeforeWriting) {
  Generator gen(504);
  reference::Problem p = gen.problem({.n_tokens = 64, .vocab = 301, .ignore_fraction = 0});
  p.labels.back() = p.vocab;  // the very last label: found only after the others are read
  lmloss_loss_options o = lmloss_loss_options_default();
  LossCase c(p, o, setup());
  // Chunks of a few rows, so a backend that writes chunk by chunk would have written some.
  ctx.set_workspace_budget(8 * 301 * 8 + 4096);
  const lmloss_status status = c.forward_backward(ctx.get());
  if (device() == Device::cuda && status == LMLOSS_ERROR_ID_OUT_OF_RANGE) {
    // Found on the device: reported by the next synchronize, and the context stays usable.
    EXPECT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS);
    return;
  }
  EXPECT_EQ(status, LMLOSS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(lmloss_last_error()).rfind("targets.labels", 0), 0u) << lmloss_last_error();
  for (const Buffer* b : c.outputs()) EXPECT_TRUE(untouched(*b));
}

// Rule 6: N * V past 2^31 elements. Forward only, checked on a few tokens spread over the
// problem (the first, the last, around the 2^31-th logit) against the reference for just those.
TEST_P(Contract, SixtyFourBitIndexing) {
  const int64_t n = 32768, V = 65601, H = 4;
  static_assert(int64_t{32768} * 65601 > (int64_t{1} << 31));
  Generator gen(505);
  reference::Problem p = gen.problem({.n_tokens = n, .vocab = V, .hidden = H, .bias = true,
                                      .ignore_fraction = 0});
  const std::vector<int64_t> checked = {0, 1, 16383, 32736, 32737, n - 2, n - 1};
  for (const int64_t t : checked) p.labels[t] = V - 1 - t % 3;  // ids at the end of the rows
  lmloss_loss_options o = lmloss_loss_options_default();
  o.reduction = LMLOSS_REDUCTION_NONE;
  LossSetup s = setup();
  s.want_grad_hidden = s.want_grad_weight = s.want_grad_bias = false;
  LossCase c(p, o, s);
  ASSERT_EQ(c.forward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_TRUE(fully_written(c.loss));
  EXPECT_TRUE(fully_written(c.lse));

  reference::Problem few;
  const reference::Problem& r = c.problem();  // as rounded for the library
  few.n_tokens = static_cast<int64_t>(checked.size());
  few.vocab = V;
  few.hidden = H;
  few.weight = r.weight;
  few.bias = r.bias;
  std::vector<double> loss, lse;
  for (const int64_t t : checked) {
    few.hidden_states.insert(few.hidden_states.end(), r.hidden_states.begin() + t * H,
                             r.hidden_states.begin() + (t + 1) * H);
    few.labels.push_back(r.labels[t]);
    loss.push_back(c.loss.get(t));
    lse.push_back(c.lse.get(t));
  }
  const reference::LossResult ref = reference::loss(few, o);
  EXPECT_TRUE(close_to(loss, ref.loss, tolerance(LMLOSS_F32)));
  EXPECT_TRUE(close_to(lse, ref.lse, tolerance(LMLOSS_F32)));
}

// Rule 7: the same inputs give bitwise the same outputs.
TEST_P(Contract, Deterministic) {
  Generator gen(506);
  lmloss_loss_options o = training_options();
  o.kd_weight = 0.7;
  for (const int64_t hidden : {0, 24}) {
    SCOPED_TRACE(hidden ? "linear" : "logits");
    LossCase c(gen.problem({.n_tokens = 96, .vocab = 2053, .hidden = hidden, .bias = hidden > 0,
                            .top_k = 5}),
               o, setup(LMLOSS_BF16));
    ctx.set_workspace_budget(size_t(24) * 2053 * 8);  // several chunks
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    const std::vector<double> first = c.output_values();
    for (int repeat = 0; repeat < 3; ++repeat) {
      ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      EXPECT_TRUE(bitwise_equal(c.output_values(), first)) << "run " << repeat + 2;
    }
  }
}

// Rule 7 across contexts: a context left at the default thread count gives the same bits before
// and after another context ran with a count of its own (the BLAS's count is the process's).
TEST_P(Contract, DeterministicWhateverAnotherContextSet) {
  if (device() != Device::cpu) GTEST_SKIP() << "threads are the CPU backend's setting";
  Generator gen(510);
  LossCase c(gen.problem({.n_tokens = 512, .vocab = 3000, .hidden = 700}), training_options(), setup());
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  const std::vector<double> first = c.output_values();
  lmloss::Context one_thread;
  one_thread.set_num_threads(1);
  ASSERT_EQ(c.forward_backward(one_thread.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_TRUE(bitwise_equal(c.output_values(), first));
  // Nor into the application's own BLAS calls: its count is as it was.
  const int application_threads = openblas_get_num_threads();
  ASSERT_EQ(c.forward_backward(one_thread.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_EQ(openblas_get_num_threads(), application_threads);
}

// Rule 7 with product tuning on (lmloss_context_set_product_tuning): the tuned context agrees
// with the reference, and once tuned, gives bitwise the same outputs call after call; the
// tuning's trial products leave no trace in accumulated gradients. On the CPU tuning changes
// nothing at all.
TEST_P(Contract, TunedProductsStayDeterministic) {
  Generator gen(509);
  lmloss_loss_options o = training_options();
  o.kd_weight = 0.5;
  o.flags = LMLOSS_ACCUMULATE_GRAD_WEIGHT;
  const ProblemSpec spec{.n_tokens = 300, .vocab = 2053, .hidden = 64, .bias = true, .top_k = 4};
  const reference::Problem p = gen.problem(spec);
  LossSetup s = setup(LMLOSS_BF16);
  s.grad_dtype = LMLOSS_F32;
  s.grad_weight_initial = gen.normal(spec.vocab * spec.hidden, 0.01);
  LossCase c(p, o, s);
  const size_t budget = size_t(100) * 2053 * 8;  // several chunks: dW accumulates with beta 1
  ctx.set_workspace_budget(budget);
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  const std::vector<double> untuned = c.output_values();
  lmloss::Context tuned;
  tuned.set_workspace_budget(budget);
  tuned.set_product_tuning(true);
  ASSERT_EQ(c.forward_backward(tuned.get()), LMLOSS_SUCCESS) << lmloss_last_error();  // tunes
  expect_matches_reference(c, Mode::forward_backward);
  const std::vector<double> first = c.output_values();
  if (device() == Device::cpu) {
    EXPECT_TRUE(bitwise_equal(first, untuned));
  }
  for (int repeat = 0; repeat < 2; ++repeat) {
    ASSERT_EQ(c.forward_backward(tuned.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_TRUE(bitwise_equal(c.output_values(), first)) << "run " << repeat + 2;
  }
  EXPECT_EQ(lmloss_context_set_product_tuning(nullptr, 1), LMLOSS_ERROR_INVALID_ARGUMENT);
}

// Rules 5 and 7 together: a context keeps its workspace between calls, and what an earlier call
// left there (NaN everywhere, here) never reaches a later call's outputs: the same call gives
// bitwise the same results on that context and on a fresh one.
TEST_P(Contract, ReusedWorkspaceLeaksNothing) {
  Generator gen(508);
  lmloss_loss_options o = training_options();
  o.kd_weight = 0.5;
  const ProblemSpec spec{.n_tokens = 64, .vocab = 1031, .hidden = 24, .bias = true, .top_k = 3};
  const size_t budget = size_t(16) * 1031 * 8;  // several chunks: dW and db accumulate
  reference::Problem poisoned = gen.problem(spec);
  for (double& x : poisoned.hidden_states) x = NAN;
  for (double& w : poisoned.weight) w = NAN;
  for (double& b : poisoned.bias) b = NAN;
  ctx.set_workspace_budget(budget);
  LossCase dirty(poisoned, o, setup(LMLOSS_BF16));
  ASSERT_EQ(dirty.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  LossCase clean(gen.problem(spec), o, setup(LMLOSS_BF16));
  ASSERT_EQ(clean.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  const std::vector<double> after_dirty = clean.output_values();
  lmloss::Context fresh;
  fresh.set_workspace_budget(budget);
  ASSERT_EQ(clean.forward_backward(fresh.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_TRUE(bitwise_equal(after_dirty, clean.output_values()));
  expect_matches_reference(clean, Mode::forward_backward);
}

// This process's memory from /proc/self/statm, in bytes: field 0 what it has mapped, field 1 what
// is resident (0 where the file is not to be had).
size_t statm_bytes(int field) {
  std::ifstream statm("/proc/self/statm");
  size_t pages[2] = {};
  if (!(statm >> pages[0] >> pages[1])) return 0;
  return pages[field] * size_t(sysconf(_SC_PAGESIZE));
}
// What is resident once the C library has given back the memory it keeps after frees (glibc
// keeps freed heap pages mapped), so that it counts what is held, not what was once used.
size_t resident_bytes() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
  return statm_bytes(1);
}
size_t mapped_bytes() { return statm_bytes(0); }

// Rule 1 between calls: what a context keeps for reuse stays within its budget when a call of
// another shape follows (its small pieces must not pin the last call's large blocks while it
// maps new ones) and when the budget is lowered. Host memory, so the CPU backend's.
TEST_P(Contract, HeldWorkspaceStaysWithinTheBudget) {
  if (device() != Device::cpu) GTEST_SKIP() << "device memory is the allocator's to hold";
  if (resident_bytes() == 0) GTEST_SKIP() << "no /proc/self/statm to read resident memory from";
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's quarantine keeps freed memory resident";
#endif
  Generator gen(509);
  const size_t budget = size_t(96) << 20, slack = size_t(16) << 20;
  ctx.set_workspace_budget(budget);
  LossCase logits(gen.problem({.n_tokens = 512, .vocab = 40000}), training_options(), setup());
  LossCase linear(gen.problem({.n_tokens = 1024, .vocab = 16384, .hidden = 256, .bias = true}),
                  training_options(), setup(LMLOSS_BF16));
  {
    // OpenMP's and the BLAS's threads keep stacks and buffers of their own once they have run
    // (more than the slack on a machine of 16 cores or more), which no context holds: the same
    // calls through a context of their own come first.
    lmloss::Context warm;
    warm.set_workspace_budget(budget);
    ASSERT_EQ(logits.forward_backward(warm.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    ASSERT_EQ(linear.forward_backward(warm.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  }
  const size_t before = resident_bytes();
  ASSERT_EQ(logits.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  ASSERT_EQ(linear.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  const size_t after_two = resident_bytes();
  EXPECT_LE(after_two, before + budget + slack)
      << "held " << (after_two - before) / (1 << 20) << " MiB over a " << budget / (1 << 20) << " MiB budget";
  ctx.set_workspace_budget(size_t(4) << 20);
  LossCase small(gen.problem({.n_tokens = 8, .vocab = 1000, .hidden = 16}), training_options(), setup());
  ASSERT_EQ(small.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  EXPECT_LE(resident_bytes(), before + (size_t(4) << 20) + slack) << "the pool kept blocks of the larger budget";
}

// A call that fails for want of host memory writes nothing, a 16-bit dW it would add to included
// (its f32 sum is widened over its own bytes). Here the address space is limited so that the
// call gets the chunk of X converted to f32 (64 MiB) but not the f32 chunk of dX after it.
TEST_P(Contract, OutOfMemoryWritesNothing) {
  if (device() != Device::cpu) GTEST_SKIP() << "host memory is the CPU backend's";
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer maps more address space than a limit can leave";
#endif
  rlimit old{};
  if (mapped_bytes() == 0 || getrlimit(RLIMIT_AS, &old) != 0) GTEST_SKIP() << "no address-space limit here";
  Generator gen(511);
  const int64_t n = 2048, vocab = 64, hidden = 8192;
  LossSetup s = setup(LMLOSS_BF16);
  s.grad_weight_initial.assign(size_t(vocab * hidden), 1.0);
  lmloss_loss_options o = training_options();
  o.flags |= LMLOSS_ACCUMULATE_GRAD_WEIGHT;
  LossCase c(gen.problem({.n_tokens = n, .vocab = vocab, .hidden = hidden}), o, s);
  {
    lmloss::Context warm;  // the BLAS's threads and buffers made outside the limit
    ASSERT_EQ(c.forward_backward(warm.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  }
  const size_t chunk = size_t(n) * size_t(hidden) * sizeof(float);
  rlimit limited = old;
  limited.rlim_cur = rlim_t(mapped_bytes() + chunk + chunk / 2);
  ASSERT_EQ(setrlimit(RLIMIT_AS, &limited), 0);
  const lmloss_status status = c.forward_backward(ctx.get());
  ASSERT_EQ(setrlimit(RLIMIT_AS, &old), 0);
  ASSERT_EQ(status, LMLOSS_ERROR_OUT_OF_MEMORY) << "the limit did not fall where this test meant it to";
  for (const Buffer* b : c.outputs()) EXPECT_TRUE(b->untouched());
}

// Rule 8: the backend agrees with the float64 reference, and the comparison can fail: an
// output wrong by a few tolerances is caught.
TEST_P(Contract, ChecksAgainstReference) {
  Generator gen(507);
  lmloss_loss_options o = training_options();
  o.kd_weight = 0.4;
  LossCase c(gen.problem({.n_tokens = 16, .vocab = 769, .hidden = 16, .bias = true, .top_k = 4}),
             o, setup());
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  expect_matches_reference(c, Mode::forward_backward);

  const reference::LossResult ref = c.reference();
  const double tol = tolerance(LMLOSS_F32);
  std::vector<double> out = c.grad_weight.values();
  ASSERT_TRUE(close_to(out, ref.grad_weight, tol));
  double norm = 0;
  for (double x : ref.grad_weight) norm += x * x;
  out[out.size() / 2] += 5 * tol * std::sqrt(norm);  // one element off by 5 tolerances
  EXPECT_FALSE(close_to(out, ref.grad_weight, tol));
  std::vector<double> loss = c.loss.values();
  loss[0] *= 1 + 5 * tol;
  EXPECT_FALSE(close_to(loss, ref.loss, tol));
}

INSTANTIATE_TEST_SUITE_P(, Contract, all_devices, ParamName{});

}  // namespace
}  // namespace lmloss::test
