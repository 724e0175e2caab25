// The seam between the public calls and the backends. The public calls (src/core/api.cpp)
// validate every argument once and hand a backend a checked call; a backend never re-validates
// shapes, only does the work. CPU and CUDA implement the same entry points.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/dtype.hpp"
#include "lmloss/lmloss.h"

namespace lmloss::core {

enum class Mode { forward, backward, forward_backward };

// A validated loss call. Tensors absent from the call have data == nullptr.
struct LossCall {
  Mode mode = Mode::forward;
  lmloss_head head{};
  lmloss_targets targets{};
  lmloss_loss_options options{};
  lmloss_tensor loss{};       // forward, forward_backward: () or (n_tokens)
  lmloss_tensor lse{};        // forward: output, optional; backward: input; fused: optional output
  lmloss_tensor grad_loss{};  // backward, forward_backward: optional upstream gradient
  lmloss_grads grads{};

  int64_t n_tokens = 0;
  int64_t vocab = 0;
  int64_t hidden = 0;  // 0 for logits inputs
  int64_t top_k = 0;   // 0 without a teacher
  bool linear = false;         // logits formed from hidden and weight
  bool in_place = false;       // grads.grad_logits is the logits buffer
  // With options.grad_weight_sum_tail: dW's f32 sum kept, rows [0, split) in grad_weight's bytes.
  int64_t weight_sum_split = 0;
  lmloss_dtype input_dtype = LMLOSS_F32;    // of logits or hidden/weight
  lmloss_dtype compute_dtype = LMLOSS_F32;  // F64 for F64 inputs, else F32
  lmloss_device_type device_type = LMLOSS_DEVICE_CPU;
  int32_t device_index = 0;

  bool wants_loss() const { return mode != Mode::backward; }
  bool wants_grads() const { return mode != Mode::forward; }
  bool has_labels() const { return targets.labels.data != nullptr; }
  bool has_teacher() const { return targets.teacher_ids.data != nullptr; }
  bool has_mask() const { return targets.token_mask.data != nullptr; }
};

// A validated top-k call.
struct TopkCall {
  lmloss_head head{};
  lmloss_topk_options options{};
  lmloss_tensor ids{};    // (n_tokens, k) i32
  lmloss_tensor probs{};  // (n_tokens, k) compute dtype
  lmloss_tensor tail{};   // (n_tokens) compute dtype, optional

  int64_t n_tokens = 0;
  int64_t vocab = 0;
  int64_t hidden = 0;
  bool linear = false;
  lmloss_dtype input_dtype = LMLOSS_F32;
  lmloss_dtype compute_dtype = LMLOSS_F32;
  lmloss_device_type device_type = LMLOSS_DEVICE_CPU;
  int32_t device_index = 0;
};

// A validated gradient scaling: out = grad * scale, viewed as (rows, cols) with row strides.
struct ScaleCall {
  lmloss_tensor grad{};   // any float dtype (f64 on the CPU only)
  lmloss_tensor scale{};  // one element of the product dtype (f32; f64 for an f64 grad), optional (1)
  lmloss_tensor out{};    // any float dtype, grad's shape

  int64_t rows = 0;
  int64_t cols = 0;
  lmloss_device_type device_type = LMLOSS_DEVICE_CPU;
  int32_t device_index = 0;
};

// A validated lmloss_round_grad_weight: a 16-bit grad_weight = round(sum * scale), the f32 sum's
// rows [0, split) in grad_weight's own bytes (row r at byte 4 r hidden), the rest in `tail`; or,
// with a u8 tail, a bf16 grad_weight's values and the tail's rests of them (split 0).
struct WeightSumCall {
  lmloss_tensor grad_weight{};  // (vocab, hidden) bf16 or f16
  lmloss_tensor tail{};         // (vocab - split, hidden) f32, or (vocab, hidden) u8
  lmloss_tensor scale{};        // one f32, optional (1)
  lmloss_tensor deferred{};     // u8: a step's last chunk's dW product, optional (see
                                // lmloss_round_grad_weight_deferred)

  int64_t vocab = 0;
  int64_t hidden = 0;
  int64_t split = 0;
  lmloss_device_type device_type = LMLOSS_DEVICE_CPU;
  int32_t device_index = 0;
};

// Whether a kept sum is a bf16 grad_weight's values and a u8 tail of their 8-bit rests
// (core/weight_sum_rest.hpp), not an f32 sum.
inline bool weight_sum_keeps_rests(const lmloss_tensor& tail) { return tail.data && tail.dtype == LMLOSS_U8; }

// Whether a 16-bit grad_weight's own bytes may hold rows of its f32 sum: its rows dense and
// 16-byte aligned (the bytes between strided rows may be another tensor's).
inline bool weight_sum_fits_in_place(const lmloss_tensor& grad_weight, int64_t hidden) {
  return row_stride(grad_weight) == hidden && reinterpret_cast<uintptr_t>(grad_weight.data) % 16 == 0;
}

// How many of a 16-bit grad_weight's rows an f32 sum the library makes for itself holds over the
// gradient's own bytes: LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS's split (half the vocabulary, a multiple
// of 8 rows, which keeps the tail's columns of a gradient chunk on 16 bytes) where they fit, else
// 0. The rest goes in a tail of workspace.
inline int64_t weight_sum_rows_in_place(const lmloss_tensor& grad_weight, int64_t vocab, int64_t hidden) {
  return weight_sum_fits_in_place(grad_weight, hidden) ? vocab - LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(vocab) : 0;
}

// Whether a sum's tail starts where its `split` rows in place end, with their row stride: then the
// whole sum is one f32 (vocab, hidden) matrix at grad_weight's address, filled by one product.
inline bool weight_sum_is_one_matrix(const lmloss_tensor& grad_weight, const lmloss_tensor& tail, int64_t split,
                                     int64_t hidden) {
  return split > 0 && row_stride(tail) == hidden &&
         tail.data == static_cast<const char*>(grad_weight.data) + split * hidden * int64_t(sizeof(float));
}

// Per-context state a backend keeps (handles, cached plans, device buffers). Owned by the
// context, destroyed with it.
class BackendState {
 public:
  virtual ~BackendState() = default;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Whether the backend can run here (a device and driver for CUDA).
  virtual bool available() const = 0;
  // Checks what only the backend knows (dtype support, id ranges it can read before writing);
  // runs before anything is written. Returns LMLOSS_SUCCESS or sets the error message.
  virtual lmloss_status check(lmloss_context& context, const LossCall& call) = 0;
  virtual lmloss_status check(lmloss_context& context, const TopkCall& call) = 0;
  virtual lmloss_status run(lmloss_context& context, const LossCall& call) = 0;
  // The bytes of options.grad_weight_deferred that this fused step takes (0: it defers nothing).
  virtual lmloss_status deferred_bytes(lmloss_context& context, const LossCall& call, size_t& bytes) = 0;
  virtual lmloss_status run(lmloss_context& context, const TopkCall& call) = 0;
  virtual lmloss_status run(lmloss_context& context, const ScaleCall& call) = 0;
  virtual lmloss_status run(lmloss_context& context, const WeightSumCall& call) = 0;
  // Every element of `t` (rank 0 to 2, its row stride kept) set to zero bytes, on the context's
  // stream: the outputs of a call over no tokens.
  virtual lmloss_status zero(lmloss_context& context, const lmloss_tensor& t) = 0;
  // lmloss_context_synchronize: wait for queued work, report device-side errors.
  virtual lmloss_status synchronize(lmloss_context& context) = 0;
};

Backend& cpu_backend();
// nullptr when the library was built without CUDA.
Backend* cuda_backend();

}  // namespace lmloss::core
