// lmloss — the C++ API: a thin layer over lmloss.h. RAII for the context, lmloss::Error for a
// failed call, typed views for tensors, and one named function per operation.
//
//   using lmloss::Tensor;
//   lmloss::Context ctx;
//   float loss;
//   lmloss::linear_cross_entropy(ctx, {Tensor::matrix(x, n_tokens, hidden), Tensor::matrix(w, vocab, hidden)},
//                                Tensor::vector(labels, n_tokens), lmloss::LossOptions{},
//                                Tensor::scalar(&loss), Tensor{}, {Tensor::matrix(dx, n_tokens, hidden)});
//
// C++17 (CUDA sources include it too). Inputs may be const: a view of a const T* describes
// memory the library only reads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "lmloss/lmloss.h"

namespace lmloss {

class Error : public std::runtime_error {
 public:
  Error(lmloss_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  lmloss_status status() const noexcept { return status_; }

 private:
  lmloss_status status_;
};

inline void check(lmloss_status status) {
  if (status != LMLOSS_SUCCESS) {
    const char* message = lmloss_last_error();
    throw Error(status, message && *message ? message : lmloss_status_string(status));
  }
}

template <typename T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr lmloss_dtype value = LMLOSS_F32; };
template <> struct dtype_of<double> { static constexpr lmloss_dtype value = LMLOSS_F64; };
template <> struct dtype_of<int32_t> { static constexpr lmloss_dtype value = LMLOSS_I32; };
template <> struct dtype_of<int64_t> { static constexpr lmloss_dtype value = LMLOSS_I64; };
template <> struct dtype_of<uint8_t> { static constexpr lmloss_dtype value = LMLOSS_U8; };

// A view of the caller's memory; default-constructed = absent.
struct Tensor : lmloss_tensor {
  Tensor() : lmloss_tensor(lmloss_tensor_none()) {}
  Tensor(const lmloss_tensor& t) : lmloss_tensor(t) {}  // NOLINT: views convert freely

  // Untyped views, for bf16/f16 storage or device memory.
  static Tensor scalar(void* data, lmloss_dtype dtype) { return lmloss_tensor_scalar(data, dtype); }
  static Tensor vector(void* data, lmloss_dtype dtype, int64_t n) {
    return lmloss_tensor_1d(data, dtype, n);
  }
  static Tensor matrix(void* data, lmloss_dtype dtype, int64_t rows, int64_t cols,
                       int64_t row_stride = 0) {
    return lmloss_tensor_2d(data, dtype, rows, cols, row_stride);
  }
  // Typed views (of const data too: lmloss_tensor's pointer is not const, as outputs share it).
  template <typename T> static Tensor scalar(T* data) {
    return scalar(untyped(data), dtype_of<std::remove_cv_t<T>>::value);
  }
  // (The size is a template parameter so that an lmloss_dtype, an enum, never binds to it: a
  // uint8_t* with a dtype is the untyped overload above.)
  template <typename T, typename Size, std::enable_if_t<std::is_integral_v<Size>, int> = 0>
  static Tensor vector(T* data, Size n) {
    return vector(untyped(data), dtype_of<std::remove_cv_t<T>>::value, int64_t(n));
  }
  template <typename T, typename Size, std::enable_if_t<std::is_integral_v<Size>, int> = 0>
  static Tensor matrix(T* data, Size rows, int64_t cols, int64_t row_stride = 0) {
    return matrix(untyped(data), dtype_of<std::remove_cv_t<T>>::value, int64_t(rows), cols, row_stride);
  }
  // The same view, on a CUDA device.
  Tensor on_cuda(int32_t index = 0) const {
    Tensor t = *this;
    t.device_type = LMLOSS_DEVICE_CUDA;
    t.device_index = index;
    return t;
  }
  bool present() const { return data != nullptr; }

 private:
  template <typename T> static void* untyped(T* data) {
    return const_cast<void*>(static_cast<const volatile void*>(data));
  }
};

class Context {
 public:
  Context() { check(lmloss_context_create(&context_)); }
  ~Context() { lmloss_context_destroy(context_); }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  Context(Context&& other) noexcept : context_(std::exchange(other.context_, nullptr)) {}
  Context& operator=(Context&& other) noexcept {
    std::swap(context_, other.context_);
    return *this;
  }

  void set_workspace_budget(size_t bytes) { check(lmloss_context_set_workspace_budget(context_, bytes)); }
  size_t workspace_budget() const {
    size_t bytes = 0;
    check(lmloss_context_get_workspace_budget(context_, &bytes));
    return bytes;
  }
  size_t peak_workspace() const {
    size_t bytes = 0;
    check(lmloss_context_get_peak_workspace(context_, &bytes));
    return bytes;
  }
  void reset_peak_workspace() { check(lmloss_context_reset_peak_workspace(context_)); }
  void set_num_threads(int n) { check(lmloss_context_set_num_threads(context_, n)); }
  void set_product_tuning(bool enabled) { check(lmloss_context_set_product_tuning(context_, enabled ? 1 : 0)); }
  void set_stream(void* stream) { check(lmloss_context_set_stream(context_, stream)); }
  void set_allocator(const lmloss_allocator* allocator) {
    check(lmloss_context_set_allocator(context_, allocator));
  }
  void synchronize() { check(lmloss_context_synchronize(context_)); }

  lmloss_context* get() const { return context_; }

 private:
  lmloss_context* context_ = nullptr;
};

inline bool backend_available(lmloss_device_type device_type) {
  return lmloss_backend_available(device_type) != 0;
}

struct LossOptions : lmloss_loss_options {
  LossOptions() : lmloss_loss_options(lmloss_loss_options_default()) {}
};

struct TopkOptions : lmloss_topk_options {
  explicit TopkOptions(int64_t top_k = 1) : lmloss_topk_options(lmloss_topk_options_default()) {
    k = top_k;
  }
};

// The head of a linear loss: hidden (n_tokens, hidden), weight (vocab, hidden), bias (vocab).
struct Linear {
  Tensor hidden;
  Tensor weight;
  Tensor bias;
};

// The teacher's top-k: ids (n_tokens, k), probs (n_tokens, k).
struct Teacher {
  Tensor ids;
  Tensor probs;
};

// Gradients of a linear loss; absent ones are not computed.
struct LinearGrads {
  Tensor grad_hidden;
  Tensor grad_weight;
  Tensor grad_bias;
};

// ---- The general calls (any head, any targets) -------------------------------------------

inline void loss_forward(Context& ctx, const lmloss_head& head, const lmloss_targets& targets,
                         const lmloss_loss_options& options, Tensor loss, Tensor lse = {}) {
  check(lmloss_loss_forward(ctx.get(), &head, &targets, &options, &loss, &lse));
}
inline void loss_backward(Context& ctx, const lmloss_head& head, const lmloss_targets& targets,
                          const lmloss_loss_options& options, Tensor lse, Tensor grad_loss,
                          const lmloss_grads& grads) {
  check(lmloss_loss_backward(ctx.get(), &head, &targets, &options, &lse, &grad_loss, &grads));
}
inline void loss_forward_backward(Context& ctx, const lmloss_head& head,
                                  const lmloss_targets& targets, const lmloss_loss_options& options,
                                  Tensor grad_loss, Tensor loss, Tensor lse,
                                  const lmloss_grads& grads) {
  check(lmloss_loss_forward_backward(ctx.get(), &head, &targets, &options, &grad_loss, &loss,
                                     &lse, &grads));
}
// The bytes of options.grad_weight_deferred the same loss_forward_backward takes (0: none).
inline size_t loss_deferred_bytes(Context& ctx, const lmloss_head& head, const lmloss_targets& targets,
                                  const lmloss_loss_options& options, Tensor grad_loss, Tensor loss,
                                  Tensor lse, const lmloss_grads& grads) {
  size_t bytes = 0;
  check(lmloss_loss_deferred_bytes(ctx.get(), &head, &targets, &options, &grad_loss, &loss, &lse,
                                   &grads, &bytes));
  return bytes;
}
inline void topk(Context& ctx, const lmloss_head& head, const lmloss_topk_options& options,
                 Tensor ids, Tensor probs, Tensor tail = {}) {
  check(lmloss_topk(ctx.get(), &head, &options, &ids, &probs, &tail));
}
inline void scale_gradient(Context& ctx, Tensor grad, Tensor scale, Tensor out) {
  check(lmloss_scale_gradient(ctx.get(), &grad, scale.data ? &scale : nullptr, &out));
}

// A 16-bit grad_weight's kept f32 sum (options.grad_weight_sum_tail), or a bf16 one's values and
// u8 tail of rests, rounded once into it.
inline void round_grad_weight(Context& ctx, Tensor grad_weight, Tensor tail, Tensor scale = {}) {
  check(lmloss_round_grad_weight(ctx.get(), &grad_weight, &tail, scale.data ? &scale : nullptr));
}
// The same, with the last chunk's product its step left in `deferred` (options.grad_weight_deferred).
inline void round_grad_weight_deferred(Context& ctx, Tensor grad_weight, Tensor tail, Tensor deferred,
                                       Tensor scale = {}) {
  check(lmloss_round_grad_weight_deferred(ctx.get(), &grad_weight, &tail, scale.data ? &scale : nullptr,
                                          &deferred));
}

inline lmloss_head logits_head(Tensor logits) {
  return {logits, Tensor{}, Tensor{}, Tensor{}};
}
inline lmloss_head linear_head(const Linear& linear) {
  return {Tensor{}, linear.hidden, linear.weight, linear.bias};
}
inline lmloss_targets label_targets(Tensor labels, Tensor token_mask = {}) {
  return {labels, Tensor{}, Tensor{}, token_mask};
}
inline lmloss_targets teacher_targets(const Teacher& teacher, Tensor labels = {},
                                      Tensor token_mask = {}) {
  return {labels, teacher.ids, teacher.probs, token_mask};
}
inline lmloss_grads linear_grads(const LinearGrads& g) {
  return {Tensor{}, g.grad_hidden, g.grad_weight, g.grad_bias};
}
inline lmloss_grads logits_grads(Tensor grad_logits) {
  return {grad_logits, Tensor{}, Tensor{}, Tensor{}};
}

// ---- Cross-entropy from logits -----------------------------------------------------------

inline void cross_entropy_forward(Context& ctx, Tensor logits, Tensor labels,
                                  const lmloss_loss_options& options, Tensor loss, Tensor lse = {}) {
  loss_forward(ctx, logits_head(logits), label_targets(labels), options, loss, lse);
}
inline void cross_entropy_backward(Context& ctx, Tensor logits, Tensor labels,
                                   const lmloss_loss_options& options, Tensor lse,
                                   Tensor grad_loss, Tensor grad_logits) {
  loss_backward(ctx, logits_head(logits), label_targets(labels), options, lse, grad_loss,
                logits_grads(grad_logits));
}
// Fused; pass the logits as grad_logits to write the gradient over them.
inline void cross_entropy(Context& ctx, Tensor logits, Tensor labels,
                          const lmloss_loss_options& options, Tensor loss, Tensor lse,
                          Tensor grad_logits, Tensor grad_loss = {}) {
  loss_forward_backward(ctx, logits_head(logits), label_targets(labels), options, grad_loss, loss,
                        lse, logits_grads(grad_logits));
}

// ---- Linear cross-entropy ----------------------------------------------------------------

inline void linear_cross_entropy_forward(Context& ctx, const Linear& linear, Tensor labels,
                                         const lmloss_loss_options& options, Tensor loss,
                                         Tensor lse = {}) {
  loss_forward(ctx, linear_head(linear), label_targets(labels), options, loss, lse);
}
inline void linear_cross_entropy_backward(Context& ctx, const Linear& linear, Tensor labels,
                                          const lmloss_loss_options& options, Tensor lse,
                                          Tensor grad_loss, const LinearGrads& grads) {
  loss_backward(ctx, linear_head(linear), label_targets(labels), options, lse, grad_loss,
                linear_grads(grads));
}
inline void linear_cross_entropy(Context& ctx, const Linear& linear, Tensor labels,
                                 const lmloss_loss_options& options, Tensor loss, Tensor lse,
                                 const LinearGrads& grads, Tensor grad_loss = {}) {
  loss_forward_backward(ctx, linear_head(linear), label_targets(labels), options, grad_loss, loss,
                        lse, linear_grads(grads));
}

// ---- Linear top-k distillation (mixed with cross-entropy when labels and ce_weight are set) --

inline void linear_distill_forward(Context& ctx, const Linear& linear, const Teacher& teacher,
                                   Tensor labels, Tensor token_mask,
                                   const lmloss_loss_options& options, Tensor loss,
                                   Tensor lse = {}) {
  loss_forward(ctx, linear_head(linear), teacher_targets(teacher, labels, token_mask), options,
               loss, lse);
}
inline void linear_distill_backward(Context& ctx, const Linear& linear, const Teacher& teacher,
                                    Tensor labels, Tensor token_mask,
                                    const lmloss_loss_options& options, Tensor lse,
                                    Tensor grad_loss, const LinearGrads& grads) {
  loss_backward(ctx, linear_head(linear), teacher_targets(teacher, labels, token_mask), options,
                lse, grad_loss, linear_grads(grads));
}
inline void linear_distill(Context& ctx, const Linear& linear, const Teacher& teacher,
                           Tensor labels, Tensor token_mask, const lmloss_loss_options& options,
                           Tensor loss, Tensor lse, const LinearGrads& grads,
                           Tensor grad_loss = {}) {
  loss_forward_backward(ctx, linear_head(linear), teacher_targets(teacher, labels, token_mask),
                        options, grad_loss, loss, lse, linear_grads(grads));
}

// ---- Teacher top-k -----------------------------------------------------------------------

inline void topk_logits(Context& ctx, Tensor logits, const lmloss_topk_options& options,
                        Tensor ids, Tensor probs, Tensor tail = {}) {
  topk(ctx, logits_head(logits), options, ids, probs, tail);
}
inline void topk_linear(Context& ctx, const Linear& linear, const lmloss_topk_options& options,
                        Tensor ids, Tensor probs, Tensor tail = {}) {
  topk(ctx, linear_head(linear), options, ids, probs, tail);
}

}  // namespace lmloss
