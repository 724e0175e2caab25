#include "harness.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <stdexcept>
#include <utility>

#if LMLOSS_TEST_CUDA
#include <cuda_runtime.h>
#endif

namespace lmloss::test {

// ---- Devices -----------------------------------------------------------------------------------

const char* device_name(Device device) { return device == Device::cpu ? "cpu" : "cuda"; }

lmloss_device_type device_type(Device device) {
  return device == Device::cpu ? LMLOSS_DEVICE_CPU : LMLOSS_DEVICE_CUDA;
}

std::string unavailable_reason(Device device) {
  if (device == Device::cpu) return "";
#if LMLOSS_TEST_CUDA
  if (!lmloss_backend_available(LMLOSS_DEVICE_CUDA)) {
    return "the CUDA backend has no usable device here";
  }
  return "";
#else
  return "the tests were built without CUDA";
#endif
}

// ---- Dtypes and tolerances ---------------------------------------------------------------------

namespace {

// Written apart from the library's conversions (src/core/dtype.hpp) on purpose: the inputs the
// reference sees are rounded by an independent implementation, so a rounding bug in the library
// shows up as a mismatch instead of being shared by both sides.
uint16_t float_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN stays NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

float bf16_to_float(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

// IEEE half, round to nearest even, subnormals kept.
uint16_t float_to_f16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t mag = x & 0x7FFFFFFFu;
  if (mag >= 0x7F800000u) return sign | (mag > 0x7F800000u ? 0x7E00 : 0x7C00);
  if (mag >= 0x477FF000u) return sign | 0x7C00;  // 65520 and above round to infinity
  if (mag < 0x33000000u) return sign;            // below 2^-25 rounds to zero
  const int exponent = static_cast<int>(mag >> 23);
  if (exponent < 113) {  // a half subnormal: m * 2^-24
    const uint32_t mantissa = (mag & 0x7FFFFFu) | 0x800000u;
    const int shift = 126 - exponent;
    uint32_t h = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1u))) ++h;
    return sign | static_cast<uint16_t>(h);
  }
  uint32_t h = (static_cast<uint32_t>(exponent - 112) << 10) | ((mag >> 13) & 0x3FFu);
  const uint32_t rest = mag & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
}

double f16_to_double(uint16_t h) {
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  const int exponent = (h >> 10) & 0x1F;
  const int mantissa = h & 0x3FF;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  if (exponent == 31) return mantissa ? NAN : sign * INFINITY;
  return sign * std::ldexp(mantissa + 1024, exponent - 25);
}

void store(lmloss_dtype dtype, double value, unsigned char* p) {
  switch (dtype) {
    case LMLOSS_F32: { const float v = static_cast<float>(value); std::memcpy(p, &v, 4); break; }
    case LMLOSS_F64: std::memcpy(p, &value, 8); break;
    case LMLOSS_BF16: { const uint16_t v = float_to_bf16(static_cast<float>(value)); std::memcpy(p, &v, 2); break; }
    case LMLOSS_F16: { const uint16_t v = float_to_f16(static_cast<float>(value)); std::memcpy(p, &v, 2); break; }
    default: throw std::invalid_argument("store: not a float dtype");
  }
}

double load(lmloss_dtype dtype, const unsigned char* p) {
  switch (dtype) {
    case LMLOSS_F32: { float v; std::memcpy(&v, p, 4); return v; }
    case LMLOSS_F64: { double v; std::memcpy(&v, p, 8); return v; }
    case LMLOSS_BF16: { uint16_t v; std::memcpy(&v, p, 2); return bf16_to_float(v); }
    case LMLOSS_F16: { uint16_t v; std::memcpy(&v, p, 2); return f16_to_double(v); }
    default: throw std::invalid_argument("load: not a float dtype");
  }
}

}  // namespace

double round_to(lmloss_dtype dtype, double value) {
  unsigned char bytes[8];
  store(dtype, value, bytes);
  return load(dtype, bytes);
}

// Worst errors seen on the CPU backend (2026-12-02, every loss and top-k test): f64 1e-15;
// f32 1.3e-6; outputs stored in bf16 2.5e-3, in f16 3.9e-4; 16-bit inputs with f32 outputs 1e-6.
double tolerance(lmloss_dtype dtype) {
  switch (dtype) {
    case LMLOSS_F64: return 1e-10;
    // f32 results: sums of up to ~1e5 terms in f32 stay near 1e-6 relative; 1e-5 leaves room
    // for BLAS blocking without hiding a wrong term (which shows at 1e-3 or more).
    case LMLOSS_F32: return 1e-5;
    // 16-bit storage: one rounding of the result is 2^-9 (bf16) or 2^-12 (f16) relative.
    case LMLOSS_BF16: return 1e-2;
    case LMLOSS_F16: return 1e-2;
    default: throw std::invalid_argument("tolerance: not a float dtype");
  }
}

double tolerance(lmloss_dtype input, lmloss_dtype output) {
  return std::max(tolerance(input), tolerance(output));
}

double tolerance_at_magnitude(lmloss_dtype input, lmloss_dtype output, double magnitude) {
  const double unit_roundoff = compute_dtype(input) == LMLOSS_F64 ? 0x1p-53 : 0x1p-24;
  return tolerance(input, output) + 4 * magnitude * unit_roundoff;
}

// ---- Adversarial problems ----------------------------------------------------------------------

std::vector<double> Generator::normal(size_t n, double sigma) {
  std::normal_distribution<double> d(0.0, sigma);
  std::vector<double> v(n);
  for (double& x : v) x = d(rng_);
  return v;
}

std::vector<double> Generator::uniform(size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = d(rng_);
  return v;
}

int64_t Generator::index(int64_t n) {
  return std::uniform_int_distribution<int64_t>(0, n - 1)(rng_);
}

void repeat_teacher_ids(reference::Problem& problem, int64_t n_tokens, int64_t top_k) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    int64_t* ids = problem.teacher_ids.data() + t * top_k;
    for (int64_t e = 3; e < top_k; e += 4) ids[e] = ids[e - 1];
    if (t % 2 == 0 && !problem.labels.empty() && problem.labels[t] >= 0) ids[0] = problem.labels[t];
  }
}

reference::Problem Generator::problem(const ProblemSpec& spec) {
  const int64_t n = spec.n_tokens, V = spec.vocab, H = spec.hidden;
  reference::Problem p;
  p.n_tokens = n;
  p.vocab = V;
  p.hidden = H;
  const int64_t outliers = 1 + V / 500;
  if (H == 0) {
    p.logits = normal(n * V, spec.logit_scale);
    for (int64_t t = 0; t < n; ++t) {
      // A few large logits per row so softmax is peaked, as in a trained model.
      for (int64_t i = 0; i < outliers; ++i) p.logits[t * V + index(V)] += uniform(1, 4, 12).front();
      if (t % 4 == 1) p.logits[t * V + index(V)] = -20 * spec.logit_scale;
    }
    if (spec.tie_rank > 0 && spec.tie_rank < V) {
      std::vector<int64_t> order(V);
      for (int64_t t = 0; t < n; ++t) {
        const double* z = &p.logits[t * V];
        std::iota(order.begin(), order.end(), int64_t{0});
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t a, int64_t b) { return z[a] > z[b]; });
        const int64_t at_rank = order[spec.tie_rank - 1];
        const int64_t below = order[spec.tie_rank + index(V - spec.tie_rank)];
        p.logits[t * V + below] = p.logits[t * V + at_rank];
      }
    }
  } else {
    p.hidden_states = normal(n * H, 1.0);
    p.weight = normal(V * H, spec.logit_scale / std::sqrt(static_cast<double>(H)));
    // A few vocabulary rows aligned with the hidden states' mean direction, scaled up: peaked
    // softmax for many tokens without exploding the rest.
    for (int64_t i = 0; i < outliers; ++i) {
      const int64_t v = index(V);
      for (int64_t h = 0; h < H; ++h) p.weight[v * H + h] *= 4;
    }
    if (spec.bias) {
      p.bias = normal(V, 0.5);
      for (int64_t i = 0; i < outliers; ++i) p.bias[index(V)] += 4;
    }
  }
  if (spec.labels) {
    p.labels.resize(n);
    for (int64_t t = 0; t < n; ++t) {
      p.labels[t] = index(V);
      if (t > 0 && uniform(1, 0, 1)[0] < spec.ignore_fraction) p.labels[t] = spec.ignore_index;
    }
  }
  if (spec.top_k > 0) {
    const int64_t K = spec.top_k;
    p.top_k = K;
    p.teacher_ids.resize(n * K);
    p.teacher_probs.resize(n * K);
    for (int64_t t = 0; t < n; ++t) {
      std::set<int64_t> taken;
      for (int64_t k = 0; k < K; ++k) {
        int64_t id = index(V);
        while (taken.count(id)) id = index(V);
        taken.insert(id);
        p.teacher_ids[t * K + k] = id;
      }
      std::vector<double> w = uniform(K, 0.05, 1.0);
      if (spec.teacher_unnormalized && K > 1) w[index(K)] = 0;
      const double sum = std::accumulate(w.begin(), w.end(), 0.0);
      const double mass = spec.teacher_unnormalized ? 0.9 : 1.0;
      for (int64_t k = 0; k < K; ++k) p.teacher_probs[t * K + k] = mass * w[k] / sum;
    }
  }
  if (spec.mask) {
    p.token_mask.resize(n);
    for (int64_t t = 0; t < n; ++t) p.token_mask[t] = uniform(1, 0, 1)[0] < 0.75 ? 1 : 0;
    p.token_mask[0] = 1;  // token 0's label is never ignored either: something always counts
  }
  return p;
}

reference::Problem rounded(const reference::Problem& problem, lmloss_dtype dtype) {
  reference::Problem p = problem;
  for (double& x : p.logits) x = round_to(dtype, x);
  for (double& x : p.hidden_states) x = round_to(dtype, x);
  for (double& x : p.weight) x = round_to(dtype, x);
  for (double& x : p.bias) x = round_to(dtype, x);
  for (double& x : p.teacher_probs) x = round_to(compute_dtype(dtype), x);
  return p;
}

// ---- Buffers -----------------------------------------------------------------------------------

#if LMLOSS_TEST_CUDA
namespace {
void cuda_check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(error));
  }
}
}  // namespace
#endif

Buffer::Buffer(Device device, lmloss_dtype dtype, int ndim, int64_t rows, int64_t cols,
               int64_t stride)
    : device_(device), dtype_(dtype), ndim_(ndim), rows_(ndim == 0 ? 1 : rows),
      cols_(ndim == 2 ? cols : 1), stride_(ndim >= 1 ? stride : 0) {
  const int64_t elements = rows_ * row_stride();
  host_.assign(static_cast<size_t>(std::max<int64_t>(elements, 1)) * dtype_size(dtype), 0xFF);
  snapshot_ = host_;
#if LMLOSS_TEST_CUDA
  if (device_ == Device::cuda) cuda_check(cudaMalloc(&device_data_, host_.size()), "cudaMalloc");
#endif
}

Buffer::~Buffer() { release(); }

void Buffer::release() {
#if LMLOSS_TEST_CUDA
  if (device_data_) cudaFree(device_data_);
#endif
  device_data_ = nullptr;
}

Buffer::Buffer(Buffer&& other) noexcept { *this = std::move(other); }

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    device_ = other.device_;
    dtype_ = other.dtype_;
    ndim_ = other.ndim_;
    rows_ = other.rows_;
    cols_ = other.cols_;
    stride_ = other.stride_;
    host_ = std::move(other.host_);
    snapshot_ = std::move(other.snapshot_);
    device_data_ = std::exchange(other.device_data_, nullptr);
    other.host_.clear();
  }
  return *this;
}

Buffer Buffer::of_values(Device device, lmloss_dtype dtype, const std::vector<double>& values,
                         int ndim, int64_t rows, int64_t cols, int64_t stride) {
  Buffer b(device, dtype, ndim, rows, cols, stride);
  b.fill(values);
  b.snapshot();
  return b;
}

Buffer Buffer::of_ids(Device device, lmloss_dtype dtype, const std::vector<int64_t>& ids,
                      int ndim, int64_t rows, int64_t cols, int64_t stride) {
  Buffer b(device, dtype, ndim, rows, cols, stride);
  for (int64_t i = 0; i < b.count(); ++i) b.set_id(i, ids.at(i));
  b.snapshot();
  return b;
}

int64_t Buffer::count() const { return present() ? rows_ * cols_ : 0; }

size_t Buffer::offset(int64_t i) const {
  const int64_t element = (i / cols_) * row_stride() + i % cols_;
  return static_cast<size_t>(element) * dtype_size(dtype_);
}

double Buffer::get(int64_t i) const {
  if (!is_float(dtype_)) return static_cast<double>(get_id(i));
  return load(dtype_, &host_[offset(i)]);
}

void Buffer::set(int64_t i, double value) { store(dtype_, value, &host_[offset(i)]); }

int64_t Buffer::get_id(int64_t i) const {
  const unsigned char* p = &host_[offset(i)];
  switch (dtype_) {
    case LMLOSS_I32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case LMLOSS_I64: { int64_t v; std::memcpy(&v, p, 8); return v; }
    case LMLOSS_U8: return *p;
    default: throw std::invalid_argument("get_id: not an integer dtype");
  }
}

void Buffer::set_id(int64_t i, int64_t id) {
  unsigned char* p = &host_[offset(i)];
  switch (dtype_) {
    case LMLOSS_I32: { const int32_t v = static_cast<int32_t>(id); std::memcpy(p, &v, 4); break; }
    case LMLOSS_I64: std::memcpy(p, &id, 8); break;
    case LMLOSS_U8: *p = static_cast<unsigned char>(id); break;
    default: throw std::invalid_argument("set_id: not an integer dtype");
  }
}

std::vector<double> Buffer::values() const {
  std::vector<double> v(count());
  for (int64_t i = 0; i < count(); ++i) v[i] = get(i);
  return v;
}

std::vector<int64_t> Buffer::ids() const {
  std::vector<int64_t> v(count());
  for (int64_t i = 0; i < count(); ++i) v[i] = get_id(i);
  return v;
}

void Buffer::fill(const std::vector<double>& values) {
  if (static_cast<int64_t>(values.size()) != count()) {
    throw std::invalid_argument("Buffer::fill: wrong number of values");
  }
  for (int64_t i = 0; i < count(); ++i) set(i, values[i]);
}

void Buffer::poison() {
  std::fill(host_.begin(), host_.end(), 0xFF);
  snapshot();
}

void Buffer::snapshot() { snapshot_ = host_; }

bool Buffer::untouched() const { return host_ == snapshot_; }

int64_t Buffer::unwritten() const {
  const size_t size = dtype_size(dtype_);
  int64_t n = 0;
  for (int64_t i = 0; i < count(); ++i) {
    const unsigned char* p = &host_[offset(i)];
    if (std::all_of(p, p + size, [](unsigned char b) { return b == 0xFF; })) ++n;
  }
  return n;
}

bool Buffer::padding_untouched() const {
  std::vector<bool> logical(host_.size(), false);
  const size_t size = dtype_size(dtype_);
  for (int64_t i = 0; i < count(); ++i) {
    std::fill_n(logical.begin() + static_cast<std::ptrdiff_t>(offset(i)), size, true);
  }
  for (size_t b = 0; b < host_.size(); ++b) {
    if (!logical[b] && host_[b] != snapshot_[b]) return false;
  }
  return true;
}

void Buffer::upload() {
#if LMLOSS_TEST_CUDA
  if (device_data_) {
    cuda_check(cudaMemcpy(device_data_, host_.data(), host_.size(), cudaMemcpyHostToDevice),
               "cudaMemcpy to the device");
  }
#endif
}

void Buffer::download() {
#if LMLOSS_TEST_CUDA
  if (device_data_) {
    cuda_check(cudaMemcpy(host_.data(), device_data_, host_.size(), cudaMemcpyDeviceToHost),
               "cudaMemcpy from the device");
  }
#endif
}

lmloss_tensor Buffer::tensor() const {
  if (!present()) return lmloss_tensor_none();
  lmloss_tensor t = lmloss_tensor_none();
  t.data = device_ == Device::cpu ? const_cast<unsigned char*>(host_.data()) : device_data_;
  t.dtype = dtype_;
  t.ndim = ndim_;
  t.shape[0] = ndim_ >= 1 ? rows_ : 0;
  t.shape[1] = ndim_ == 2 ? cols_ : 0;
  t.stride = stride_;
  t.device_type = test::device_type(device_);
  t.device_index = 0;
  return t;
}

// ---- Loss cases --------------------------------------------------------------------------------

LossCase::LossCase(const reference::Problem& problem, const lmloss_loss_options& opts,
                   LossSetup setup)
    : options(opts), problem_(rounded(problem, setup.dtype)), setup_(std::move(setup)) {
  const Device d = setup_.device;
  const reference::Problem& p = problem_;
  const int64_t n = p.n_tokens, V = p.vocab, H = p.hidden;
  const lmloss_dtype cdt = compute_dtype(setup_.dtype);
  const int64_t pad = setup_.row_padding;
  const int64_t v_stride = pad > 0 ? V + pad : 0;
  const int64_t h_stride = pad > 0 ? H + pad : 0;
  const int64_t vec = setup_.vector_stride;

  if (H == 0) {
    logits = Buffer::of_values(d, setup_.dtype, p.logits, 2, n, V, v_stride);
    if (!setup_.in_place) grad_logits = Buffer(d, setup_.grad_dtype, 2, n, V, v_stride);
  } else {
    hidden = Buffer::of_values(d, setup_.dtype, p.hidden_states, 2, n, H, h_stride);
    weight = Buffer::of_values(d, setup_.dtype, p.weight, 2, V, H, h_stride);
    if (!p.bias.empty()) bias = Buffer::of_values(d, setup_.dtype, p.bias, 1, V, 1, vec);
    if (setup_.want_grad_hidden) grad_hidden = Buffer(d, setup_.grad_dtype, 2, n, H, h_stride);
    if (setup_.want_grad_weight) grad_weight = Buffer(d, setup_.grad_dtype, 2, V, H, h_stride);
    if (setup_.want_grad_bias && !p.bias.empty()) grad_bias = Buffer(d, setup_.grad_dtype, 1, V, 1, vec);
  }
  if (!p.labels.empty()) labels = Buffer::of_ids(d, setup_.label_dtype, p.labels, 1, n, 1, vec);
  if (!p.teacher_ids.empty()) {
    teacher_ids = Buffer::of_ids(d, setup_.teacher_id_dtype, p.teacher_ids, 2, n, p.top_k);
    teacher_probs = Buffer::of_values(d, cdt, p.teacher_probs, 2, n, p.top_k);
  }
  if (!p.token_mask.empty()) {
    std::vector<int64_t> mask(p.token_mask.begin(), p.token_mask.end());
    token_mask = Buffer::of_ids(d, LMLOSS_U8, mask, 1, n, 1, vec);
  }
  const bool per_token = options.reduction == LMLOSS_REDUCTION_NONE;
  loss = per_token ? Buffer(d, cdt, 1, n, 1, vec) : Buffer(d, cdt, 0, 1);
  if (setup_.want_lse) lse = Buffer(d, cdt, 1, n, 1, vec);
  if (!setup_.upstream.empty()) {
    for (double& g : setup_.upstream) g = round_to(cdt, g);
    grad_loss = per_token ? Buffer::of_values(d, cdt, setup_.upstream, 1, n, 1, vec)
                          : Buffer::of_values(d, cdt, setup_.upstream, 0, 1);
  }
  for (double& g : setup_.grad_weight_initial) g = round_to(setup_.grad_dtype, g);
  for (double& g : setup_.grad_bias_initial) g = round_to(setup_.grad_dtype, g);
}

lmloss_head LossCase::head() const {
  return {logits.tensor(), hidden.tensor(), weight.tensor(), bias.tensor()};
}

lmloss_targets LossCase::targets() const {
  return {labels.tensor(), teacher_ids.tensor(), teacher_probs.tensor(), token_mask.tensor()};
}

lmloss_grads LossCase::grads() const {
  return {setup_.in_place ? logits.tensor() : grad_logits.tensor(), grad_hidden.tensor(),
          grad_weight.tensor(), grad_bias.tensor()};
}

std::vector<Buffer*> LossCase::all_buffers() {
  return {&logits,   &hidden, &weight,    &bias,        &labels,      &teacher_ids,
          &teacher_probs, &token_mask, &loss, &lse, &grad_loss, &grad_logits,
          &grad_hidden, &grad_weight, &grad_bias};
}

std::vector<double> LossCase::output_values() const {
  std::vector<double> all;
  for (const Buffer* b : outputs()) {
    const std::vector<double> v = b->values();
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

std::vector<const Buffer*> LossCase::outputs() const {
  std::vector<const Buffer*> out;
  for (const Buffer* b : {&loss, &lse, &grad_logits, &grad_hidden, &grad_weight, &grad_bias}) {
    if (b->present()) out.push_back(b);
  }
  if (setup_.in_place) out.push_back(&logits);
  return out;
}

void LossCase::prepare_outputs(Mode mode) {
  if (setup_.in_place) {
    logits.poison();  // padding poisoned too: the library must not read it
    logits.fill(problem_.logits);
    logits.snapshot();
  }
  if (mode != Mode::backward) {
    loss.poison();
    lse.poison();
  }
  if (mode != Mode::forward) {
    grad_logits.poison();
    grad_hidden.poison();
    grad_weight.poison();
    grad_bias.poison();
    if (options.flags & LMLOSS_ACCUMULATE_GRAD_WEIGHT && grad_weight.present()) {
      grad_weight.fill(setup_.grad_weight_initial);
      grad_weight.snapshot();
    }
    if (options.flags & LMLOSS_ACCUMULATE_GRAD_BIAS && grad_bias.present()) {
      grad_bias.fill(setup_.grad_bias_initial);
      grad_bias.snapshot();
    }
  }
}

void LossCase::upload_all() {
  for (Buffer* b : all_buffers()) {
    if (b->present()) b->upload();
  }
}

void LossCase::download_all() {
  for (Buffer* b : all_buffers()) {
    if (b->present()) b->download();
  }
}

lmloss_status LossCase::run(lmloss_context* context, Mode mode) {
  prepare_outputs(mode);
  upload_all();
  const lmloss_head h = head();
  const lmloss_targets t = targets();
  const lmloss_grads g = grads();
  const lmloss_tensor loss_t = loss.tensor();
  const lmloss_tensor lse_t = lse.tensor();
  const lmloss_tensor grad_loss_t = grad_loss.tensor();
  lmloss_status status = LMLOSS_ERROR_INTERNAL;
  switch (mode) {
    case Mode::forward:
      status = lmloss_loss_forward(context, &h, &t, &options, &loss_t, &lse_t);
      break;
    case Mode::backward:
      status = lmloss_loss_backward(context, &h, &t, &options, &lse_t, &grad_loss_t, &g);
      break;
    case Mode::forward_backward:
      status = lmloss_loss_forward_backward(context, &h, &t, &options, &grad_loss_t, &loss_t,
                                            &lse_t, &g);
      break;
  }
  if (status == LMLOSS_SUCCESS) status = lmloss_context_synchronize(context);
  download_all();
  return status;
}

lmloss_status LossCase::forward(lmloss_context* context) { return run(context, Mode::forward); }
lmloss_status LossCase::backward(lmloss_context* context) { return run(context, Mode::backward); }
lmloss_status LossCase::forward_backward(lmloss_context* context) {
  return run(context, Mode::forward_backward);
}

reference::LossResult LossCase::reference() const {
  return reference::loss(problem_, options, setup_.upstream);
}

namespace {

std::vector<double> plus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r = a;
  for (size_t i = 0; i < r.size() && i < b.size(); ++i) r[i] += b[i];
  return r;
}

void expect_output(const char* name, const Buffer& buffer, const std::vector<double>& ref,
                   double tol) {
  SCOPED_TRACE(name);
  ASSERT_TRUE(buffer.present());
  EXPECT_TRUE(fully_written(buffer));
  EXPECT_TRUE(close_to(buffer.values(), ref, tol));
}

}  // namespace

void expect_matches_reference(const LossCase& c, Mode mode, double tolerance_override) {
  const reference::LossResult ref = c.reference();
  const LossSetup& s = c.setup();
  const lmloss_dtype cdt = compute_dtype(s.dtype);
  if (mode != Mode::backward) {
    const double tol = tolerance_override > 0 ? tolerance_override : tolerance(s.dtype, cdt);
    expect_output("loss", c.loss, ref.loss, tol);
    if (c.lse.present()) expect_output("lse", c.lse, ref.lse, tol);
  }
  if (mode == Mode::forward) return;
  const double tol =
      tolerance_override > 0 ? tolerance_override : tolerance(s.dtype, s.grad_dtype);
  if (!c.linear()) {
    expect_output("grad_logits", s.in_place ? c.logits : c.grad_logits, ref.grad_logits, tol);
    return;
  }
  if (c.grad_hidden.present()) expect_output("grad_hidden", c.grad_hidden, ref.grad_hidden, tol);
  if (c.grad_weight.present()) {
    const bool acc = c.options.flags & LMLOSS_ACCUMULATE_GRAD_WEIGHT;
    expect_output("grad_weight", c.grad_weight,
                  acc ? plus(ref.grad_weight, s.grad_weight_initial) : ref.grad_weight, tol);
  }
  if (c.grad_bias.present()) {
    const bool acc = c.options.flags & LMLOSS_ACCUMULATE_GRAD_BIAS;
    expect_output("grad_bias", c.grad_bias,
                  acc ? plus(ref.grad_bias, s.grad_bias_initial) : ref.grad_bias, tol);
  }
}

// ---- Top-k cases -------------------------------------------------------------------------------

TopkCase::TopkCase(const reference::Problem& problem, const lmloss_topk_options& opts,
                   TopkSetup setup)
    : options(opts), problem_(rounded(problem, setup.dtype)), setup_(setup) {
  const Device d = setup_.device;
  const reference::Problem& p = problem_;
  const int64_t n = p.n_tokens, V = p.vocab, H = p.hidden, k = options.k;
  const int64_t pad = setup_.row_padding;
  const lmloss_dtype cdt = compute_dtype(setup_.dtype);
  if (H == 0) {
    logits = Buffer::of_values(d, setup_.dtype, p.logits, 2, n, V, pad > 0 ? V + pad : 0);
  } else {
    hidden = Buffer::of_values(d, setup_.dtype, p.hidden_states, 2, n, H, pad > 0 ? H + pad : 0);
    weight = Buffer::of_values(d, setup_.dtype, p.weight, 2, V, H, pad > 0 ? H + pad : 0);
    if (!p.bias.empty()) bias = Buffer::of_values(d, setup_.dtype, p.bias, 1, V, 1, setup_.vector_stride);
  }
  const int64_t k_rows = std::max<int64_t>(k, 1);  // k out of range in bad-input tests
  ids = Buffer(d, LMLOSS_I32, 2, n, k_rows, pad > 0 ? k_rows + pad : 0);
  probs = Buffer(d, cdt, 2, n, k_rows, pad > 0 ? k_rows + pad : 0);
  if (setup_.want_tail) tail = Buffer(d, cdt, 1, n, 1, setup_.vector_stride);
}

lmloss_head TopkCase::head() const {
  return {logits.tensor(), hidden.tensor(), weight.tensor(), bias.tensor()};
}

std::vector<const Buffer*> TopkCase::outputs() const {
  std::vector<const Buffer*> out{&ids, &probs};
  if (tail.present()) out.push_back(&tail);
  return out;
}

void TopkCase::prepare_outputs() {
  ids.poison();
  probs.poison();
  tail.poison();
}

void TopkCase::upload_all() {
  for (Buffer* b : {&logits, &hidden, &weight, &bias, &ids, &probs, &tail}) {
    if (b->present()) b->upload();
  }
}

void TopkCase::download_all() {
  for (Buffer* b : {&ids, &probs, &tail}) {
    if (b->present()) b->download();
  }
}

lmloss_status TopkCase::run(lmloss_context* context) {
  return invoke(context, [&] {
    const lmloss_head h = head();
    const lmloss_tensor ids_t = ids.tensor(), probs_t = probs.tensor(), tail_t = tail.tensor();
    return lmloss_topk(context, &h, &options, &ids_t, &probs_t, &tail_t);
  });
}

reference::TopkResult TopkCase::reference() const { return reference::topk(problem_, options); }

void expect_topk_matches_reference(const TopkCase& c, double id_tolerance) {
  const reference::TopkResult ref = c.reference();
  const reference::Problem& p = c.problem();
  const int64_t n = p.n_tokens, V = p.vocab, k = c.options.k;
  const std::vector<double> z = reference::logits(p);
  const double cap = c.options.softcap, T = c.options.temperature;
  auto scaled = [&](int64_t t, int64_t j) {
    const double x = z[t * V + j];
    return (cap > 0 ? cap * std::tanh(x / cap) : x) / T;
  };
  EXPECT_TRUE(fully_written(c.ids));
  EXPECT_TRUE(fully_written(c.probs));
  const std::vector<int64_t> ids = c.ids.ids();
  int reported = 0;
  for (int64_t t = 0; t < n && reported < 5; ++t) {
    std::set<int64_t> seen;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t got = ids[t * k + i], want = ref.ids[t * k + i];
      bool ok = got >= 0 && got < V && seen.insert(got).second;
      if (ok && id_tolerance == 0) ok = got == want;
      if (ok && got != want) {
        const double a = scaled(t, got), b = scaled(t, want);
        ok = std::abs(a - b) <= id_tolerance * std::max(1.0, std::abs(b));
      }
      if (!ok) {
        ADD_FAILURE() << "token " << t << " rank " << i << ": id " << got << ", reference "
                      << want << " (scaled logits "
                      << (got >= 0 && got < V ? scaled(t, got) : NAN) << " vs "
                      << scaled(t, want) << ")";
        ++reported;
        break;
      }
    }
  }
  const double input_tol = tolerance(c.setup().dtype, c.probs.dtype());
  {
    SCOPED_TRACE("probs");
    EXPECT_TRUE(close_to(c.probs.values(), ref.probs, input_tol));
  }
  if (c.tail.present()) {
    SCOPED_TRACE("tail");
    EXPECT_TRUE(fully_written(c.tail));
    // The tail is a mass in [0, 1], often near 0: compared absolutely.
    const std::vector<double> tail = c.tail.values();
    double worst = 0;
    for (int64_t t = 0; t < n; ++t) worst = std::max(worst, std::abs(tail[t] - ref.tail[t]));
    EXPECT_FALSE(!(worst <= input_tol)) << "largest tail error " << worst << " > " << input_tol;
  }
}

// ---- Comparisons -------------------------------------------------------------------------------

::testing::AssertionResult close_to(const std::vector<double>& out,
                                    const std::vector<double>& ref, double tol) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure()
           << "size " << out.size() << ", reference size " << ref.size();
  }
  const double err = reference::relative_error(out, ref);
  if (err <= tol) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure();
  failure << "relative error " << err << " > tolerance " << tol;
  // The worst element, to make the failure actionable.
  size_t worst = 0;
  double worst_diff = -1;
  for (size_t i = 0; i < out.size(); ++i) {
    const double d = std::abs(out[i] - ref[i]);
    if (std::isnan(d) || d > worst_diff) {
      worst = i;
      worst_diff = std::isnan(d) ? INFINITY : d;
      if (std::isnan(d)) break;
    }
  }
  if (!out.empty()) {
    failure << "; worst at element " << worst << ": " << out[worst] << " vs reference "
            << ref[worst];
  }
  return failure;
}

::testing::AssertionResult fully_written(const Buffer& buffer) {
  const int64_t missing = buffer.unwritten();
  if (missing > 0) {
    return ::testing::AssertionFailure()
           << missing << " of " << buffer.count() << " elements left unwritten (still poisoned)";
  }
  if (!buffer.padding_untouched()) {
    return ::testing::AssertionFailure() << "bytes between rows (outside the view) were written";
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult rounded_once_from(const Buffer& narrow, const Buffer& wide, int64_t count, float scale,
                                             int64_t narrow_first, double differ_fraction, double floor_of_largest) {
  const double ulp = narrow.dtype() == LMLOSS_BF16 ? 0x1p-7 : 0x1p-10;  // at most, relative
  auto want_at = [&](int64_t i) { return round_to(narrow.dtype(), double(float(wide.get(i)) * scale)); };
  double largest = 0;  // read only for an absolute allowance
  for (int64_t i = 0; floor_of_largest > 0 && i < count; ++i) largest = std::max(largest, std::fabs(want_at(i)));
  const double slack = 0x1p-24 + floor_of_largest * largest;  // absolute, beside the ulp
  int64_t differ = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double got = narrow.get(narrow_first + i);
    const double want = want_at(i);
    if (got == want) continue;
    ++differ;
    if (std::fabs(got - want) > ulp * std::fabs(want) + slack)
      return ::testing::AssertionFailure() << "element " << i << ": " << got << ", rounded once " << want;
  }
  if (differ > std::max<int64_t>(1, int64_t(double(count) * differ_fraction)))
    return ::testing::AssertionFailure() << differ << " of " << count << " elements differ";
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult untouched(const Buffer& buffer) {
  if (buffer.untouched()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "a buffer (" << dtype_name(buffer.dtype()) << ", "
                                       << buffer.count() << " elements) was written";
}

bool bitwise_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

// ---- Naming ------------------------------------------------------------------------------------

std::string param_name(Device device) { return device_name(device); }
std::string param_name(lmloss_dtype dtype) { return dtype_name(dtype); }

}  // namespace lmloss::test
