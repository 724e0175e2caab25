// The test harness: one generator of adversarial problems, one table of tolerances, buffers that
// store a double problem in any dtype on any device, and cases that run an operation through the
// C API and compare it with the float64 reference on exactly the values the library saw.
//
// Every output buffer is filled with 0xFF bytes before a call (NaN in every float dtype, -1 in
// every integer dtype), so an element the library forgot to write is caught, and a call that
// must write nothing can be checked byte for byte.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/dtype.hpp"
#include "lmloss/lmloss.h"
#include "reference.hpp"

namespace lmloss::test {

// ---- Devices -----------------------------------------------------------------------------------

enum class Device { cpu, cuda };

const char* device_name(Device device);
inline void PrintTo(Device device, std::ostream* os) { *os << device_name(device); }
lmloss_device_type device_type(Device device);
// Why the device cannot run these tests here; "" when it can.
std::string unavailable_reason(Device device);

// Skips the calling test (or SetUp) when `device` cannot run here.
#define LMLOSS_REQUIRE_DEVICE(device)                                                   \
  do {                                                                                  \
    const std::string lmloss_reason_ = ::lmloss::test::unavailable_reason(device);      \
    if (!lmloss_reason_.empty()) GTEST_SKIP() << lmloss_reason_;                        \
  } while (0)

inline const auto all_devices = ::testing::Values(Device::cpu, Device::cuda);

// Tests over (device, input dtype); f64 inputs are CPU-only and skip on CUDA.
class DeviceDtypeTest : public ::testing::TestWithParam<std::tuple<Device, lmloss_dtype>> {
 protected:
  void SetUp() override {
    LMLOSS_REQUIRE_DEVICE(device());
    if (device() == Device::cuda && dtype() == LMLOSS_F64) {
      GTEST_SKIP() << "f64 inputs are a CPU-only dtype";
    }
  }
  Device device() const { return std::get<0>(GetParam()); }
  lmloss_dtype dtype() const { return std::get<1>(GetParam()); }
};

// ---- Dtypes and tolerances ---------------------------------------------------------------------

// The library's own dtype table (sizes and names are facts, not something under test).
using core::dtype_name;
using core::dtype_size;
using core::is_float;
// The dtype of losses, lse, teacher probabilities and top-k outputs for a given input dtype.
inline lmloss_dtype compute_dtype(lmloss_dtype input) { return core::compute_dtype_of(input); }
// `value` as stored in `dtype` and read back (round to nearest even).
double round_to(lmloss_dtype dtype, double value);

// The one table: the relative error ||out - ref|| / ||ref|| allowed for results held in `dtype`.
double tolerance(lmloss_dtype dtype);
// A result computed from `input` and stored as `output`: the looser of the two.
double tolerance(lmloss_dtype input, lmloss_dtype output);
// The same, for logits of magnitude up to `magnitude`: lse is saved in the compute dtype, so
// exp(s - lse) inherits lse's absolute rounding |lse| * u (at 1e4 in f32, ~6e-4 relative).
double tolerance_at_magnitude(lmloss_dtype input, lmloss_dtype output, double magnitude);

// ---- Adversarial problems ----------------------------------------------------------------------

struct ProblemSpec {
  int64_t n_tokens = 8;
  int64_t vocab = 257;
  int64_t hidden = 0;             // 0: a logits problem
  bool bias = false;
  bool labels = true;
  double ignore_fraction = 0.15;  // labels set to ignore_index (at least one token stays counted)
  int64_t ignore_index = -100;
  int64_t top_k = 0;              // teacher entries per token; 0: no teacher
  bool teacher_unnormalized = false;  // teacher rows summing to 0.9, one entry 0
  bool mask = false;
  int64_t tie_rank = 0;           // > 0: rows get a tie with the value at this rank (1-based)
  double logit_scale = 2.0;       // spread of the ordinary logits
};

class Generator {
 public:
  explicit Generator(uint64_t seed) : rng_(seed) {}

  // A problem in double with outliers (so softmax is far from uniform), labels with some
  // ignore_index, teacher rows of distinct ids, and ties at `tie_rank` for logits problems.
  reference::Problem problem(const ProblemSpec& spec);

  std::vector<double> normal(size_t n, double sigma = 1.0);
  std::vector<double> uniform(size_t n, double lo, double hi);
  int64_t index(int64_t n);  // uniform in [0, n)

 private:
  std::mt19937_64 rng_;
};

// Teacher rows that name ids more than once: every fourth entry repeats the one before it, and
// the first entry of each even row with a label is that label.
void repeat_teacher_ids(reference::Problem& problem, int64_t n_tokens, int64_t top_k);

// The problem with every float rounded as the library will store it: inputs to `dtype`,
// teacher probabilities to compute_dtype(dtype). The reference is then run on this.
reference::Problem rounded(const reference::Problem& problem, lmloss_dtype dtype);

// ---- Buffers -----------------------------------------------------------------------------------

// A tensor of the caller's: host bytes, and a device copy on CUDA. Logical element i of a 2-D
// buffer is (i / cols, i % cols); rows (a vector's elements) sit `stride` elements apart
// (padding stays untouched).
class Buffer {
 public:
  Buffer() = default;  // absent
  Buffer(Device device, lmloss_dtype dtype, int ndim, int64_t rows, int64_t cols = 1,
         int64_t stride = 0);
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  static Buffer of_values(Device device, lmloss_dtype dtype, const std::vector<double>& values,
                          int ndim, int64_t rows, int64_t cols = 1, int64_t stride = 0);
  static Buffer of_ids(Device device, lmloss_dtype dtype, const std::vector<int64_t>& ids,
                       int ndim, int64_t rows, int64_t cols = 1, int64_t stride = 0);

  bool present() const { return !host_.empty(); }
  lmloss_dtype dtype() const { return dtype_; }
  int64_t count() const;  // logical elements
  int64_t row_stride() const { return stride_ > 0 ? stride_ : cols_; }

  // Host copy, logical elements.
  double get(int64_t i) const;
  void set(int64_t i, double value);
  int64_t get_id(int64_t i) const;
  void set_id(int64_t i, int64_t id);
  std::vector<double> values() const;
  std::vector<int64_t> ids() const;
  void fill(const std::vector<double>& values);

  void poison();                 // every byte 0xFF, padding included; also takes a snapshot
  void snapshot();               // remember the host bytes as they are
  bool untouched() const;        // host bytes equal the snapshot
  int64_t unwritten() const;     // logical elements still all 0xFF
  bool padding_untouched() const;  // bytes outside the logical elements equal the snapshot

  void upload();    // host -> device (nothing on the CPU)
  void download();  // device -> host

  // The descriptor the library sees (device memory on CUDA).
  lmloss_tensor tensor() const;

 private:
  size_t offset(int64_t i) const;  // bytes
  void release();

  Device device_ = Device::cpu;
  lmloss_dtype dtype_ = LMLOSS_F32;
  int ndim_ = 0;
  int64_t rows_ = 0, cols_ = 0, stride_ = 0;
  std::vector<unsigned char> host_;
  std::vector<unsigned char> snapshot_;
  void* device_data_ = nullptr;
};

// ---- Loss cases --------------------------------------------------------------------------------

enum class Mode { forward, backward, forward_backward };

struct LossSetup {
  Device device = Device::cpu;
  lmloss_dtype dtype = LMLOSS_F32;        // logits, or hidden, weight and bias
  lmloss_dtype grad_dtype = LMLOSS_F32;   // every gradient output
  lmloss_dtype label_dtype = LMLOSS_I32;
  lmloss_dtype teacher_id_dtype = LMLOSS_I32;
  int64_t row_padding = 0;                // 2-D inputs and outputs get stride = cols + padding
  int64_t vector_stride = 0;              // 1-D ones (labels, mask, bias, loss, lse, grad_loss,
                                          // grad_bias) get this stride; CUDA refuses strided ones
  bool in_place = false;                  // grad_logits written over the logits
  bool want_lse = true;
  bool want_grad_hidden = true;
  bool want_grad_weight = true;
  bool want_grad_bias = true;
  std::vector<double> upstream;           // grad_loss values; empty: absent (= 1)
  std::vector<double> grad_weight_initial;  // with LMLOSS_ACCUMULATE_GRAD_WEIGHT
  std::vector<double> grad_bias_initial;    // with LMLOSS_ACCUMULATE_GRAD_BIAS
};

// One loss problem as buffers, ready to run any of the three operations.
class LossCase {
 public:
  // `problem` is rounded to setup.dtype here; `problem()` returns the rounded one.
  LossCase(const reference::Problem& problem, const lmloss_loss_options& options,
           LossSetup setup);

  const reference::Problem& problem() const { return problem_; }
  const LossSetup& setup() const { return setup_; }
  bool linear() const { return problem_.hidden > 0; }

  lmloss_head head() const;
  lmloss_targets targets() const;
  lmloss_grads grads() const;
  lmloss_tensor loss_tensor() const { return loss.tensor(); }
  lmloss_tensor lse_tensor() const { return lse.tensor(); }
  lmloss_tensor grad_loss_tensor() const { return grad_loss.tensor(); }

  // Each poisons its outputs (accumulated gradients get their initial values), uploads,
  // calls, synchronizes and downloads. backward reads `lse` as it stands (e.g. from forward).
  lmloss_status forward(lmloss_context* context);
  lmloss_status backward(lmloss_context* context);
  lmloss_status forward_backward(lmloss_context* context);
  lmloss_status run(lmloss_context* context, Mode mode);

  // Any call on hand-made descriptors, with the same poison/upload/download around it.
  template <typename Call>
  lmloss_status invoke(lmloss_context* context, Call&& call) {
    prepare_outputs(Mode::forward_backward);
    upload_all();
    lmloss_status status = call();
    if (status == LMLOSS_SUCCESS) status = lmloss_context_synchronize(context);
    download_all();
    return status;
  }

  // The reference on the rounded problem (grad_loss = setup.upstream).
  reference::LossResult reference() const;

  // Every output buffer (absent ones skipped), for validation checks.
  std::vector<const Buffer*> outputs() const;
  // Every value of the outputs above, in order: what determinism tests compare bitwise.
  std::vector<double> output_values() const;

  Buffer logits, hidden, weight, bias;
  Buffer labels, teacher_ids, teacher_probs, token_mask;
  Buffer loss, lse, grad_loss;
  Buffer grad_logits, grad_hidden, grad_weight, grad_bias;
  lmloss_loss_options options;

 private:
  void prepare_outputs(Mode mode);
  void upload_all();
  void download_all();
  std::vector<Buffer*> all_buffers();

  reference::Problem problem_;
  LossSetup setup_;
};

// Compares a successful run of `mode` with the reference: the loss, lse and every gradient the
// case asked for, within the tolerance of their dtypes, and every element written.
// `tolerance_override` > 0 replaces the table's tolerances (see tolerance_at_magnitude).
void expect_matches_reference(const LossCase& c, Mode mode, double tolerance_override = 0);

// ---- Top-k cases -------------------------------------------------------------------------------

struct TopkSetup {
  Device device = Device::cpu;
  lmloss_dtype dtype = LMLOSS_F32;
  int64_t row_padding = 0;
  int64_t vector_stride = 0;  // the tail's
  bool want_tail = true;
};

class TopkCase {
 public:
  TopkCase(const reference::Problem& problem, const lmloss_topk_options& options, TopkSetup setup);

  const reference::Problem& problem() const { return problem_; }
  const TopkSetup& setup() const { return setup_; }
  lmloss_head head() const;
  lmloss_status run(lmloss_context* context);
  template <typename Call>
  lmloss_status invoke(lmloss_context* context, Call&& call) {
    prepare_outputs();
    upload_all();
    lmloss_status status = call();
    if (status == LMLOSS_SUCCESS) status = lmloss_context_synchronize(context);
    download_all();
    return status;
  }
  reference::TopkResult reference() const;
  std::vector<const Buffer*> outputs() const;

  Buffer logits, hidden, weight, bias;
  Buffer ids, probs, tail;
  lmloss_topk_options options;

 private:
  void prepare_outputs();
  void upload_all();
  void download_all();

  reference::Problem problem_;
  TopkSetup setup_;
};

// Ids agree when, at every rank, the chosen id's scaled logit equals the reference's value at
// that rank within `tolerance` (relative, floor 1): near-ties may swap, nothing else may.
// `tolerance` 0 demands the exact ids.
void expect_topk_matches_reference(const TopkCase& c, double id_tolerance);

// ---- Comparisons -------------------------------------------------------------------------------

// ||out - ref|| / ||ref|| <= tolerance, with the error in the message.
::testing::AssertionResult close_to(const std::vector<double>& out,
                                    const std::vector<double>& ref, double tolerance);
// Every logical element written, padding untouched.
::testing::AssertionResult fully_written(const Buffer& buffer);
// Every byte as it was poisoned.
::testing::AssertionResult untouched(const Buffer& buffer);
// A 16-bit result (`count` elements of `narrow` from its element `narrow_first`) rounded once from
// an f32 sum: equal to the f32 result `wide`, times `scale` in f32, rounded into narrow's dtype,
// but for at most `differ_fraction` of the elements (where the two f32 sums, their products split
// differently, straddle a rounding boundary), and none of those more than an ulp apart, or with
// `floor_of_largest`, that times the largest element apart (a sum whose error is relative to its
// running values, not its last ones: where chunks cancel, a small value may be ulps off).
::testing::AssertionResult rounded_once_from(const Buffer& narrow, const Buffer& wide, int64_t count,
                                             float scale = 1.0f, int64_t narrow_first = 0,
                                             double differ_fraction = 0.01, double floor_of_largest = 0);
bool bitwise_equal(const std::vector<double>& a, const std::vector<double>& b);

// Joins anything streamable into one string, for traces (no operator+ chains on literals).
template <typename... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// ---- Naming parameterized tests ---------------------------------------------------------------

std::string param_name(Device device);
std::string param_name(lmloss_dtype dtype);
template <typename... Ts>
std::string tuple_name(const std::tuple<Ts...>& t) {
  std::string name;
  std::apply([&](const auto&... p) { ((name.append(name.empty() ? "" : "_").append(param_name(p))), ...); },
             t);
  return name;
}
struct ParamName {
  template <typename P>
  std::string operator()(const ::testing::TestParamInfo<P>& info) const {
    if constexpr (requires { std::tuple_size<P>::value; }) {
      return tuple_name(info.param);
    } else {
      return param_name(info.param);
    }
  }
};

}  // namespace lmloss::test
