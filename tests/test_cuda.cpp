// GPU-only rules of the contract, on the CUDA backend: every option against the reference with
// the rows split over many chunks, f16 gradients that would underflow unscaled, bitwise
// determinism, the device-side id flag (reported once, context still usable), no host sync
// inside a call, the workspace budget and a caller's allocator, and a case with N x V > 2^31.
// Each test skips, saying why, where no CUDA device is usable.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "harness.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::test {
namespace {

lmloss_loss_options options_named(const std::string& name);  // below: the option sets by name

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override { LMLOSS_REQUIRE_DEVICE(Device::cuda); }
  static LossSetup setup(lmloss_dtype dtype, lmloss_dtype grad_dtype) {
    LossSetup s;
    s.device = Device::cuda;
    s.dtype = dtype;
    s.grad_dtype = grad_dtype;
    return s;
  }
  // A frozen head's step: dX only, in the head's dtype; a per-token upstream gradient (drawn
  // from gen) where the reduction is "none".
  static LossSetup frozen_head_setup(lmloss_dtype dtype, const lmloss_loss_options& o, Generator& gen,
                                     int64_t n_tokens) {
    LossSetup s = setup(dtype, dtype);
    s.want_grad_weight = false;
    s.want_grad_bias = false;
    if (o.reduction == LMLOSS_REDUCTION_NONE) s.upstream = gen.normal(n_tokens);
    return s;
  }
  // A budget that holds about `rows` rows of a linear problem's chunk.
  static size_t budget_for_rows(int64_t rows, int64_t vocab) { return 64 * 1024 + size_t(rows) * vocab * 6; }

  // The statistics product's tests: one token; a vocabulary of exactly one column tile, and of
  // one more; 50021; strided rows in one shape. Labels are i64.
  struct ProductShape {
    int64_t n_tokens, vocab, hidden, row_padding;
  };
  static constexpr ProductShape kProductShapes[] = {
      {1, 50021, 64, 0}, {700, 1999, 136, 8}, {300, 256, 64, 0}, {300, 257, 72, 0}};
  static constexpr const char* kProductOptions[] = {"plain", "smoothing_zloss_temperature", "none", "normalizer"};
  static LossSetup product_setup(lmloss_dtype dtype, lmloss_dtype grad_dtype, const ProductShape& shape) {
    LossSetup s = setup(dtype, grad_dtype);
    s.row_padding = shape.row_padding;
    s.label_dtype = LMLOSS_I64;
    return s;
  }
  static std::string product_trace(lmloss_dtype dtype, const char* name, const ProductShape& shape) {
    return std::string(dtype_name(dtype)) + " " + name + " N " + std::to_string(shape.n_tokens) + " V " +
           std::to_string(shape.vocab) + " H " + std::to_string(shape.hidden);
  }
  // A call (a fused step unless named) against the reference, then run again in the same
  // context: bitwise the same.
  static void expect_reference_then_bitwise_rerun(LossCase& c, lmloss::Context& ctx,
                                                  Mode mode = Mode::forward_backward) {
    ASSERT_EQ(c.run(ctx.get(), mode), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_matches_reference(c, mode);
    const std::vector<double> first = c.output_values();
    ASSERT_EQ(c.run(ctx.get(), mode), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_TRUE(bitwise_equal(first, c.output_values()));
  }
  // A problem of 40 tokens whose teacher ids repeat (repeat_teacher_ids), drawn from `gen`.
  static reference::Problem repeated_ids_problem(Generator& gen, int64_t top_k) {
    reference::Problem p = gen.problem({.n_tokens = 40, .vocab = 5003, .hidden = 64, .top_k = top_k});
    repeat_teacher_ids(p, p.n_tokens, top_k);
    return p;
  }
  // Such a problem against the reference, bitwise on a rerun; in chunks of a few of its rows
  // (row0 > 0 in every chunk after the first) when `chunked`.
  static void expect_repeated_ids_match_reference(const reference::Problem& p, lmloss_dtype dtype, bool with_label,
                                                  bool chunked) {
    SCOPED_TRACE(std::string(dtype_name(dtype)) + " k " + std::to_string(p.top_k) +
                 (with_label ? " distill_mixed" : " distill_only") + (chunked ? " chunked" : ""));
    lmloss_loss_options o = options_named("distill_mixed");
    if (!with_label) o.ce_weight = 0;
    LossCase c(p, o, setup(dtype, dtype));
    lmloss::Context ctx;
    if (chunked) ctx.set_workspace_budget(budget_for_rows(4, p.vocab) + size_t(4 * 12) * (p.top_k + 1));
    ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
    EXPECT_LE(ctx.peak_workspace(), ctx.workspace_budget());
  }
  // The one-chunk cases of the repeated-ids test, in order, each drawing its problem; those
  // `take` accepts run.
  static void repeated_ids_cases(const std::function<bool(int64_t, lmloss_dtype, bool)>& take) {
    Generator gen(4021);
    for (const int64_t top_k : {16, 254, 255, 600, 3999, 4095, 4096, 4200}) {
      for (const lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
        for (const bool with_label : {true, false}) {
          const reference::Problem p = repeated_ids_problem(gen, top_k);
          if (!take(top_k, dtype, with_label)) continue;
          ASSERT_NO_FATAL_FAILURE(expect_repeated_ids_match_reference(p, dtype, with_label, false));
        }
      }
    }
  }
};

lmloss_loss_options options_named(const std::string& name) {
  lmloss_loss_options o = lmloss_loss_options_default();
  if (name == "smoothing_zloss_softcap_temperature") {
    o.label_smoothing = 0.1;
    o.z_loss = 1e-3;
    o.softcap = 15;
    o.temperature = 1.7;
  } else if (name == "smoothing_zloss_temperature") {  // what the statistics product takes
    o.label_smoothing = 0.1;
    o.z_loss = 1e-3;
    o.temperature = 1.7;
  } else if (name == "zloss_temperature") {  // what the exponential form takes
    o.z_loss = 1e-3;
    o.temperature = 1.7;
  } else if (name == "distill_mixed") {
    o.ce_weight = 0.5;
    o.kd_weight = 0.7;
  } else if (name == "sum") {
    o.reduction = LMLOSS_REDUCTION_SUM;
  } else if (name == "none") {
    o.reduction = LMLOSS_REDUCTION_NONE;
  } else if (name == "normalizer") {
    o.normalizer = 1000;
  }
  return o;
}

// Every option, every input dtype, linear and logits heads, rows over several chunks.
TEST_F(Cuda, EveryOptionAcrossChunksMatchesReference) {
  Generator gen(4001);
  const char* names[] = {"plain", "smoothing_zloss_softcap_temperature", "distill_mixed", "sum", "none",
                         "normalizer"};
  for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16}) {
    for (const char* name : names) {
      for (bool linear : {true, false}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + name + (linear ? " linear" : " logits"));
        ProblemSpec spec{.n_tokens = 300, .vocab = 1999};
        if (linear) {
          spec.hidden = 72;
          spec.bias = true;
        }
        const lmloss_loss_options o = options_named(name);
        if (o.kd_weight != 0) spec.top_k = 8;
        LossSetup s = setup(dtype, linear ? LMLOSS_F32 : dtype);
        if (o.reduction == LMLOSS_REDUCTION_NONE) {
          std::vector<double> up = gen.normal(spec.n_tokens);
          s.upstream = up;
        }
        LossCase c(gen.problem(spec), o, s);
        lmloss::Context ctx;
        ctx.set_workspace_budget(budget_for_rows(64, spec.vocab));
        for (Mode mode : {Mode::forward, Mode::backward, Mode::forward_backward}) {
          ASSERT_EQ(c.run(ctx.get(), mode), LMLOSS_SUCCESS) << lmloss_last_error();
          expect_matches_reference(c, mode);
        }
        EXPECT_LE(ctx.peak_workspace(), ctx.workspace_budget());
      }
    }
  }
}

// Rows of 50k and 100k logits (odd widths, each row longer than one block's pass): every option
// at once, each dtype, against the reference over several chunks; and the forward's lse bitwise
// the fused call's, as the contract's rule 2 asks.
TEST_F(Cuda, LongRowsMatchReference) {
  Generator gen(4010);
  for (const int64_t vocab : {50021, 100003}) {
    for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " vocab " + std::to_string(vocab));
      ProblemSpec spec{.n_tokens = 24, .vocab = vocab, .hidden = 32, .bias = true, .top_k = 6};
      lmloss_loss_options o = options_named("smoothing_zloss_softcap_temperature");
      o.kd_weight = 0.6;
      LossCase c(gen.problem(spec), o, setup(dtype, LMLOSS_F32));
      lmloss::Context ctx;
      ctx.set_workspace_budget(budget_for_rows(10, vocab));
      ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      expect_matches_reference(c, Mode::forward_backward);
      const std::vector<double> fused_lse = c.lse.values();
      ASSERT_EQ(c.forward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      EXPECT_TRUE(bitwise_equal(c.lse.values(), fused_lse)) << "forward and fused lse differ";
      ASSERT_EQ(c.backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      expect_matches_reference(c, Mode::backward);
      EXPECT_LE(ctx.peak_workspace(), ctx.workspace_budget());
    }
  }
}

// Mean-reduced f16 gradients are ~1/N of O(1) values: without the power-of-two scale the
// library applies before the products, most of dW would underflow in f16.
TEST_F(Cuda, F16GradientsOfManyTokensKeepTheirSmallEntries) {
  Generator gen(4002);
  ProblemSpec spec{.n_tokens = 4096, .vocab = 509, .hidden = 64, .ignore_fraction = 0};
  LossSetup s = setup(LMLOSS_F16, LMLOSS_F16);
  s.want_grad_bias = false;
  LossCase c(gen.problem(spec), lmloss_loss_options_default(), s);
  lmloss::Context ctx;
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  expect_matches_reference(c, Mode::forward_backward);
}

// A budget where a dense 16-bit gradient chunk filled by 128-row logits chunks takes two chunks
// where the gradient over its own logits would take three: the 16-bit dtypes go that way (f32
// keeps the gradient in place), the last chunk ragged, every option on; against the reference,
// within the budget, and bitwise the same on a second run.
TEST_F(Cuda, SeparateGradientChunkMatchesReference) {
  Generator gen(4011);
  for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16, LMLOSS_F32}) {
    SCOPED_TRACE(dtype_name(dtype));
    ProblemSpec spec{.n_tokens = 700, .vocab = 1999, .hidden = 72, .bias = true, .top_k = 5};
    lmloss_loss_options o = options_named("smoothing_zloss_softcap_temperature");
    o.kd_weight = 0.4;
    LossCase c(gen.problem(spec), o, setup(dtype, LMLOSS_F32));
    lmloss::Context ctx;
    ctx.set_workspace_budget(size_t(3) << 20);
    for (Mode mode : {Mode::forward_backward, Mode::backward}) {
      ASSERT_EQ(c.run(ctx.get(), mode), LMLOSS_SUCCESS) << lmloss_last_error();
      expect_matches_reference(c, mode);
    }
    EXPECT_LE(ctx.peak_workspace(), ctx.workspace_budget());
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    const std::vector<double> first = c.output_values();
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_TRUE(bitwise_equal(first, c.output_values()));
  }
}

// Whether forwards of 16-bit linear heads here take their statistics from the product
// (a build with it, on an sm_90 device).
bool statistics_product_expected() {
#ifdef LMLOSS_TEST_ROW_STATS_PRODUCT
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

// Skips a test of the product's paths where they are not taken.
#define LMLOSS_REQUIRE_STATISTICS_PRODUCT()                                                        \
  do {                                                                                             \
    if (!statistics_product_expected())                                                            \
      GTEST_SKIP() << "the statistics product is built for and runs on sm_90 devices only";        \
  } while (0)

// A forward of a 16-bit linear head with statistics from the product's epilogue: against the
// reference at odd shapes (one token; a vocabulary of exactly one column tile, and of one more;
// 50021), every option that path takes (no bias, no soft-capping), strided rows, i64 labels;
// bitwise the same on a second run. Its workspace shows the path was taken: no logits chunk and
// no cuBLASLt workspace (that path holds 32 MiB for the products alone), a few floats per row and
// column tile instead; with a bias the same call keeps the cuBLASLt path.
TEST_F(Cuda, ForwardStatisticsFromTheProductMatchReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4012);
  for (const ProductShape& shape : kProductShapes) {
    for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
      for (const char* name : kProductOptions) {
        SCOPED_TRACE(product_trace(dtype, name, shape));
        ProblemSpec spec{.n_tokens = shape.n_tokens, .vocab = shape.vocab, .hidden = shape.hidden};
        LossCase c(gen.problem(spec), options_named(name), product_setup(dtype, LMLOSS_F32, shape));
        lmloss::Context ctx;
        ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx, Mode::forward));
        EXPECT_LT(ctx.peak_workspace(), size_t(1) << 20);
      }
      {  // a bias: the cuBLASLt path
        ProblemSpec spec{.n_tokens = shape.n_tokens, .vocab = shape.vocab, .hidden = shape.hidden, .bias = true};
        LossCase c(gen.problem(spec), options_named("plain"), setup(dtype, LMLOSS_F32));
        lmloss::Context ctx;
        ASSERT_EQ(c.forward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
        expect_matches_reference(c, Mode::forward);
        EXPECT_GT(ctx.peak_workspace(), size_t(32) << 20) << "a head with a bias keeps the cuBLASLt path";
      }
    }
  }
}

// A forward of more tokens than the statistics product takes at once (2048, so that its rows of
// X stay in L2) runs in chunks of whole cluster rows, spread evenly: 3500 tokens as 1792 + 1708
// rows by our count. Every row's loss and lse once, the mean over all, masked and ignored tokens,
// per-token losses, both 16-bit dtypes; against the reference and bitwise on a rerun.
TEST_F(Cuda, ForwardOfManyTokensFromTheProductInChunksMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4031);
  for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
    for (const char* name : {"plain", "none", "smoothing_zloss_temperature"}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + name);
      ProblemSpec spec{.n_tokens = 3500, .vocab = 1999, .hidden = 72, .mask = true};
      LossCase c(gen.problem(spec), options_named(name), setup(dtype, LMLOSS_F32));
      lmloss::Context ctx;
      ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx, Mode::forward));
    }
  }
}

// The most workspace a fused call on the statistics product's path holds in one chunk: the
// products' 32 MiB of scratch (twice that where dX runs beside dW on a second stream: the
// exponential form, bf16 without label smoothing), 2 bytes per logit, the partials or the
// exponential form's staging (an f32 dX row and a bf16 row of X at once: 6 bytes per hidden unit)
// where that is more than 1 byte per logit (else up to the midpoint of 3 bytes per logit, where
// the cuBLASLt path holds 4), the teacher's scratch (4 bytes an entry, 8 from 256 to 4096 entries,
// which the rows take in (id, entry) order), dW's large entries (16 slots of 24 bytes and a row
// scale of 4 a token, and their sort's scratch: 1 MiB is ample for these shapes), and 64 bytes a
// row for the rest.
size_t product_path_workspace_bound(int64_t n_tokens, int64_t vocab, int64_t hidden, int64_t top_k, bool two_streams) {
  const size_t logits_row = size_t((vocab + 7) / 8 * 8);
  const size_t staging_row = std::max(logits_row, 6 * size_t(hidden));
  const size_t entry_bytes = top_k + 1 >= 256 && top_k + 1 <= 4096 ? 12 : 4;  // s, and the sorted key
  return (size_t(two_streams ? 65 : 33) << 20) +
         size_t(n_tokens) * (2 * logits_row + staging_row + entry_bytes * size_t(top_k + 1) + 388 + 64);
}

// The fused forward+backward of the same heads: statistics from the product's epilogue, the
// gradient formed from its 16-bit shifted logits. Against the reference at the same odd shapes
// and options, gradients in f32 and in the inputs' dtype, one chunk and several (dW summed over
// chunks); bitwise the same on a second run. The workspace shows the path: 2 bytes per logit of
// the chunk where the cuBLASLt path holds 4.
TEST_F(Cuda, FusedStepFromTheProductMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4013);
  for (const ProductShape& shape : kProductShapes) {
    for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
      for (const char* name : kProductOptions) {
        for (const bool chunked : {false, true}) {
          const lmloss_dtype grad_dtype = chunked ? dtype : LMLOSS_F32;
          SCOPED_TRACE(product_trace(dtype, name, shape) + (chunked ? " chunked, 16-bit gradients" : ""));
          ProblemSpec spec{.n_tokens = shape.n_tokens, .vocab = shape.vocab, .hidden = shape.hidden};
          LossCase c(gen.problem(spec), options_named(name), product_setup(dtype, grad_dtype, shape));
          lmloss::Context ctx;
          if (chunked) ctx.set_workspace_budget(budget_for_rows(std::max<int64_t>(shape.n_tokens / 3, 1), shape.vocab));
          ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
          if (!chunked) {
            const bool two_streams = dtype == LMLOSS_BF16 && std::string(name) != "smoothing_zloss_temperature";
            EXPECT_LT(ctx.peak_workspace(),
                      product_path_workspace_bound(shape.n_tokens, shape.vocab, shape.hidden, 0, two_streams));
          }
        }
      }
    }
  }
}

// A bf16 fused step without label smoothing keeps most rows in the exponential form (each stored
// as exp(s - s at its label), the backward products taking the rows' scales); a row whose lse is
// far above that (a badly mispredicted token) gets its gradient written instead, and s at a
// teacher id whose stored value underflows comes from the head. Logits spread wide enough that
// rows of both kinds share a chunk (and, widest, that most rows and teacher ids take the fallbacks),
// cross-entropy, per-token upstream and distillation, one chunk and several, bitwise on a rerun.
TEST_F(Cuda, FusedStepWithFarLabelsMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4016);
  for (const double logit_scale : {12.0, 60.0}) {
    for (const char* name : {"plain", "none", "distill_mixed"}) {
      for (const bool chunked : {false, true}) {
        const int64_t n_tokens = 300, vocab = 1999, hidden = 64;
        const int64_t top_k = std::string(name) == "distill_mixed" ? 16 : 0;
        SCOPED_TRACE(std::string(name) + " logit scale " + std::to_string(logit_scale) + (chunked ? " chunked" : ""));
        ProblemSpec spec{.n_tokens = n_tokens, .vocab = vocab, .hidden = hidden, .top_k = top_k,
                         .logit_scale = logit_scale};
        LossCase c(gen.problem(spec), options_named(name), setup(LMLOSS_BF16, chunked ? LMLOSS_BF16 : LMLOSS_F32));
        lmloss::Context ctx;
        if (chunked) ctx.set_workspace_budget(budget_for_rows(n_tokens / 3, vocab));
        ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
      }
    }
  }
}

// Chunks of a fused step on the product's path are whole rows of its tile clusters (256 rows),
// spread evenly with the first ones taller where they do not divide: 1700 tokens (seven cluster
// rows, the last partly filled) in a budget that holds ~600 rows on this path (2 bytes a logit,
// not budget_for_rows's 6) go, by our count of its pieces, as chunks of 512, 512, 512 and the
// 164 left. Each row must be formed once and dW summed over all whatever the split.
// Cross-entropy and distillation, bf16 and f16, against the reference and bitwise on a rerun,
// within the budget.
TEST_F(Cuda, FusedStepInChunksOfTheProductsClusterRowsMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4023);
  for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
    for (const char* name : {"plain", "distill_mixed"}) {
      const int64_t n_tokens = 1700, vocab = 1999, hidden = 72;
      const int64_t top_k = std::string(name) == "distill_mixed" ? 16 : 0;
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + name);
      ProblemSpec spec{.n_tokens = n_tokens, .vocab = vocab, .hidden = hidden, .top_k = top_k};
      LossCase c(gen.problem(spec), options_named(name), setup(dtype, dtype));
      lmloss::Context ctx;
      ctx.set_workspace_budget(budget_for_rows(260, vocab));
      ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
      EXPECT_LE(ctx.peak_workspace(), ctx.workspace_budget());
    }
  }
}

// A chunk taller than one launch of the statistics product (2048 rows, so that its rows of X stay
// in L2) takes the product in launches of whole cluster rows spread evenly, each writing its own
// rows of the shifted logits, partials and labels' logits: by our count 4500 tokens in one chunk
// as 1536 + 1536 + 1428 rows, 2300 as 1280 + 1020. bf16 in the exponential form, f16 through its
// gradient pass, cross-entropy with masked and ignored tokens and distillation; against the
// reference and bitwise on a rerun.
TEST_F(Cuda, FusedStepOfAChunkTallerThanOneProductLaunchMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4037);
  for (const int64_t n_tokens : {4500, 2300}) {
    for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
      for (const char* name : {"plain", "distill_mixed"}) {
        const int64_t vocab = 1999, hidden = 72;
        const int64_t top_k = std::string(name) == "distill_mixed" ? 16 : 0;
        SCOPED_TRACE(std::to_string(n_tokens) + " tokens " + dtype_name(dtype) + " " + name);
        ProblemSpec spec{.n_tokens = n_tokens, .vocab = vocab, .hidden = hidden, .top_k = top_k, .mask = true};
        LossCase c(gen.problem(spec), options_named(name), setup(dtype, LMLOSS_F32));
        lmloss::Context ctx;
        ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
      }
    }
  }
}

// With LMLOSS_SUM_GRAD_WEIGHT_IN_F32 a bf16/f16 dW is summed in f32 over the chunks and rounded
// once: the same call with an f32 dW, rounded here, gives the same values but for the rare
// element whose two f32 sums (the products split differently) straddle a rounding boundary, and
// never one more than an ulp apart. Rounded after each chunk and after the exponential form's
// label term instead, far more elements differ (the test's limit is 1%). Several chunks of the
// statistics product's path (bf16 in the exponential form; f16 through its gradient pass) and of
// cuBLASLt's (soft-capping); one token; added into an earlier dW; and all of dW in the
// workspace's tail: padded rows (the bytes between them are not the library's to use) and
// vocabularies too narrow for rows in place. On sm_90a a bf16 dW's last chunk is stored over the
// sum (weight_grad_store.cuh) where the vocabulary is a multiple of 8: 2008 (its rows in place
// fewer than half, 1000) and 8 (none in place).
TEST_F(Cuda, SixteenBitWeightGradientIsRoundedOnceFromItsF32Sum) {
  Generator gen(4038);
  for (const ProductShape shape : {ProductShape{700, 1999, 72, 0}, ProductShape{700, 2008, 72, 0},
                                   ProductShape{700, 1999, 72, 8}, ProductShape{1, 2008, 72, 0},
                                   ProductShape{300, 15, 64, 0}, ProductShape{300, 8, 64, 0}}) {
    for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
      for (const char* name : {"plain", "smoothing_zloss_softcap_temperature", "distill_mixed"}) {
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + name + " N " + std::to_string(shape.n_tokens) + " V " +
                       std::to_string(shape.vocab) + " padding " + std::to_string(shape.row_padding) +
                       (accumulate ? " accumulated" : ""));
          lmloss_loss_options o = options_named(name);
          o.flags |= LMLOSS_SUM_GRAD_WEIGHT_IN_F32;
          if (accumulate) o.flags |= LMLOSS_ACCUMULATE_GRAD_WEIGHT;
          ProblemSpec spec{.n_tokens = shape.n_tokens, .vocab = shape.vocab, .hidden = shape.hidden,
                           .top_k = o.kd_weight != 0 ? 8 : 0};
          const reference::Problem problem = gen.problem(spec);
          std::vector<double> initial;
          if (accumulate)
            for (double v : gen.normal(size_t(shape.vocab * shape.hidden), 0.01)) initial.push_back(round_to(dtype, v));
          auto run = [&](lmloss_dtype grad_dtype, std::unique_ptr<LossCase>& c) {
            LossSetup st = setup(dtype, grad_dtype);
            st.row_padding = shape.row_padding;
            st.grad_weight_initial = initial;
            c = std::make_unique<LossCase>(problem, o, st);
            lmloss::Context ctx;
            ctx.set_workspace_budget(budget_for_rows(128, shape.vocab));
            return c->forward_backward(ctx.get());
          };
          std::unique_ptr<LossCase> narrow, wide;
          ASSERT_EQ(run(dtype, narrow), LMLOSS_SUCCESS) << lmloss_last_error();
          ASSERT_EQ(run(LMLOSS_F32, wide), LMLOSS_SUCCESS) << lmloss_last_error();
          if (dtype == LMLOSS_BF16) expect_matches_reference(*narrow, Mode::forward_backward);
          EXPECT_TRUE(rounded_once_from(narrow->grad_weight, wide->grad_weight, narrow->grad_weight.count()));
        }
      }
    }
  }
}

// A fused step that keeps a bf16 dW's f32 sum can leave its last chunk's dW product (its first
// chunk, the tallest, run last) to lmloss_round_grad_weight_deferred, which stores it straight
// into dW over the sum, the upstream gradient as the scale: the sum rounded once, as from an f32
// dW (the step's calls again into one, rounded here), every element written, the reference met,
// bitwise on a rerun, in less of the step's own workspace. In the exponential form and the
// gradient pass, alone and after a step into the same sum, in chunks of the product's cluster
// rows and shorter ones; a vocabulary of 8 (no rows of the sum in place); the sum in f32 and as
// the values and their 8-bit rests. Nothing is deferred for one chunk, a vocabulary not a
// multiple of 8, f16 or rests beside rows not a multiple of 16; a buffer of another size is
// refused, nothing written.
TEST_F(Cuda, FusedStepDefersItsLastWeightProductToTheRounding) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4050);
  struct DeferShape {
    int64_t n_tokens, vocab, hidden, budget_rows;
  };
  // Several chunks in every form by the budget's arithmetic: a row's logits alone take 2 V bytes
  // (budget_for_rows(r, V) / 2V = 3 r + 32768 / V rows at most, below N), the exponential form's
  // staging of dX and X 6 H (at V 8: 71.7 KB / 384 B = 186 rows at most, below 300). At V 8 the
  // gradient pass (label smoothing) fits every row in a budget that holds the fixed pieces: it
  // runs only in the other shapes.
  // The sum in f32, and as the values and their rests (whose kernels take rows of 16 values).
  for (const bool rests : {false, true})
  for (DeferShape shape : {DeferShape{700, 2008, 72, 128}, DeferShape{1300, 2000, 40, 400},
                           DeferShape{300, 8, 64, 128}}) {
    if (rests) shape.hidden = (shape.hidden + 15) / 16 * 16;
    for (const char* name : {"plain", "smoothing_zloss_temperature", "distill_mixed"}) {
      if (shape.vocab == 8 && std::string(name) == "smoothing_zloss_temperature") continue;
      for (const bool after_a_step : {false, true}) {
        SCOPED_TRACE(cat(name, " N ", shape.n_tokens, " V ", shape.vocab, " H ", shape.hidden,
                         after_a_step ? " after a step" : "", rests ? ", rests" : ", f32 sum"));
        const lmloss_loss_options o = options_named(name);
        const reference::Problem problem = gen.problem({.n_tokens = shape.n_tokens, .vocab = shape.vocab,
                                                        .hidden = shape.hidden, .top_k = o.kd_weight != 0 ? 8 : 0});
        LossSetup st = setup(LMLOSS_BF16, LMLOSS_BF16);
        st.want_grad_bias = false;
        lmloss::Context ctx;
        ctx.set_workspace_budget(budget_for_rows(shape.budget_rows, shape.vocab));
        Buffer scale = Buffer::of_values(Device::cuda, LMLOSS_F32, {0.37}, 0, 1);
        scale.upload();
        const lmloss_tensor scale_t = after_a_step ? scale.tensor() : lmloss_tensor_none();

        // One fused step on a case's buffers.
        auto fused = [&](LossCase& on, const lmloss_loss_options& options) {
          const lmloss_head h = on.head();
          const lmloss_targets t = on.targets();
          const lmloss_grads g = on.grads();
          const lmloss_tensor loss_t = on.loss_tensor(), lse_t = on.lse_tensor();
          return lmloss_loss_forward_backward(ctx.get(), &h, &t, &options, nullptr, &loss_t, &lse_t, &g);
        };
        // The step(s) into a kept sum, the last given `deferred` where it defers, then the rounding.
        Buffer tail = rests ? Buffer(Device::cuda, LMLOSS_U8, 2, shape.vocab, shape.hidden)
                            : Buffer(Device::cuda, LMLOSS_F32, 2, LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(shape.vocab),
                                     shape.hidden);
        LossCase c(problem, o, st);
        c.options.grad_weight_sum_tail = tail.tensor();
        Buffer deferred;
        size_t step_peak = 0;
        auto steps = [&](const Buffer* into) -> lmloss_status {
          lmloss_loss_options step = c.options;
          if (after_a_step) {
            if (const lmloss_status st = fused(c, step); st != LMLOSS_SUCCESS) return st;
            step.flags |= LMLOSS_ACCUMULATE_GRAD_WEIGHT;
          }
          if (into) step.grad_weight_deferred = into->tensor();
          lmloss_context_reset_peak_workspace(ctx.get());
          if (const lmloss_status st = fused(c, step); st != LMLOSS_SUCCESS) return st;
          lmloss_context_get_peak_workspace(ctx.get(), &step_peak);
          const lmloss_grads g = c.grads();
          const lmloss_tensor tail_t = tail.tensor();
          if (!into) return lmloss_round_grad_weight(ctx.get(), &g.grad_weight, &tail_t, &scale_t);
          const lmloss_tensor deferred_t = into->tensor();
          return lmloss_round_grad_weight_deferred(ctx.get(), &g.grad_weight, &tail_t, &scale_t, &deferred_t);
        };
        size_t bytes = 0;
        {
          const lmloss_head h = c.head();
          const lmloss_targets t = c.targets();
          const lmloss_grads g = c.grads();
          const lmloss_tensor loss_t = c.loss_tensor(), lse_t = c.lse_tensor();
          ASSERT_EQ(lmloss_loss_deferred_bytes(ctx.get(), &h, &t, &c.options, nullptr, &loss_t, &lse_t, &g, &bytes),
                    LMLOSS_SUCCESS)
              << lmloss_last_error();
        }
        ASSERT_GT(bytes, size_t(256)) << "a kept bf16 sum over several chunks defers its last product";
        ASSERT_EQ(c.invoke(ctx.get(), [&] { return steps(nullptr); }), LMLOSS_SUCCESS) << lmloss_last_error();
        const size_t plain_peak = step_peak;
        deferred = Buffer(Device::cuda, LMLOSS_U8, 1, int64_t(bytes));
        ASSERT_EQ(c.invoke(ctx.get(), [&] { return steps(&deferred); }), LMLOSS_SUCCESS) << lmloss_last_error();
        EXPECT_TRUE(fully_written(c.grad_weight));
        const int64_t rows = int64_t(bytes - 256) / (2 * (shape.vocab + shape.hidden));
        EXPECT_EQ(256 + 2 * rows * (shape.vocab + shape.hidden), int64_t(bytes));
        EXPECT_LE(step_peak + size_t(2 * rows * shape.vocab), plain_peak + 256) << "the step's logits are the buffer's";
        if (!after_a_step) expect_matches_reference(c, Mode::forward_backward);
        const std::vector<double> first = c.output_values();
        ASSERT_EQ(c.invoke(ctx.get(), [&] { return steps(&deferred); }), LMLOSS_SUCCESS) << lmloss_last_error();
        EXPECT_TRUE(bitwise_equal(first, c.output_values()));

        // The same steps into an f32 dW.
        LossSetup wide_setup = setup(LMLOSS_BF16, LMLOSS_F32);
        wide_setup.want_grad_bias = false;
        LossCase wide(problem, o, wide_setup);
        ASSERT_EQ(wide.invoke(ctx.get(),
                              [&] {
                                lmloss_loss_options step = o;
                                lmloss_status status = fused(wide, step);
                                step.flags |= LMLOSS_ACCUMULATE_GRAD_WEIGHT;
                                return after_a_step && status == LMLOSS_SUCCESS ? fused(wide, step) : status;
                              }),
                  LMLOSS_SUCCESS)
            << lmloss_last_error();
        // Rests: the pair's ~1e-5 from the f32 sum puts more values on the other side of a rounding
        // boundary, most where chunks cancel (at V 8, 4 of 512 values seen on an H100), and its error
        // is relative to the running sum: where chunks cancel a small value may be a few ulps off
        // (at V 8, 4 ulps of a value 1e-5 on an H100). A sum of the values alone, rounded each
        // chunk, would be ~2^-9 off the largest.
        EXPECT_TRUE(rounded_once_from(c.grad_weight, wide.grad_weight, c.grad_weight.count(),
                                      after_a_step ? 0.37f : 1.f, 0, rests ? 0.03 : 0.01, rests ? 0x1p-13 : 0));

        // A buffer of another size: refused before anything is written.
        Buffer other(Device::cuda, LMLOSS_U8, 1, int64_t(bytes) + 256);
        lmloss_loss_options refused = c.options;
        refused.grad_weight_deferred = other.tensor();
        EXPECT_EQ(c.invoke(ctx.get(), [&] { return fused(c, refused); }), LMLOSS_ERROR_INVALID_ARGUMENT);
        EXPECT_NE(std::string(lmloss_last_error()).find("lmloss_loss_deferred_bytes gives"), std::string::npos)
            << lmloss_last_error();
        EXPECT_TRUE(untouched(c.grad_weight));
      }
    }
  }

  // Nothing deferred: one chunk, a vocabulary not a multiple of 8, f16; rests beside rows of 72
  // values (not a multiple of 16).
  for (const auto& [n_tokens, vocab, dtype, rests] :
       {std::tuple{64, 2008, LMLOSS_BF16, false}, std::tuple{700, 2001, LMLOSS_BF16, false},
        std::tuple{700, 2008, LMLOSS_F16, false}, std::tuple{700, 2008, LMLOSS_BF16, true}}) {
    SCOPED_TRACE(cat("N ", n_tokens, " V ", vocab, " ", dtype_name(dtype), rests ? ", rests" : ""));
    LossSetup st = setup(dtype, dtype);
    st.want_grad_bias = false;
    LossCase c(gen.problem({.n_tokens = n_tokens, .vocab = vocab, .hidden = 72}), options_named("plain"), st);
    Buffer tail = rests ? Buffer(Device::cuda, LMLOSS_U8, 2, vocab, 72)
                        : Buffer(Device::cuda, LMLOSS_F32, 2, LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(vocab), 72);
    c.options.grad_weight_sum_tail = tail.tensor();
    lmloss::Context ctx;
    ctx.set_workspace_budget(budget_for_rows(128, vocab));
    const lmloss_head h = c.head();
    const lmloss_targets t = c.targets();
    const lmloss_grads g = c.grads();
    const lmloss_tensor loss_t = c.loss_tensor(), lse_t = c.lse_tensor();
    size_t bytes = 1;
    ASSERT_EQ(lmloss_loss_deferred_bytes(ctx.get(), &h, &t, &c.options, nullptr, &loss_t, &lse_t, &g, &bytes),
              LMLOSS_SUCCESS)
        << lmloss_last_error();
    EXPECT_EQ(bytes, size_t(0));
  }
}

// A frozen head (dX only) in token chunks: their heights are chosen for the dX product's waves
// of tiles (whole cluster rows, not spread evenly): here, by our count, 512-row chunks and the
// 164 rows left (the budget holds ~600 rows; the vocabulary is too narrow for slices). bf16 in
// the exponential form and f16 with its gradient pass, ignored labels and per-token upstream
// gradients, against the reference, bitwise on a rerun, within the budget.
TEST_F(Cuda, FrozenHeadInTokenChunksMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4029);
  for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
    for (const char* name : {"plain", "none", "zloss_temperature"}) {
      const int64_t n_tokens = 1700, vocab = 1999, hidden = 72;
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + name);
      ProblemSpec spec{.n_tokens = n_tokens, .vocab = vocab, .hidden = hidden, .mask = true};
      const lmloss_loss_options o = options_named(name);
      const LossSetup s = frozen_head_setup(dtype, o, gen, n_tokens);
      LossCase c(gen.problem(spec), o, s);
      lmloss::Context ctx;
      ctx.set_workspace_budget(budget_for_rows(260, vocab));
      ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
      EXPECT_LE(ctx.peak_workspace(), ctx.workspace_budget());
    }
  }
}

// A frozen head (dX only) in the exponential form. With a budget of four token chunks (79 rows)
// the statistics product and the dX product run over slices of the vocabulary at full height
// instead (run_sliced_dx): the budget holds slices of four 4096-column steps, the narrowest it
// takes, and not of five, so five slices of 16384 columns. With the default budget, one chunk. Logits spread
// wide enough (scale 60) that many rows have tiles stored relative to their own maxima, added
// exactly afterwards from the head; options that scale the rows, per-token upstream gradients,
// ignored labels and masked tokens. Against the reference, and bitwise on a rerun.
TEST_F(Cuda, FrozenHeadByVocabularySlicesMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4019);
  for (const double logit_scale : {2.0, 60.0}) {
    for (const char* name : {"plain", "none", "normalizer", "zloss_temperature"}) {
      for (const bool sliced : {false, true}) {
        const int64_t n_tokens = 300, vocab = 70001, hidden = 64;
        SCOPED_TRACE(std::string(name) + " logit scale " + std::to_string(logit_scale) + (sliced ? " sliced" : ""));
        ProblemSpec spec{.n_tokens = n_tokens, .vocab = vocab, .hidden = hidden, .mask = true,
                         .logit_scale = logit_scale};
        const lmloss_loss_options o = options_named(name);
        const LossSetup s = frozen_head_setup(LMLOSS_BF16, o, gen, n_tokens);
        LossCase c(gen.problem(spec), o, s);
        lmloss::Context ctx;
        if (sliced) ctx.set_workspace_budget(budget_for_rows(n_tokens / 10, vocab));
        ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
        EXPECT_LE(ctx.peak_workspace(), ctx.workspace_budget());
      }
    }
  }
}

// The exponential form where the accuracy bar is tightest: a bf16 head with f32 gradients (dW
// accumulated in f32) against the float64 reference, on problems like the benchmark's (normal
// hidden states, weights of spread 2 / sqrt(H) without outlier rows, uniform labels, some
// ignored). The label's one-hot term, rounded into the stored bf16 values and the scaled rows of
// X, put 2.4e-3 into dW and 1.8e-3 into dX here (2.3e-3 at llama3-8b's head); kept exact it
// leaves 2e-4 and 1.3e-4 (by a bf16 emulation of both). The second shape repeats labels within a
// chunk and across chunks (2.3e-3 and 1.7e-3 before, 5e-4 and 3.6e-4 after).
TEST_F(Cuda, FusedStepKeepsTheLabelTermExactWithF32Gradients) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4018);
  struct Shape {
    int64_t n_tokens, vocab, hidden;
    double bound;
  };
  for (const Shape shape : {Shape{512, 8191, 256, 5e-4}, Shape{2000, 509, 128, 1.1e-3}}) {
    for (const bool chunked : {false, true}) {
      SCOPED_TRACE("V " + std::to_string(shape.vocab) + (chunked ? " chunked" : ""));
      reference::Problem p = gen.problem({.n_tokens = shape.n_tokens, .vocab = shape.vocab, .hidden = shape.hidden});
      p.weight = gen.normal(size_t(shape.vocab * shape.hidden), 2.0 / std::sqrt(double(shape.hidden)));
      LossCase c(p, options_named("plain"), setup(LMLOSS_BF16, LMLOSS_F32));
      lmloss::Context ctx;
      if (chunked) ctx.set_workspace_budget(budget_for_rows(shape.n_tokens / 3, shape.vocab));
      ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
      const reference::LossResult ref = c.reference();
      EXPECT_LT(reference::relative_error(c.grad_hidden.values(), ref.grad_hidden), shape.bound);
      EXPECT_LT(reference::relative_error(c.grad_weight.values(), ref.grad_weight), shape.bound);
    }
  }
}

// Peaked rows, as a trained head's: each token's hidden state lifted along 4 rows of W drawn from
// a pool of 64 (so ~1.7 columns a row hold p >= 1/16, the same columns across many rows), the
// label one of them, bf16 head, f32 gradients. dW's products round those columns' large terms
// (stored values and scaled rows of X, both bf16): 1.4e-3 of dW here by a bf16 emulation of the
// exponential form, 1.0e-4 with the entries of p >= 1/16 exact, as the row kernel takes them
// (LossRowsArgs::large_cols). With a teacher too, its ids on the lifted columns (repeated where
// drawn twice): their corrections join the exact terms. One chunk and several; bitwise on a rerun.
TEST_F(Cuda, FusedStepTakesPeakedRowsLargeEntriesExactly) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4023);
  const int64_t n_tokens = 512, vocab = 8184, hidden = 256, lifted = 4, pool = 64;
  for (const bool with_teacher : {false, true}) {
    reference::Problem p = gen.problem(
        {.n_tokens = n_tokens, .vocab = vocab, .hidden = hidden, .top_k = with_teacher ? int64_t(8) : 0});
    p.weight = gen.normal(size_t(vocab * hidden), 2.0 / std::sqrt(double(hidden)));
    for (int64_t t = 0; t < n_tokens; ++t) {
      int64_t ids[lifted];
      for (int64_t k = 0; k < lifted; ++k) {
        ids[k] = (97 * gen.index(pool) + 5) % vocab;
        const double* w = &p.weight[size_t(ids[k] * hidden)];
        double norm2 = 0;
        for (int64_t h = 0; h < hidden; ++h) norm2 += w[h] * w[h];
        const double lift = 10 + 2 * gen.normal(1)[0];
        for (int64_t h = 0; h < hidden; ++h) p.hidden_states[size_t(t * hidden + h)] += lift / norm2 * w[h];
        if (with_teacher) p.teacher_ids[size_t(t * p.top_k + k)] = ids[k];
      }
      if (p.labels[size_t(t)] != -100) p.labels[size_t(t)] = ids[gen.index(lifted)];  // ignored ones stay
    }
    for (const bool chunked : {false, true}) {
      SCOPED_TRACE(std::string(with_teacher ? "distill_mixed" : "plain") + (chunked ? " chunked" : ""));
      LossCase c(p, options_named(with_teacher ? "distill_mixed" : "plain"), setup(LMLOSS_BF16, LMLOSS_F32));
      lmloss::Context ctx;
      if (chunked) ctx.set_workspace_budget(budget_for_rows(n_tokens / 3, vocab) + (size_t(1) << 20));
      ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
      const reference::LossResult ref = c.reference();
      EXPECT_LT(reference::relative_error(c.grad_weight.values(), ref.grad_weight), 4e-4);
      EXPECT_LE(ctx.peak_workspace(), ctx.workspace_budget());
      if (chunked) {  // a bf16 dW summed in f32: the exact terms join the sum before the last chunk's store
        lmloss_loss_options o = options_named(with_teacher ? "distill_mixed" : "plain");
        o.flags |= LMLOSS_SUM_GRAD_WEIGHT_IN_F32;
        LossCase narrow(p, o, setup(LMLOSS_BF16, LMLOSS_BF16));
        ASSERT_EQ(narrow.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
        EXPECT_TRUE(rounded_once_from(narrow.grad_weight, c.grad_weight, narrow.grad_weight.count()));
      }
    }
  }
}

// The label term's dW rows where the caller's dW rows are not aligned for 8-wide access (a row
// stride of hidden + 1, f32 and bf16): the single-column path, every element written, the
// padding untouched.
TEST_F(Cuda, FusedStepAddsTheLabelTermToAWeightGradientOfOddStride) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4019);
  const int64_t n_tokens = 300, vocab = 509, hidden = 128;
  for (lmloss_dtype grad_dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    SCOPED_TRACE(dtype_name(grad_dtype));
    LossCase c(gen.problem({.n_tokens = n_tokens, .vocab = vocab, .hidden = hidden}), options_named("plain"),
               setup(LMLOSS_BF16, grad_dtype));
    c.grad_weight = Buffer(Device::cuda, grad_dtype, 2, vocab, hidden, hidden + 1);
    lmloss::Context ctx;
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_matches_reference(c, Mode::forward_backward);
  }
}

// Distillation on the same path: s at the teacher's ids comes from the product's shifted logits.
// Teachers of 1, 16 and V entries (with V, every id and so the label too), cross-entropy mixed
// in, one chunk and several, bitwise on a second run; a forward with a teacher keeps the cuBLASLt
// path (it has no shifted logits to read).
TEST_F(Cuda, DistillationFromTheProductMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4014);
  struct Shape {
    int64_t n_tokens, vocab, hidden, top_k;
  };
  for (const Shape shape : {Shape{1, 50021, 64, 16}, Shape{700, 1999, 136, 16}, Shape{300, 257, 72, 257},
                            Shape{300, 256, 64, 1}}) {
    for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
      for (const bool chunked : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " N " + std::to_string(shape.n_tokens) + " V " +
                     std::to_string(shape.vocab) + " k " + std::to_string(shape.top_k) + (chunked ? " chunked" : ""));
        ProblemSpec spec{.n_tokens = shape.n_tokens, .vocab = shape.vocab, .hidden = shape.hidden, .top_k = shape.top_k};
        LossCase c(gen.problem(spec), options_named("distill_mixed"), setup(dtype, chunked ? dtype : LMLOSS_F32));
        lmloss::Context ctx;
        if (chunked) ctx.set_workspace_budget(budget_for_rows(std::max<int64_t>(shape.n_tokens / 3, 1), shape.vocab));
        ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
        if (!chunked) {
          EXPECT_LT(ctx.peak_workspace(), product_path_workspace_bound(shape.n_tokens, shape.vocab, shape.hidden,
                                                                       shape.top_k, dtype == LMLOSS_BF16));
        }
        if (!chunked) {
          lmloss::Context forward_ctx;
          ASSERT_EQ(c.forward(forward_ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
          expect_matches_reference(c, Mode::forward);
          EXPECT_GT(forward_ctx.peak_workspace(), size_t(32) << 20) << "a forward with a teacher keeps the cuBLASLt path";
        }
      }
    }
  }
}

// A teacher may name an id more than once, and the label: each entry adds its term there. The rows
// find the repeats by searching their entries (few or very many) or in their (id, entry) order
// (256 to 4096 entries): k on both sides of each bound and at both (255, 4095), through the logits
// (f32) and the product (bf16, 16-bit gradients), with and without the label's term; every fourth
// entry repeats the one before it and even rows' first entry is the label. Bitwise on a rerun.
TEST_F(Cuda, RepeatedTeacherIdsAddTheirTerms) {
  repeated_ids_cases([](int64_t, lmloss_dtype, bool) { return true; });
}

// The same in token chunks (fewer cases: the GPU script's sanitizers run this one).
TEST_F(Cuda, RepeatedTeacherIdsAddTheirTermsAcrossChunks) {
  Generator gen(4022);
  for (const int64_t top_k : {16, 255, 600, 4095, 4200})
    for (const lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16})
      ASSERT_NO_FATAL_FAILURE(
          expect_repeated_ids_match_reference(repeated_ids_problem(gen, top_k), dtype, true, true));
}

// Teacher top-k through a 16-bit head, selected from the largest logits the product keeps per
// column tile: against the reference at odd shapes (one token, a vocabulary of two whole tiles
// and one more column, 50021; strided rows) for k from 1 to the path's largest, renormalised or
// with the tail, at two temperatures; bitwise on a second run. Its workspace shows the path: a
// few dozen bytes per row and tile (no statistics when renormalised), no logits chunk and no
// cuBLASLt workspace; token chunks (a smaller budget) as well.
TEST_F(Cuda, TopkFromTheProductMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4015);
  struct Shape {
    int64_t n_tokens, vocab, hidden, k, row_padding;
  };
  for (const Shape shape : {Shape{300, 50021, 64, 64, 0}, Shape{1, 8191, 136, 128, 8}, Shape{37, 257, 72, 8, 0},
                            Shape{130, 256, 64, 1, 0}}) {
    const reference::Problem p = gen.problem({.n_tokens = shape.n_tokens, .vocab = shape.vocab, .hidden = shape.hidden});
    for (lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
      for (const double temperature : {1.0, 0.7}) {
        for (const int renormalize : {1, 0}) {
          SCOPED_TRACE(std::string(dtype_name(dtype)) + " N " + std::to_string(shape.n_tokens) + " V " +
                       std::to_string(shape.vocab) + " k " + std::to_string(shape.k) + " T " +
                       std::to_string(temperature) + " renormalize " + std::to_string(renormalize));
          lmloss_topk_options o = lmloss_topk_options_default();
          o.k = shape.k;
          o.temperature = temperature;
          o.renormalize = renormalize;
          TopkCase tc(p, o, {.device = Device::cuda, .dtype = dtype, .row_padding = shape.row_padding});
          lmloss::Context ctx;
          ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
          expect_topk_matches_reference(tc, tolerance(LMLOSS_F32));
          const size_t tiles = size_t((shape.vocab + 127) / 128);
          // 64 bytes per row and tile, 80 with the statistics the tail's lse needs.
          const size_t per_tile = renormalize ? 64 : 80;
          EXPECT_LT(ctx.peak_workspace(), size_t(shape.n_tokens) * tiles * per_tile + (size_t(1) << 20));
          const std::vector<int64_t> ids = tc.ids.ids();
          const std::vector<double> probs = tc.probs.values();
          ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
          EXPECT_EQ(ids, tc.ids.ids());
          EXPECT_TRUE(bitwise_equal(probs, tc.probs.values()));
          if (shape.n_tokens >= 300) {  // chunks of about a third of the tokens
            SCOPED_TRACE("chunked");
            lmloss::Context chunked;
            chunked.set_workspace_budget(size_t(shape.n_tokens / 3) * tiles * 64 + (size_t(64) << 10));
            ASSERT_EQ(tc.run(chunked.get()), LMLOSS_SUCCESS) << lmloss_last_error();
            expect_topk_matches_reference(tc, tolerance(LMLOSS_F32));
            EXPECT_LE(chunked.peak_workspace(), chunked.workspace_budget());
          }
        }
      }
    }
  }
}

// The same path over a vocabulary whose candidates pass 48 KiB of shared memory (1563 column
// tiles: 50 KiB), in bf16 and then f16 in one process: each selection kernel is allowed the larger
// dynamic shared memory it launches with, not only the first one used.
TEST_F(Cuda, TopkFromTheProductOfAWideVocabularyInBothDtypes) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4019);
  const reference::Problem p = gen.problem({.n_tokens = 3, .vocab = 200003, .hidden = 32});
  for (const lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
    SCOPED_TRACE(dtype_name(dtype));
    lmloss_topk_options o = lmloss_topk_options_default();
    o.k = 64;
    TopkCase tc(p, o, {.device = Device::cuda, .dtype = dtype});
    lmloss::Context ctx;
    ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_topk_matches_reference(tc, tolerance(LMLOSS_F32));
    EXPECT_LT(ctx.peak_workspace(), size_t(8) << 20) << "the product's path: no logits chunk";
  }
}

// The same path where a column group holds more of the top k than its one candidate: a head
// whose 64 largest logits of every row are two in each of the first 32 groups (exact in 16 bits,
// 4 + m/16, at places in the group that vary), so each group's second joins the selection; a
// head whose first 100 logits are the largest, so the first tile's groups hold 25 each and are
// recomputed in full and merged; and a head whose logits all tie (every row of W the same),
// where the selection recomputes group after group. At temperatures 1, 0.7 and 1.3: the groups
// keep their best, second and third unscaled, and their keys, the recomputed groups' too, are
// scaled (1 / 1.3 rounds, so values apart in the logits may meet in the keys).
TEST_F(Cuda, TopkFromTheProductRecomputesGroups) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4016);
  const int64_t n = 50, V = 4099, H = 64;  // 32 whole tiles: room for k 128
  // Column of place i (0-31) of column group g: the product's layout, 128 (g / 4) + 8 (i / 2) + 2 (g % 4) + i % 2.
  auto group_column = [](int64_t g, int64_t i) { return 128 * (g / 4) + 8 * (i / 2) + 2 * (g % 4) + i % 2; };
  // Head whose logits of the columns large[m] (m < count) are 4 + m/16 for every row, the rest small.
  auto head_with_largest = [&](const std::vector<int64_t>& large) {
    reference::Problem p = gen.problem({.n_tokens = n, .vocab = V, .hidden = H});
    for (int64_t t = 0; t < n; ++t) p.hidden_states[t * H] = 1.0;
    for (int64_t j = 0; j < V; ++j)
      for (int64_t h = 0; h < H; ++h) p.weight[j * H + h] = h == 0 ? 0.0 : p.weight[j * H + h] / 16;
    for (size_t m = 0; m < large.size(); ++m)
      for (int64_t h = 0; h < H; ++h) p.weight[large[m] * H + h] = h == 0 ? 4.0 + double(m) / 16 : 0.0;
    return p;
  };
  std::vector<int64_t> paired_columns, first_columns;
  for (int64_t g = 0; g < 32; ++g) {
    paired_columns.push_back(group_column(g, (7 * g) % 32));
    paired_columns.push_back(group_column(g, (7 * g + 13) % 32));
  }
  for (int64_t j = 0; j < 100; ++j) first_columns.push_back(j);
  struct Head {
    const char* name;
    reference::Problem problem;
    std::vector<int64_t> largest;  // ascending logits; empty where they tie
  };
  std::vector<Head> heads;
  heads.push_back({"paired", head_with_largest(paired_columns), paired_columns});
  heads.push_back({"clustered", head_with_largest(first_columns), first_columns});
  reference::Problem tied = gen.problem({.n_tokens = n, .vocab = V, .hidden = H});
  for (int64_t j = 1; j < V; ++j)
    for (int64_t h = 0; h < H; ++h) tied.weight[j * H + h] = tied.weight[h];
  heads.push_back({"tied", tied, {}});
  for (const Head& head : heads) {
    for (const int64_t k : {int64_t(64), int64_t(128)}) {
      for (const double temperature : {1.0, 0.7, 1.3}) {
        SCOPED_TRACE(std::string(head.name) + " k " + std::to_string(k) + " T " + std::to_string(temperature));
        lmloss_topk_options o = lmloss_topk_options_default();
        o.k = k;
        o.temperature = temperature;
        o.renormalize = 0;
        TopkCase tc(head.problem, o, {.device = Device::cuda, .dtype = LMLOSS_BF16});
        lmloss::Context ctx;
        ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
        expect_topk_matches_reference(tc, tolerance(LMLOSS_F32));
        EXPECT_LT(ctx.peak_workspace(), size_t(1) << 20);
        const std::vector<int64_t> ids = tc.ids.ids();
        ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
        EXPECT_EQ(ids, tc.ids.ids());
        // The largest are exact and distinct: they come first, in order.
        const int64_t count = int64_t(head.largest.size());
        for (int64_t t = 0; t < n; ++t)
          for (int64_t i = 0; i < k && i < count; ++i)
            ASSERT_EQ(ids[t * k + i], head.largest[size_t(count - 1 - i)]) << "token " << t << " place " << i;
      }
    }
  }
}

// Both top-k paths from the product (k 64 from the tiles' candidates, k 300 above a sampled bar)
// over 1300 tokens, under a budget where about 700 rows fit (a little over half the one-chunk
// workspace; the bar's path holds a fixed 5 MiB beside its rows): 640 are taken (whole 128s),
// and they go as three chunks of whole 256-row cluster units spread evenly, 512 + 512 + 276, not
// 640 + 640 + 20. Against the reference; the workspace held is within the budget and below what
// 560 rows of the one-chunk layout take (a 640-row chunk would hold more).
TEST_F(Cuda, TopkFromTheProductInChunksOfTheProductsClusterRowsMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4033);
  const int64_t n = 1300;
  const reference::Problem p = gen.problem({.n_tokens = n, .vocab = 16411, .hidden = 64});
  struct Path {
    int64_t k;
    size_t budget_percent;  // of the one-chunk workspace
  };
  for (const Path path : {Path{64, 55}, Path{300, 50}}) {
    SCOPED_TRACE("k " + std::to_string(path.k));
    lmloss_topk_options o = lmloss_topk_options_default();
    o.k = path.k;
    o.renormalize = 0;
    TopkCase tc(p, o, {.device = Device::cuda, .dtype = LMLOSS_BF16});
    lmloss::Context one_chunk;
    ASSERT_EQ(tc.run(one_chunk.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    lmloss::Context chunked;
    chunked.set_workspace_budget(one_chunk.peak_workspace() * path.budget_percent / 100);
    ASSERT_EQ(tc.run(chunked.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_topk_matches_reference(tc, tolerance(LMLOSS_F32));
    EXPECT_LE(chunked.peak_workspace(), chunked.workspace_budget());
    EXPECT_LT(chunked.peak_workspace(), one_chunk.peak_workspace() * 560 / n)
        << "one-chunk " << one_chunk.peak_workspace() << " bytes, budget " << chunked.workspace_budget();
  }
}

// Teacher top-k through a 16-bit head for k past the tiles' candidates, selected from the logits
// the product keeps at or above a bar taken from a sample of each row (W's rows step i + step / 2,
// step = V / 1024): against the reference for k 129 to past where the list outgrows shared
// memory, in both dtypes, renormalised at T 1 or with the tail at T 0.7; bitwise on a second run;
// in token chunks under a small budget. Two rows take the way around: token 1's hidden state
// is zero (every logit ties, the list overflows), and token 2 sees only W's first column, which
// is large at every sampled row and small elsewhere (its bar is set too high: fewer than k pass).
TEST_F(Cuda, TopkFromTheProductAboveASampledBar) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4020);
  const int64_t n = 70, V = 50021, H = 72;
  reference::Problem p = gen.problem({.n_tokens = n, .vocab = V, .hidden = H});
  for (int64_t t = 0; t < n; ++t) p.hidden_states[t * H] = 0.0;  // W's first column is token 2's alone
  for (int64_t h = 0; h < H; ++h) {
    p.hidden_states[1 * H + h] = 0.0;
    p.hidden_states[2 * H + h] = h == 0 ? 1.0 : 0.0;
  }
  const int64_t step = V / 1024;
  for (int64_t j = 0; j < V; ++j) {
    const bool sampled = j % step == step / 2 && j / step < 1024;
    double& w = p.weight[j * H];
    w = sampled ? 4.0 + double((j / step) % 64) / 16 : w / 16;  // exact in 16 bits where sampled
  }
  for (const lmloss_dtype dtype : {LMLOSS_BF16, LMLOSS_F16}) {
    for (const int64_t k : {int64_t(129), int64_t(1000), int64_t(4500)}) {
      for (const double temperature : {1.0, 0.7}) {
        const int renormalize = temperature == 1.0;
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " k " + std::to_string(k) + " T " +
                     std::to_string(temperature) + " renormalize " + std::to_string(renormalize));
        lmloss_topk_options o = lmloss_topk_options_default();
        o.k = k;
        o.temperature = temperature;
        o.renormalize = renormalize;
        TopkCase tc(p, o, {.device = Device::cuda, .dtype = dtype});
        lmloss::Context ctx;
        ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
        expect_topk_matches_reference(tc, tolerance(LMLOSS_F32));
        // The lists (at most 115 KB a row here), the sample, 16 rows redone and cuBLASLt's
        // workspace for the sample (4 MiB): no logits chunk (n x V x 4 bytes, 14 MB) nor the
        // logits product's 32 MiB of cuBLASLt workspace.
        EXPECT_LT(ctx.peak_workspace(), size_t(20) << 20);
        const std::vector<int64_t> ids = tc.ids.ids();
        const std::vector<double> probs = tc.probs.values();
        ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
        EXPECT_EQ(ids, tc.ids.ids());
        EXPECT_TRUE(bitwise_equal(probs, tc.probs.values()));
        for (int64_t i = 0; i < k; ++i) ASSERT_EQ(ids[1 * k + i], i) << "the zero row: its first k ids, in order";
        SCOPED_TRACE("chunked");
        lmloss::Context chunked;
        chunked.set_workspace_budget(size_t(9) << 19);  // 4.5 MiB: chunks of about 10 to 40 rows
        ASSERT_EQ(tc.run(chunked.get()), LMLOSS_SUCCESS) << lmloss_last_error();
        expect_topk_matches_reference(tc, tolerance(LMLOSS_F32));
        EXPECT_LE(chunked.peak_workspace(), chunked.workspace_budget());
      }
    }
  }
}

// Top-k of long rows, where the selection first gathers what passes a threshold set from a
// sample of the row (runs of 8 adjacent values, evenly spaced) in one pass: against the
// reference for rows of random values, ascending and descending ones, rows of a few tied values
// (more pass than shared memory holds), and a row whose largest values sit exactly where the
// sample looks (fewer than k pass): both fall back to the histogram passes. Logits in f32 and
// bf16 and through an f32 head; k from 1 to past where the one pass is tried; renormalised or
// with the tail; bitwise on a second run.
TEST_F(Cuda, TopkOfLongRowsFromASampledThreshold) {
  Generator gen(4017);
  const int64_t n = 6;
  for (const int64_t V : {int64_t(20011), int64_t(70001)}) {
    reference::Problem p = gen.problem({.n_tokens = n, .vocab = V});
    for (int64_t j = 0; j < V; ++j) {
      p.logits[1 * V + j] = 8.0 * double(j) / double(V);       // ascending
      p.logits[2 * V + j] = -8.0 * double(j) / double(V);      // descending
      p.logits[3 * V + j] = double(j * 7919 % 3);              // three values, thousands of ties
    }
    // Row 4: small values, except large distinct ones at every position the sample of 1024
    // values reads (128 evenly spaced runs of 8), so the sampled threshold lets too few pass.
    for (int64_t j = 0; j < V; ++j) p.logits[4 * V + j] = -double(j % 97) / 97.0;
    const int64_t sample = 1024, runs = sample / 8;
    for (int64_t i = 0; i < sample; ++i) {
      const int64_t j = (2 * (i / 8) + 1) * V / (2 * runs) / 8 * 8 + i % 8;
      p.logits[4 * V + j] = 10.0 + double(j) / double(V);
    }
    const reference::Problem head = gen.problem({.n_tokens = n, .vocab = V, .hidden = 32});
    for (const int64_t k : {int64_t(1), int64_t(64), int64_t(2048), int64_t(4500)}) {
      for (const int renormalize : {1, 0}) {
        for (const lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
          for (const bool linear : {false, true}) {
            if (linear && dtype != LMLOSS_F32) continue;  // 16-bit heads take the product's path
            SCOPED_TRACE(std::string(linear ? "head " : "logits ") + dtype_name(dtype) + " V " + std::to_string(V) +
                         " k " + std::to_string(k) + " renormalize " + std::to_string(renormalize));
            lmloss_topk_options o = lmloss_topk_options_default();
            o.k = k;
            o.renormalize = renormalize;
            TopkCase tc(linear ? head : p, o, {.device = Device::cuda, .dtype = dtype});
            lmloss::Context ctx;
            ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
            expect_topk_matches_reference(tc, linear ? tolerance(LMLOSS_F32) : 0.0);
            const std::vector<int64_t> ids = tc.ids.ids();
            const std::vector<double> probs = tc.probs.values();
            ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
            EXPECT_EQ(ids, tc.ids.ids());
            EXPECT_TRUE(bitwise_equal(probs, tc.probs.values()));
          }
        }
      }
    }
  }
}

TEST_F(Cuda, RunsAreBitwiseIdentical) {
  Generator gen(4003);
  for (lmloss_dtype dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    SCOPED_TRACE(dtype_name(dtype));
    ProblemSpec spec{.n_tokens = 512, .vocab = 4099, .hidden = 128, .bias = true, .top_k = 16};
    lmloss_loss_options o = options_named("distill_mixed");
    o.label_smoothing = 0.05;
    LossCase c(gen.problem(spec), o, setup(dtype, LMLOSS_F32));
    lmloss::Context ctx;
    ctx.set_workspace_budget(budget_for_rows(100, spec.vocab));
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    const std::vector<double> first = c.output_values();
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_TRUE(bitwise_equal(first, c.output_values()));

    lmloss_topk_options t = lmloss_topk_options_default();
    t.k = 100;
    t.renormalize = 0;
    TopkCase tc(gen.problem(spec), t, {.device = Device::cuda, .dtype = dtype});
    ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    const std::vector<int64_t> ids = tc.ids.ids();
    const std::vector<double> probs = tc.probs.values();
    ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_EQ(ids, tc.ids.ids());
    EXPECT_TRUE(bitwise_equal(probs, tc.probs.values()));
  }
}

// Top-k beyond what one block sorts in shared memory (the device-memory path), and rows full of
// ties (the exact-threshold path), both against the reference.
TEST_F(Cuda, TopkLargeKAndTiedRows) {
  Generator gen(4004);
  lmloss::Context ctx;
  for (int64_t k : {int64_t(9000), int64_t(20000)}) {
    SCOPED_TRACE("k " + std::to_string(k));
    lmloss_topk_options t = lmloss_topk_options_default();
    t.k = k;
    t.renormalize = k == 9000 ? 0 : 1;
    TopkCase tc(gen.problem({.n_tokens = 5, .vocab = 30011}), t, {.device = Device::cuda});
    ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_topk_matches_reference(tc, 0);
  }
  // Every logit one of three values: thousands of exact ties at the k-th value.
  reference::Problem p = gen.problem({.n_tokens = 4, .vocab = 20000});
  for (size_t i = 0; i < p.logits.size(); ++i) p.logits[i] = double(int64_t(i * 7919 % 3));
  for (int64_t k : {int64_t(10), int64_t(7000), int64_t(12000)}) {
    SCOPED_TRACE("tied, k " + std::to_string(k));
    lmloss_topk_options t = lmloss_topk_options_default();
    t.k = k;
    TopkCase tc(p, t, {.device = Device::cuda});
    ASSERT_EQ(tc.run(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_topk_matches_reference(tc, 0);
  }
}

// A label out of range cannot be seen before the call without reading the device: the call
// succeeds, the token's loss is NaN and its gradient zero, synchronize reports it once, and the
// context keeps working.
TEST_F(Cuda, IdOutOfRangeIsReportedBySynchronizeAndTheContextRecovers) {
  Generator gen(4005);
  ProblemSpec spec{.n_tokens = 16, .vocab = 300, .ignore_fraction = 0, .top_k = 4};
  lmloss_loss_options o = options_named("distill_mixed");
  o.reduction = LMLOSS_REDUCTION_NONE;
  LossCase c(gen.problem(spec), o, setup(LMLOSS_F32, LMLOSS_F32));
  lmloss::Context ctx;
  for (int which = 0; which < 2; ++which) {
    SCOPED_TRACE(which == 0 ? "label" : "teacher id");
    LossCase bad(c.problem(), o, setup(LMLOSS_F32, LMLOSS_F32));
    const int64_t token = 5;
    if (which == 0) bad.labels.set_id(token, spec.vocab + 7);
    else bad.teacher_ids.set_id(token * spec.top_k + 2, -3);
    const lmloss_status status = bad.invoke(ctx.get(), [&] {
      const lmloss_head head = bad.head();
      const lmloss_targets targets = bad.targets();
      const lmloss_grads grads = bad.grads();
      const lmloss_tensor loss = bad.loss_tensor(), lse = bad.lse_tensor();
      return lmloss_loss_forward_backward(ctx.get(), &head, &targets, &bad.options, nullptr, &loss, &lse,
                                          &grads);
    });
    EXPECT_EQ(status, LMLOSS_ERROR_ID_OUT_OF_RANGE) << lmloss_last_error();
    EXPECT_TRUE(std::isnan(bad.loss.get(token)));
    for (int64_t t = 0; t < spec.n_tokens; ++t) {
      if (t != token) {
        EXPECT_FALSE(std::isnan(bad.loss.get(t))) << "token " << t;
      }
    }
    for (int64_t j = 0; j < spec.vocab; ++j) ASSERT_EQ(bad.grad_logits.get(token * spec.vocab + j), 0.0);
    // Reported once; the next calls on the same context are clean and right.
    EXPECT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS);
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_matches_reference(c, Mode::forward_backward);
  }
}

void CUDART_CB hold_stream(void* milliseconds) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(milliseconds)));
}

// With the stream held by earlier work, a call must return at once, its work still queued. The
// stream is a blocking one, so the harness's copies (on the legacy stream) are ordered with it,
// and any hidden use of the legacy stream inside the call would wait for the hold too.
TEST_F(Cuda, CallsDoNotWaitForTheStream) {
  Generator gen(4006);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  for (bool linear : {true, false}) {
    SCOPED_TRACE(linear ? "linear" : "logits");
    ProblemSpec spec{.n_tokens = 256, .vocab = 3001, .top_k = 4};
    if (linear) spec.hidden = 64;
    LossCase c(gen.problem(spec), options_named("distill_mixed"),
               setup(LMLOSS_BF16, linear ? LMLOSS_F32 : LMLOSS_BF16));
    lmloss::Context ctx;
    ctx.set_stream(stream);
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();  // warm: plans made
    static int hold_ms = 400;
    ASSERT_EQ(cudaLaunchHostFunc(stream, hold_stream, &hold_ms), cudaSuccess);
    auto call = [&] {
      const lmloss_head head = c.head();
      const lmloss_targets targets = c.targets();
      const lmloss_grads grads = c.grads();
      const lmloss_tensor loss = c.loss_tensor(), lse = c.lse_tensor();
      return lmloss_loss_forward_backward(ctx.get(), &head, &targets, &c.options, nullptr, &loss, &lse, &grads);
    };
    const auto start = std::chrono::steady_clock::now();
    const lmloss_status status = call();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    const cudaError_t pending = cudaStreamQuery(stream);
    EXPECT_EQ(status, LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_EQ(pending, cudaErrorNotReady) << "the call waited for the stream";
    EXPECT_LT(ms, 200.0) << "the call took as long as the held stream";
    // A query that found work pending is no error of the thread's: the next call's launch checks
    // must not take it for one.
    EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
    EXPECT_EQ(call(), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "the hold ended before the second call";
    EXPECT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_EQ(cudaStreamQuery(stream), cudaSuccess);
  }
  cudaStreamDestroy(stream);
}

lmloss_status launch(cudaGraphExec_t exec, cudaStream_t stream) {
  return cudaGraphLaunch(exec, stream) == cudaSuccess ? LMLOSS_SUCCESS : LMLOSS_ERROR_BACKEND;
}

// Enqueues `work` on `stream` under capture (global mode: any call unsafe in a graph, from this
// thread or another, invalidates it), instantiates the graph into *exec and launches it once.
lmloss_status capture_and_launch(cudaStream_t stream, cudaGraphExec_t* exec,
                                 const std::function<lmloss_status()>& work) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) != cudaSuccess) return LMLOSS_ERROR_BACKEND;
  const lmloss_status status = work();
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (status != LMLOSS_SUCCESS || ended != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    if (ended != cudaSuccess) ADD_FAILURE() << "capture: " << cudaGetErrorString(ended);
    cudaGetLastError();
    return status != LMLOSS_SUCCESS ? status : LMLOSS_ERROR_BACKEND;
  }
  const cudaError_t made = cudaGraphInstantiate(exec, graph, 0);
  cudaGraphDestroy(graph);
  if (made != cudaSuccess) {
    ADD_FAILURE() << "instantiate: " << cudaGetErrorString(made);
    return LMLOSS_ERROR_BACKEND;
  }
  return launch(*exec, stream);
}

// The inputs of `from` (values and ids, on the host) into `to`'s buffers of the same shapes: the
// next upload puts them where a graph captured on `to` reads.
void copy_inputs(LossCase& to, const LossCase& from) {
  for (auto [dst, src] : {std::pair{&to.logits, &from.logits}, {&to.hidden, &from.hidden}, {&to.weight, &from.weight},
                          {&to.bias, &from.bias}, {&to.teacher_probs, &from.teacher_probs}})
    if (src->present()) dst->fill(src->values());
  for (auto [dst, src] : {std::pair{&to.labels, &from.labels}, {&to.teacher_ids, &from.teacher_ids}}) {
    if (!src->present()) continue;
    const std::vector<int64_t> ids = src->ids();
    for (size_t i = 0; i < ids.size(); ++i) dst->set_id(int64_t(i), ids[i]);
  }
}

// After a first call, a context's calls can be captured into a CUDA graph: each launch of it
// computes what a direct call on the buffers' contents at launch computes, bitwise, every output
// written (they are poisoned before each). A fused bf16 step (on sm_90 the statistics product's
// path, its dX product on the side stream, in three chunks), an f32 one with a bias and a
// teacher, a bf16 forward, and a bf16 dW kept as its f32 sum and rounded in the same graph. A
// context's first call under capture is refused, saying why, and the context then works.
TEST_F(Cuda, CallsCapturedInAGraphReplayOnTheBuffersContents) {
  Generator gen(4041);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);  // blocking: ordered with the harness's copies
  struct GraphCase {
    const char* name;
    lmloss_dtype dtype, grad_dtype;
    ProblemSpec spec;
    const char* options;
    Mode mode;
    bool keep_weight_sum;
  };
  const ProblemSpec step{.n_tokens = 700, .vocab = 1999, .hidden = 136};
  const GraphCase cases[] = {
      {"bf16 fused step", LMLOSS_BF16, LMLOSS_BF16, step, "zloss_temperature", Mode::forward_backward, false},
      {"f32 fused distillation with a bias", LMLOSS_F32, LMLOSS_F32,
       {.n_tokens = 300, .vocab = 1999, .hidden = 72, .bias = true, .top_k = 8}, "distill_mixed",
       Mode::forward_backward, false},
      {"bf16 forward", LMLOSS_BF16, LMLOSS_F32, step, "plain", Mode::forward, false},
      {"bf16 kept dW sum, rounded", LMLOSS_BF16, LMLOSS_BF16, {.n_tokens = 300, .vocab = 2000, .hidden = 40},
       "plain", Mode::forward_backward, true},
  };
  for (const GraphCase& gc : cases) {
    SCOPED_TRACE(gc.name);
    const lmloss_loss_options o = options_named(gc.options);
    LossSetup s = setup(gc.dtype, gc.grad_dtype);
    s.want_grad_bias = gc.spec.bias;
    LossCase c(gen.problem(gc.spec), o, s), other(gen.problem(gc.spec), o, s);
    const int64_t tail_rows = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(gc.spec.vocab);
    Buffer c_tail, other_tail;
    if (gc.keep_weight_sum) {
      c_tail = Buffer(Device::cuda, LMLOSS_F32, 2, tail_rows, gc.spec.hidden);
      other_tail = Buffer(Device::cuda, LMLOSS_F32, 2, tail_rows, gc.spec.hidden);
      c.options.grad_weight_sum_tail = c_tail.tensor();
      other.options.grad_weight_sum_tail = other_tail.tensor();
    }
    lmloss::Context ctx;
    ctx.set_stream(stream);
    ctx.set_workspace_budget(budget_for_rows(260, gc.spec.vocab));
    // The call(s) on a case's buffers, enqueued and not waited for.
    auto work = [&](LossCase& on) -> lmloss_status {
      const lmloss_head h = on.head();
      const lmloss_targets t = on.targets();
      const lmloss_grads g = on.grads();
      const lmloss_tensor loss_t = on.loss_tensor(), lse_t = on.lse_tensor();
      if (gc.mode == Mode::forward) return lmloss_loss_forward(ctx.get(), &h, &t, &on.options, &loss_t, &lse_t);
      const lmloss_status st =
          lmloss_loss_forward_backward(ctx.get(), &h, &t, &on.options, nullptr, &loss_t, &lse_t, &g);
      if (st != LMLOSS_SUCCESS || !gc.keep_weight_sum) return st;
      const lmloss_tensor tail_t = on.options.grad_weight_sum_tail;
      return lmloss_round_grad_weight(ctx.get(), &g.grad_weight, &tail_t, nullptr);
    };

    cudaGraphExec_t exec = nullptr;
    auto captured = [&] { return capture_and_launch(stream, &exec, [&] { return work(c); }); };
    const lmloss_status first = c.invoke(ctx.get(), captured);
    EXPECT_EQ(first, LMLOSS_ERROR_UNSUPPORTED) << "a context's first call under capture";
    EXPECT_NE(std::string(lmloss_last_error()).find("before capturing"), std::string::npos) << lmloss_last_error();
    ASSERT_EQ(exec, nullptr);

    ASSERT_EQ(c.invoke(ctx.get(), [&] { return work(c); }), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_matches_reference(c, gc.mode);
    const std::vector<double> direct = c.output_values();
    ASSERT_EQ(other.invoke(ctx.get(), [&] { return work(other); }), LMLOSS_SUCCESS) << lmloss_last_error();
    const std::vector<double> direct_other = other.output_values();

    ASSERT_EQ(c.invoke(ctx.get(), captured), LMLOSS_SUCCESS) << lmloss_last_error();
    EXPECT_TRUE(bitwise_equal(direct, c.output_values()));
    copy_inputs(c, other);
    ASSERT_EQ(c.invoke(ctx.get(), [&] { return launch(exec, stream); }), LMLOSS_SUCCESS);
    EXPECT_TRUE(bitwise_equal(direct_other, c.output_values()));
    cudaGraphExecDestroy(exec);
  }
  cudaStreamDestroy(stream);
}

// With product tuning a shape's first call times cuBLASLt's candidates and waits for them: under
// capture that call is refused, saying why; a graph captured after it replays the tuned call.
TEST_F(Cuda, ProductTuningIsDoneBeforeCapture) {
  Generator gen(4043);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const lmloss_loss_options o = options_named("plain");
  LossCase tuned(gen.problem({.n_tokens = 700, .vocab = 1999, .hidden = 136}), o, setup(LMLOSS_BF16, LMLOSS_F32));
  LossCase untuned(gen.problem({.n_tokens = 500, .vocab = 2003, .hidden = 64}), o, setup(LMLOSS_BF16, LMLOSS_F32));
  lmloss::Context ctx;
  ctx.set_stream(stream);
  ctx.set_product_tuning(true);
  auto work = [&](LossCase& on) {
    const lmloss_head h = on.head();
    const lmloss_targets t = on.targets();
    const lmloss_grads g = on.grads();
    const lmloss_tensor loss_t = on.loss_tensor(), lse_t = on.lse_tensor();
    return lmloss_loss_forward_backward(ctx.get(), &h, &t, &on.options, nullptr, &loss_t, &lse_t, &g);
  };
  ASSERT_EQ(tuned.invoke(ctx.get(), [&] { return work(tuned); }), LMLOSS_SUCCESS) << lmloss_last_error();
  const std::vector<double> direct = tuned.output_values();

  cudaGraphExec_t exec = nullptr;
  EXPECT_EQ(untuned.invoke(ctx.get(), [&] { return capture_and_launch(stream, &exec, [&] { return work(untuned); }); }),
            LMLOSS_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(lmloss_last_error()).find("product tuning"), std::string::npos) << lmloss_last_error();
  ASSERT_EQ(exec, nullptr);
  ASSERT_EQ(tuned.invoke(ctx.get(), [&] { return capture_and_launch(stream, &exec, [&] { return work(tuned); }); }),
            LMLOSS_SUCCESS)
      << lmloss_last_error();
  EXPECT_TRUE(bitwise_equal(direct, tuned.output_values()));
  cudaGraphExecDestroy(exec);
  ASSERT_EQ(untuned.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  expect_matches_reference(untuned, Mode::forward_backward);
  cudaStreamDestroy(stream);
}

// A teacher's top-k captured the same way: k 64 (on sm_90 from each column group's best) and k
// 1000 (the logits above a sampled bar), each graph's launches against direct calls, bitwise.
TEST_F(Cuda, TopkCapturedInAGraphReplaysOnTheBuffersContents) {
  Generator gen(4042);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  const ProblemSpec spec{.n_tokens = 70, .vocab = 50021, .hidden = 72};
  for (const int64_t k : {int64_t(64), int64_t(1000)}) {
    SCOPED_TRACE("k " + std::to_string(k));
    lmloss_topk_options o = lmloss_topk_options_default();
    o.k = k;
    o.renormalize = 0;
    TopkCase c(gen.problem(spec), o, {.device = Device::cuda, .dtype = LMLOSS_BF16});
    TopkCase other(gen.problem(spec), o, {.device = Device::cuda, .dtype = LMLOSS_BF16});
    lmloss::Context ctx;
    ctx.set_stream(stream);
    auto work = [&](TopkCase& on) {
      const lmloss_head h = on.head();
      const lmloss_tensor ids_t = on.ids.tensor(), probs_t = on.probs.tensor(), tail_t = on.tail.tensor();
      return lmloss_topk(ctx.get(), &h, &on.options, &ids_t, &probs_t, &tail_t);
    };
    auto outputs = [](const TopkCase& on) {
      std::vector<double> v = on.probs.values(), tail = on.tail.values();
      for (const int64_t id : on.ids.ids()) v.push_back(double(id));
      v.insert(v.end(), tail.begin(), tail.end());
      return v;
    };
    ASSERT_EQ(c.invoke(ctx.get(), [&] { return work(c); }), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_topk_matches_reference(c, tolerance(LMLOSS_F32));
    const std::vector<double> direct = outputs(c);
    ASSERT_EQ(other.invoke(ctx.get(), [&] { return work(other); }), LMLOSS_SUCCESS) << lmloss_last_error();
    const std::vector<double> direct_other = outputs(other);

    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(c.invoke(ctx.get(), [&] { return capture_and_launch(stream, &exec, [&] { return work(c); }); }),
              LMLOSS_SUCCESS)
        << lmloss_last_error();
    EXPECT_TRUE(bitwise_equal(direct, outputs(c)));
    c.hidden.fill(other.hidden.values());
    c.weight.fill(other.weight.values());
    ASSERT_EQ(c.invoke(ctx.get(), [&] { return launch(exec, stream); }), LMLOSS_SUCCESS);
    EXPECT_TRUE(bitwise_equal(direct_other, outputs(c)));
    cudaGraphExecDestroy(exec);
  }
  cudaStreamDestroy(stream);
}

// Top-k above the shared-memory sort's capacity over more than 500 rows in one launch (where CUB's
// segmented merge sort would copy to the host and wait): the call is captured into a graph, so it
// never syncs, and the graph gives what the direct call gave.
TEST_F(Cuda, TopkBeyondSharedMemoryOverManyRowsIsCaptured) {
  Generator gen(4044);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  lmloss_topk_options o = lmloss_topk_options_default();
  o.k = 9000;
  o.renormalize = 0;
  TopkCase c(gen.problem({.n_tokens = 600, .vocab = 12011}), o, {.device = Device::cuda});
  lmloss::Context ctx;
  ctx.set_stream(stream);
  auto work = [&] {
    const lmloss_head h = c.head();
    const lmloss_tensor ids_t = c.ids.tensor(), probs_t = c.probs.tensor(), tail_t = c.tail.tensor();
    return lmloss_topk(ctx.get(), &h, &c.options, &ids_t, &probs_t, &tail_t);
  };
  auto outputs = [&] {
    std::vector<double> v = c.probs.values();
    for (const int64_t id : c.ids.ids()) v.push_back(double(id));
    return v;
  };
  ASSERT_EQ(c.invoke(ctx.get(), work), LMLOSS_SUCCESS) << lmloss_last_error();
  expect_topk_matches_reference(c, 0);
  const std::vector<double> direct = outputs();
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(c.invoke(ctx.get(), [&] { return capture_and_launch(stream, &exec, work); }), LMLOSS_SUCCESS)
      << lmloss_last_error();
  EXPECT_TRUE(bitwise_equal(direct, outputs()));
  if (exec) cudaGraphExecDestroy(exec);
  cudaStreamDestroy(stream);
}

struct CountingAllocator {
  int allocs = 0, frees = 0;
  size_t largest = 0;
  static void* alloc(void* user, size_t bytes, int32_t, void* stream) {
    auto* self = static_cast<CountingAllocator*>(user);
    void* p = nullptr;
    if (cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream)) != cudaSuccess) return nullptr;
    ++self->allocs;
    self->largest = std::max(self->largest, bytes);
    return p;
  }
  static void free(void* user, void* p, size_t, int32_t, void* stream) {
    ++static_cast<CountingAllocator*>(user)->frees;
    cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
  }
};

TEST_F(Cuda, WorkspaceStaysWithinBudgetAndComesFromTheCallersAllocator) {
  Generator gen(4007);
  ProblemSpec spec{.n_tokens = 1000, .vocab = 8191, .hidden = 96, .bias = true};
  LossCase c(gen.problem(spec), lmloss_loss_options_default(), setup(LMLOSS_BF16, LMLOSS_F32));
  for (size_t budget : {size_t(1) << 20, size_t(8) << 20, size_t(1) << 30}) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    lmloss::Context ctx;
    ctx.set_workspace_budget(budget);
    CountingAllocator counter;
    const lmloss_allocator allocator{&CountingAllocator::alloc, &CountingAllocator::free, &counter};
    ctx.set_allocator(&allocator);
    ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
    expect_matches_reference(c, Mode::forward_backward);
    EXPECT_GT(ctx.peak_workspace(), 0u);
    EXPECT_LE(ctx.peak_workspace(), budget);
    EXPECT_GT(counter.allocs, 0);
    EXPECT_EQ(counter.allocs, counter.frees);
    EXPECT_LE(counter.largest, budget);
  }
  // A budget too small for one row fails before anything is written.
  lmloss::Context tiny;
  tiny.set_workspace_budget(4096);
  EXPECT_EQ(c.forward_backward(tiny.get()), LMLOSS_ERROR_INVALID_ARGUMENT);
}

// A budget that holds the gradient pass's pieces but not the exponential form's label order (16
// bytes a token): a fused bf16 step of many short rows still runs, on the gradient pass, within it.
TEST_F(Cuda, FusedStepWithoutRoomForTheLabelOrderTakesTheGradientPass) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4020);
  const int64_t n_tokens = 65536;
  LossCase c(gen.problem({.n_tokens = n_tokens, .vocab = 257, .hidden = 64}), lmloss_loss_options_default(),
             setup(LMLOSS_BF16, LMLOSS_F32));
  const size_t budget = 12 * size_t(n_tokens);  // the per-token loss takes 4 of them
  lmloss::Context ctx;
  ctx.set_workspace_budget(budget);
  ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  expect_matches_reference(c, Mode::forward_backward);
  EXPECT_LE(ctx.peak_workspace(), budget);
}

// dW's large entries take 388 bytes a token (16 slots and a row scale, with their sort): a budget
// that holds the exponential form's pieces (~1 KB a chunk row here, 20 bytes a token) but not
// them runs without them, within it; a larger one holds them too. Both match the reference and
// rerun bitwise.
TEST_F(Cuda, FusedStepWithoutRoomForTheLargeEntriesRunsWithinTheBudget) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  Generator gen(4024);
  const int64_t n_tokens = 65536;
  const reference::Problem p = gen.problem({.n_tokens = n_tokens, .vocab = 257, .hidden = 64});
  for (const size_t bytes_a_token : {200, 800}) {
    SCOPED_TRACE(std::to_string(bytes_a_token) + " bytes a token");
    LossCase c(p, lmloss_loss_options_default(), setup(LMLOSS_BF16, LMLOSS_F32));
    const size_t budget = bytes_a_token * size_t(n_tokens);
    lmloss::Context ctx;
    ctx.set_workspace_budget(budget);
    ASSERT_NO_FATAL_FAILURE(expect_reference_then_bitwise_rerun(c, ctx));
    EXPECT_LE(ctx.peak_workspace(), budget);
  }
}

TEST_F(Cuda, F64IsRejectedWithAMessage) {
  Generator gen(4008);
  LossCase c(gen.problem({.n_tokens = 4, .vocab = 50}), lmloss_loss_options_default(),
             setup(LMLOSS_F64, LMLOSS_F64));
  lmloss::Context ctx;
  EXPECT_EQ(c.forward(ctx.get()), LMLOSS_ERROR_UNSUPPORTED);
  EXPECT_NE(std::string(lmloss_last_error()).find("f64"), std::string::npos) << lmloss_last_error();
}

// bf16 logits of N x V > 2^31 elements, the gradient in place. Rows repeat a pool of random rows,
// so the rows past 2^31 elements are checked against the reference of their pool row.
TEST_F(Cuda, SixtyFourBitIndexing) {
  const int64_t vocab = 131072, n_tokens = 16400, pool = 8;
  ASSERT_GT(double(vocab) * double(n_tokens), 2147483648.0);
  Generator gen(4009);
  reference::Problem rows = rounded(gen.problem({.n_tokens = pool, .vocab = vocab, .ignore_fraction = 0}),
                                    LMLOSS_BF16);
  std::vector<uint16_t> host(size_t(pool) * vocab);
  for (size_t i = 0; i < host.size(); ++i) {
    const float f = float(rows.logits[i]);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    host[i] = uint16_t(u >> 16);  // exact: the values are already bf16
  }
  const size_t row_bytes = size_t(vocab) * 2;
  void* logits = nullptr;
  ASSERT_EQ(cudaMalloc(&logits, row_bytes * n_tokens), cudaSuccess);
  for (int64_t t = 0; t < n_tokens; ++t)
    ASSERT_EQ(cudaMemcpy(static_cast<char*>(logits) + row_bytes * t, host.data() + (t % pool) * vocab, row_bytes,
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  std::vector<int32_t> labels(n_tokens);
  for (int64_t t = 0; t < n_tokens; ++t) labels[t] = int32_t(rows.labels[t % pool]);
  int32_t* d_labels = nullptr;
  float *d_loss = nullptr, *d_lse = nullptr;
  ASSERT_EQ(cudaMalloc(&d_labels, 4 * n_tokens), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_loss, 4 * n_tokens), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_lse, 4 * n_tokens), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_labels, labels.data(), 4 * n_tokens, cudaMemcpyHostToDevice), cudaSuccess);

  auto device_tensor = [](lmloss_tensor t) {
    t.device_type = LMLOSS_DEVICE_CUDA;
    return t;
  };
  lmloss_head head{};
  head.logits = device_tensor(lmloss_tensor_2d(logits, LMLOSS_BF16, n_tokens, vocab, 0));
  lmloss_targets targets{};
  targets.labels = device_tensor(lmloss_tensor_1d(d_labels, LMLOSS_I32, n_tokens));
  lmloss_grads grads{};
  grads.grad_logits = head.logits;  // in place
  lmloss_loss_options o = lmloss_loss_options_default();
  o.reduction = LMLOSS_REDUCTION_NONE;
  const lmloss_tensor loss = device_tensor(lmloss_tensor_1d(d_loss, LMLOSS_F32, n_tokens));
  const lmloss_tensor lse = device_tensor(lmloss_tensor_1d(d_lse, LMLOSS_F32, n_tokens));
  lmloss::Context ctx;
  ASSERT_EQ(lmloss_loss_forward_backward(ctx.get(), &head, &targets, &o, nullptr, &loss, &lse, &grads),
            LMLOSS_SUCCESS)
      << lmloss_last_error();
  ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();

  const reference::LossResult ref = reference::loss(rows, o);
  std::vector<float> got_loss(n_tokens);
  ASSERT_EQ(cudaMemcpy(got_loss.data(), d_loss, 4 * n_tokens, cudaMemcpyDeviceToHost), cudaSuccess);
  std::vector<uint16_t> got_row(vocab);
  for (int64_t t : {int64_t(0), n_tokens - pool - 1, n_tokens - 1}) {
    SCOPED_TRACE("token " + std::to_string(t));
    const int64_t p = t % pool;
    EXPECT_TRUE(close_to({double(got_loss[t])}, {ref.loss[p]}, tolerance(LMLOSS_F32)));
    ASSERT_EQ(cudaMemcpy(got_row.data(), static_cast<char*>(logits) + row_bytes * t, row_bytes,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<double> grad(vocab), want(vocab);
    for (int64_t j = 0; j < vocab; ++j) {
      const uint32_t u = uint32_t(got_row[j]) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      grad[j] = f;
      want[j] = ref.grad_logits[p * vocab + j];
    }
    EXPECT_TRUE(close_to(grad, want, tolerance(LMLOSS_BF16)));
  }
  cudaFree(logits);
  cudaFree(d_labels);
  cudaFree(d_loss);
  cudaFree(d_lse);
}

// A fused step whose one chunk holds N x V > 2^31 logits (a budget with room for every row), bf16
// in the exponential form and through the gradient pass (label smoothing). The tokens repeat a
// pool of 8 (hidden state and label), so the step is the pool's: each token's loss and lse its
// pool row's, dX its pool row's times 8 / N (its share of the mean), dW the pool's. dW in f32, and
// in bf16 summed in f32 and added to zeros: on sm_90a that one chunk's product is stored over the
// sum (weight_grad_store.cuh), its gradient operand past 2^31 elements too.
TEST_F(Cuda, FusedStepOfAChunkPast2To31LogitsMatchesReference) {
  LMLOSS_REQUIRE_STATISTICS_PRODUCT();
  const int64_t hidden = 64, n_tokens = 16400, pool = 8;
  Generator gen(4041);
  // f32 gradients at V 131101; bf16 at V 131104, whose store takes vocabularies of a multiple of 8.
  for (const lmloss_dtype grad_dtype : {LMLOSS_F32, LMLOSS_BF16}) {
    const int64_t vocab = grad_dtype == LMLOSS_F32 ? 131101 : 131104;
    ASSERT_GT(double(vocab) * double(n_tokens), 2147483648.0);
    reference::Problem p = gen.problem({.n_tokens = pool, .vocab = vocab, .hidden = hidden, .ignore_fraction = 0});
    p.n_tokens = n_tokens;
    p.hidden_states.resize(size_t(n_tokens * hidden));
    p.labels.resize(size_t(n_tokens));
    for (int64_t t = pool; t < n_tokens; ++t) {
      std::copy_n(p.hidden_states.begin() + (t % pool) * hidden, hidden, p.hidden_states.begin() + t * hidden);
      p.labels[size_t(t)] = p.labels[size_t(t % pool)];
    }
    for (const char* name : {"plain", "smoothing_zloss_temperature"}) {
      SCOPED_TRACE(std::string(name) + ", gradients " + dtype_name(grad_dtype));
      lmloss_loss_options o = options_named(name);
      LossSetup st = setup(LMLOSS_BF16, grad_dtype);
      if (grad_dtype == LMLOSS_BF16) {
        o.flags |= LMLOSS_SUM_GRAD_WEIGHT_IN_F32 | LMLOSS_ACCUMULATE_GRAD_WEIGHT;
        st.grad_weight_initial.assign(size_t(vocab * hidden), 0.0);
      }
      LossCase c(p, o, st);
      lmloss::Context ctx;
      ctx.set_workspace_budget(size_t(8) << 30);
      ASSERT_EQ(c.forward_backward(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
      EXPECT_GT(ctx.peak_workspace(), size_t(2) * size_t(n_tokens) * size_t(vocab)) << "one chunk of 16-bit logits";
      // The pool's reference, on the rounded inputs the call took.
      reference::Problem rows = c.problem();
      rows.n_tokens = pool;
      rows.hidden_states.resize(size_t(pool * hidden));
      rows.labels.resize(size_t(pool));
      const reference::LossResult ref = reference::loss(rows, o);
      std::vector<double> lse(static_cast<size_t>(n_tokens)), grad_hidden(static_cast<size_t>(n_tokens * hidden));
      for (int64_t t = 0; t < n_tokens; ++t) {
        lse[size_t(t)] = ref.lse[size_t(t % pool)];
        for (int64_t h = 0; h < hidden; ++h)
          grad_hidden[size_t(t * hidden + h)] = ref.grad_hidden[size_t((t % pool) * hidden + h)] * pool / n_tokens;
      }
      const double tol = tolerance(LMLOSS_BF16, LMLOSS_F32), grad_tol = tolerance(LMLOSS_BF16, grad_dtype);
      EXPECT_TRUE(close_to(c.loss.values(), ref.loss, tol));
      EXPECT_TRUE(close_to(c.lse.values(), lse, tol));
      EXPECT_TRUE(close_to(c.grad_hidden.values(), grad_hidden, grad_tol));
      EXPECT_TRUE(close_to(c.grad_weight.values(), ref.grad_weight, grad_tol));
      if (grad_dtype == LMLOSS_F32) {  // bf16's started as zeros
        EXPECT_TRUE(fully_written(c.grad_weight));
      }
    }
  }
}

}  // namespace
}  // namespace lmloss::test
