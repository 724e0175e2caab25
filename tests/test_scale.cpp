// lmloss_scale_gradient: out = grad * scale, rounded once into out's dtype, on every device, grad
// dtype and output dtype; bad arguments change nothing.
#include <cmath>
#include <string>
#include <vector>

#include "harness.hpp"
#include "lmloss/lmloss.hpp"

namespace lmloss::test {
namespace {

// The parameter is out's dtype; grad is f64 for an f64 out (CPU only), else f32, bf16 or f16 (a
// framework's dW kept in f32, its dX in the head's dtype).
class ScaleGradient : public DeviceDtypeTest {
 protected:
  std::vector<lmloss_dtype> grad_dtypes() const {
    if (dtype() == LMLOSS_F64) return {LMLOSS_F64};
    return {LMLOSS_F32, LMLOSS_BF16, LMLOSS_F16};
  }
  // The dtype the product is computed in, and the scale's.
  static lmloss_dtype product_dtype(lmloss_dtype grad) { return grad == LMLOSS_F64 ? LMLOSS_F64 : LMLOSS_F32; }

  // Values of every magnitude and sign, so the output's rounding is exercised.
  static std::vector<double> gradient_values(int64_t n) {
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[i] = std::sin(0.37 * double(i) + 0.1) * std::pow(10.0, double(i % 7) - 4);
    return v;
  }

  // What the call must store for a grad element g (already in grad's dtype): the product in
  // product_dtype, rounded once into out's.
  double expected(lmloss_dtype grad, double g, double s) const {
    const double product = grad == LMLOSS_F64 ? g * s : double(float(g) * float(s));
    return round_to(dtype(), product);
  }

  lmloss::Context ctx;
};

struct ScaleShape {
  int ndim;
  int64_t rows, cols, stride;
};

// Shapes for the vectorised path (rows of a multiple of 4, 16-byte aligned) and the scalar one
// (odd columns, padded rows), a vector and a scalar; a scale and none (1).
TEST_P(ScaleGradient, MatchesTheProductRoundedOnce) {
  for (const lmloss_dtype grad_dtype : grad_dtypes()) {
    for (const ScaleShape shape : {ScaleShape{2, 37, 1003, 0}, ScaleShape{2, 5, 4096, 4104}, ScaleShape{2, 3, 64, 70},
                                   ScaleShape{1, 777, 1, 0}, ScaleShape{0, 1, 1, 0}}) {
      for (const bool with_scale : {true, false}) {
        SCOPED_TRACE(cat("grad ", dtype_name(grad_dtype), " ndim ", shape.ndim, " rows ", shape.rows, " cols ",
                         shape.cols, " stride ", shape.stride, with_scale ? " scale 0.37" : " no scale"));
        const int64_t count = shape.ndim == 2 ? shape.rows * shape.cols : shape.ndim == 1 ? shape.rows : 1;
        const std::vector<double> g = gradient_values(count);
        Buffer grad = Buffer::of_values(device(), grad_dtype, g, shape.ndim, shape.rows, shape.cols, shape.stride);
        Buffer scale = Buffer::of_values(device(), product_dtype(grad_dtype), {0.37}, 0, 1);
        Buffer out(device(), dtype(), shape.ndim, shape.rows, shape.cols, shape.stride);
        out.poison();
        out.upload();
        grad.upload();
        scale.upload();
        const lmloss_tensor grad_t = grad.tensor(), scale_t = scale.tensor(), out_t = out.tensor();
        ASSERT_EQ(lmloss_scale_gradient(ctx.get(), &grad_t, with_scale ? &scale_t : nullptr, &out_t), LMLOSS_SUCCESS)
            << lmloss_last_error();
        ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
        out.download();
        EXPECT_EQ(out.unwritten(), 0);
        EXPECT_TRUE(out.padding_untouched());
        const double s = with_scale ? 0.37 : 1.0;
        int reported = 0;
        for (int64_t i = 0; i < count && reported < 5; ++i) {
          const double want = expected(grad_dtype, round_to(grad_dtype, g[i]), round_to(product_dtype(grad_dtype), s));
          if (out.get(i) != want) {
            ADD_FAILURE() << "element " << i << ": " << out.get(i) << ", expected " << want;
            ++reported;
          }
        }
      }
    }
  }
}

// out = grad: scaled in place, in every dtype (a 16-bit dX is scaled where it lies).
TEST_P(ScaleGradient, InPlace) {
  const std::vector<double> g = gradient_values(300 * 36);
  Buffer grad = Buffer::of_values(device(), dtype(), g, 2, 300, 36, 40);
  Buffer scale = Buffer::of_values(device(), product_dtype(dtype()), {-1.5}, 0, 1);
  grad.upload();
  scale.upload();
  const lmloss_tensor grad_t = grad.tensor(), scale_t = scale.tensor();
  ASSERT_EQ(lmloss_scale_gradient(ctx.get(), &grad_t, &scale_t, &grad_t), LMLOSS_SUCCESS) << lmloss_last_error();
  ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  grad.download();
  for (int64_t i = 0; i < grad.count(); ++i)
    ASSERT_EQ(grad.get(i), expected(dtype(), round_to(dtype(), g[i]), -1.5)) << "element " << i;
}

// float16's largest value: 65504 and 65519 round to it, 65520 (halfway to the next step) rounds
// to infinity, to nearest even as everywhere else.
TEST_P(ScaleGradient, Float16RoundsAtItsLargestValue) {
  if (dtype() != LMLOSS_F16) GTEST_SKIP() << "a float16 out only";
  Buffer grad = Buffer::of_values(device(), LMLOSS_F32, {65504, 65519, 65520, -65520}, 1, 4);
  Buffer out(device(), LMLOSS_F16, 1, 4);
  grad.upload();
  out.upload();
  const lmloss_tensor grad_t = grad.tensor(), out_t = out.tensor();
  ASSERT_EQ(lmloss_scale_gradient(ctx.get(), &grad_t, nullptr, &out_t), LMLOSS_SUCCESS) << lmloss_last_error();
  ASSERT_EQ(lmloss_context_synchronize(ctx.get()), LMLOSS_SUCCESS) << lmloss_last_error();
  out.download();
  EXPECT_EQ(out.get(0), 65504.0);
  EXPECT_EQ(out.get(1), 65504.0);
  EXPECT_EQ(out.get(2), INFINITY);
  EXPECT_EQ(out.get(3), -INFINITY);
}

// Each bad argument: LMLOSS_ERROR_INVALID_ARGUMENT, a message naming it, out untouched.
TEST_P(ScaleGradient, BadArgumentsChangeNothing) {
  const std::vector<double> g = gradient_values(8 * 16);
  const lmloss_dtype grad_dtype = grad_dtypes().front();
  Buffer grad = Buffer::of_values(device(), grad_dtype, g, 2, 8, 16);
  Buffer grad_ids(device(), LMLOSS_I32, 2, 8, 16);
  Buffer scale_wrong_dtype = Buffer::of_values(device(), LMLOSS_BF16, {2.0}, 0, 1);
  Buffer scale_two = Buffer::of_values(device(), product_dtype(grad_dtype), {2.0, 3.0}, 1, 2);
  Buffer out(device(), dtype(), 2, 8, 16);
  Buffer out_short(device(), dtype(), 2, 8, 15);
  Buffer out_ids(device(), LMLOSS_I32, 2, 8, 16);
  for (Buffer* b : {&grad, &grad_ids, &scale_wrong_dtype, &scale_two, &out, &out_short, &out_ids}) b->upload();
  struct Bad {
    const char* name;
    const Buffer* grad;
    const Buffer* scale;
    const Buffer* out;
  };
  for (const Bad bad : {Bad{"grad", &grad_ids, nullptr, &out}, Bad{"scale", &grad, &scale_wrong_dtype, &out},
                        Bad{"scale", &grad, &scale_two, &out}, Bad{"out", &grad, nullptr, &out_short},
                        Bad{"out", &grad, nullptr, &out_ids}}) {
    Buffer* target = const_cast<Buffer*>(bad.out);
    target->poison();
    target->upload();
    const lmloss_tensor grad_t = bad.grad->tensor(), out_t = bad.out->tensor();
    const lmloss_tensor scale_t = bad.scale ? bad.scale->tensor() : lmloss_tensor_none();
    EXPECT_EQ(lmloss_scale_gradient(ctx.get(), &grad_t, bad.scale ? &scale_t : nullptr, &out_t),
              LMLOSS_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(lmloss_last_error()).find(bad.name), std::string::npos) << lmloss_last_error();
    target->download();
    EXPECT_TRUE(target->untouched()) << bad.name;
  }
}

// out a row further into grad's buffer: refused, nothing written. (out = grad itself is InPlace.)
TEST_P(ScaleGradient, OutOverlappingGradIsRefused) {
  const lmloss_dtype grad_dtype = dtype();
  Buffer both = Buffer::of_values(device(), grad_dtype, gradient_values(9 * 16), 2, 9, 16);
  both.upload();
  both.snapshot();
  lmloss_tensor grad = both.tensor(), out = both.tensor();
  grad.shape[0] = out.shape[0] = 8;
  out.data = static_cast<char*>(out.data) + 16 * int64_t(dtype_size(grad_dtype));
  EXPECT_EQ(lmloss_scale_gradient(ctx.get(), &grad, nullptr, &out), LMLOSS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(lmloss_last_error()).rfind("out: shares memory with grad", 0), 0u) << lmloss_last_error();
  both.download();
  EXPECT_TRUE(both.untouched());
}

INSTANTIATE_TEST_SUITE_P(, ScaleGradient,
                         ::testing::Combine(all_devices, ::testing::Values(LMLOSS_F64, LMLOSS_F32, LMLOSS_BF16,
                                                                           LMLOSS_F16)),
                         ParamName{});

}  // namespace
}  // namespace lmloss::test
