// Validation of the public calls. Each check names the argument as the header does
// ("head.weight", "targets.labels", "options.temperature") so a caller can find it.
#include "core/validate.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <string>
#include <utility>

#include "core/context.hpp"
#include "core/dtype.hpp"

namespace lmloss::core {
namespace {

std::string shape_string(const lmloss_tensor& t) {
  // Appended piece by piece: "(" + std::to_string(...) trips a false -Wrestrict in GCC 12.
  std::string s = "(";
  for (int d = 0; d < t.ndim && d < 2; ++d) {
    if (d > 0) s += ", ";
    s += std::to_string(t.shape[d]);
  }
  s += ")";
  return s;
}

lmloss_status invalid(const std::string& name, const std::string& what) {
  return fail(LMLOSS_ERROR_INVALID_ARGUMENT, name + ": " + what);
}

// Structural checks every present tensor passes: known dtype and device, sane rank and stride.
lmloss_status check_tensor(const lmloss_tensor& t, const char* name) {
  if (t.data == nullptr) return LMLOSS_SUCCESS;
  const int64_t dtype = raw_enum(t.dtype), device_type = raw_enum(t.device_type);
  if (dtype < 0 || dtype >= LMLOSS_DTYPE_COUNT) return invalid(name, "unknown dtype " + std::to_string(dtype));
  if (device_type < 0 || device_type >= LMLOSS_DEVICE_TYPE_COUNT)
    return invalid(name, "unknown device type " + std::to_string(device_type));
  if (t.device_index < 0) return invalid(name, "negative device index");
  if (device_type == LMLOSS_DEVICE_CPU && t.device_index != 0)
    return invalid(name, "device index " + std::to_string(t.device_index) + " for CPU memory (must be 0)");
  if (t.ndim < 0 || t.ndim > 2) return invalid(name, "rank must be 0, 1 or 2, got " + std::to_string(t.ndim));
  for (int d = 0; d < t.ndim; ++d)
    if (t.shape[d] < 0) return invalid(name, "negative shape " + shape_string(t));
  if (t.stride < 0) return invalid(name, "negative stride");
  if (t.ndim == 2 && t.stride != 0 && t.stride < t.shape[1])
    return invalid(name, "row stride " + std::to_string(t.stride) + " is smaller than the row length " +
                             std::to_string(t.shape[1]));
  return LMLOSS_SUCCESS;
}

lmloss_status expect_shape(const lmloss_tensor& t, const char* name, int ndim, int64_t d0, int64_t d1,
                           const char* meaning) {
  const bool scalar_ok = ndim == 0 && (t.ndim == 0 || (t.ndim == 1 && t.shape[0] == 1));
  const bool match = scalar_ok || (t.ndim == ndim && (ndim < 1 || t.shape[0] == d0) &&
                                   (ndim < 2 || t.shape[1] == d1));
  if (match) return LMLOSS_SUCCESS;
  return invalid(name, std::string("expected shape ") + meaning + ", got " + shape_string(t));
}

lmloss_status expect_dtype(const lmloss_tensor& t, const char* name, lmloss_dtype a, lmloss_dtype b,
                           const char* what) {
  if (t.dtype == a || t.dtype == b) return LMLOSS_SUCCESS;
  return invalid(name, std::string("dtype ") + dtype_name(t.dtype) + " not allowed; expected " + what);
}

bool finite(double x) { return std::isfinite(x); }

// All present tensors live on one device, which becomes the call's.
struct DeviceCheck {
  bool seen = false;
  lmloss_device_type type = LMLOSS_DEVICE_CPU;
  int32_t index = 0;
  lmloss_status add(const lmloss_tensor& t, const char* name) {
    if (t.data == nullptr) return LMLOSS_SUCCESS;
    if (!seen) {
      seen = true;
      type = t.device_type;
      index = t.device_index;
      return LMLOSS_SUCCESS;
    }
    if (t.device_type != type || t.device_index != index)
      return invalid(name, "is on another device than the other tensors");
    return LMLOSS_SUCCESS;
  }
};

// The bytes a tensor's elements occupy: `rows` runs of `row_bytes`, `stride_bytes` apart (a
// vector's elements are its rows; runs that touch are one).
struct ByteRows {
  intptr_t begin = 0;
  int64_t rows = 0;
  int64_t row_bytes = 0;
  int64_t stride_bytes = 0;
};

ByteRows byte_rows(const lmloss_tensor& t) {
  const int64_t size = int64_t(dtype_size(t.dtype));
  ByteRows b{reinterpret_cast<intptr_t>(t.data), t.ndim == 1 ? t.shape[0] : row_count(t),
             t.ndim == 1 ? size : row_length(t) * size, row_stride(t) * size};
  if (!t.data || b.row_bytes == 0) b.rows = 0;
  if (b.rows > 1 && b.stride_bytes == b.row_bytes) {
    b.row_bytes *= b.rows;
    b.rows = 1;
  }
  if (b.rows == 1) b.stride_bytes = b.row_bytes;
  return b;
}

// Whether two tensors share a byte: exactly, so rows interleaved with another tensor's (views of
// one buffer of wider rows) do not count. Walks the rows of the one with fewer, and only when
// their spans overlap.
bool share_bytes(const lmloss_tensor& x, const lmloss_tensor& y) {
  const ByteRows a = byte_rows(x), b = byte_rows(y);
  if (a.rows == 0 || b.rows == 0) return false;
  const auto end = [](const ByteRows& r) { return r.begin + (r.rows - 1) * r.stride_bytes + r.row_bytes; };
  if (end(a) <= b.begin || end(b) <= a.begin) return false;
  const ByteRows& few = a.rows <= b.rows ? a : b;
  const ByteRows& many = a.rows <= b.rows ? b : a;
  for (int64_t j = 0; j < few.rows; ++j) {
    // Row j of `few` at [start, start + few.row_bytes) from `many`'s first byte meets row i of
    // `many` when start - many.row_bytes < i * stride < start + few.row_bytes: try the least i.
    const int64_t start = few.begin + j * few.stride_bytes - many.begin;
    const int64_t above = start - many.row_bytes;
    const int64_t i = above < 0 ? 0 : above / many.stride_bytes + 1;
    if (i < many.rows && i * many.stride_bytes < start + few.row_bytes) return true;
  }
  return false;
}

struct NamedTensor {
  const lmloss_tensor* tensor;
  const char* name;
};

// No output shares a byte with an input or with another output: a call reads its inputs after it
// has started writing, so any overlap is a result that depends on the order of the work.
// `in_place` names the one pair that may be the same tensor (an output over its own input), and
// `in_place_rule` says so in the message.
lmloss_status check_no_overlap(std::initializer_list<NamedTensor> outputs, std::initializer_list<NamedTensor> inputs,
                               std::pair<const lmloss_tensor*, const lmloss_tensor*> in_place = {},
                               const char* in_place_rule = "") {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    auto refuse = [&](const NamedTensor& other) {
      return invalid(out->name, std::string("shares memory with ") + other.name +
                                    "; outputs may not overlap the inputs or each other" + in_place_rule);
    };
    for (auto other = std::next(out); other != outputs.end(); ++other)
      if (share_bytes(*out->tensor, *other->tensor)) return refuse(*other);
    for (const NamedTensor& in : inputs) {
      const bool allowed = out->tensor == in_place.first && in.tensor == in_place.second &&
                           out->tensor->data == in.tensor->data;
      if (!allowed && share_bytes(*out->tensor, *in.tensor)) return refuse(in);
    }
  }
  return LMLOSS_SUCCESS;
}

// The head: logits, or hidden + weight (+ bias). Fills the shape fields of a call.
template <typename Call>
lmloss_status check_head(const lmloss_head& head, Call& call) {
  LMLOSS_CHECK(check_tensor(head.logits, "head.logits"));
  LMLOSS_CHECK(check_tensor(head.hidden, "head.hidden"));
  LMLOSS_CHECK(check_tensor(head.weight, "head.weight"));
  LMLOSS_CHECK(check_tensor(head.bias, "head.bias"));
  const bool has_logits = head.logits.data != nullptr;
  const bool has_hidden = head.hidden.data != nullptr;
  const bool has_weight = head.weight.data != nullptr;
  if (has_logits && (has_hidden || has_weight || head.bias.data))
    return invalid("head.logits", "give either logits or hidden and weight, not both");
  if (!has_logits && !(has_hidden && has_weight)) {
    if (has_hidden) return invalid("head.weight", "is missing (hidden states need the head's weight)");
    if (has_weight) return invalid("head.hidden", "is missing (the weight needs hidden states)");
    return invalid("head.logits", "is missing: give logits, or hidden and weight");
  }
  if (has_logits) {
    const lmloss_tensor& z = head.logits;
    if (z.ndim != 2) return invalid("head.logits", "expected shape (n_tokens, vocab), got " + shape_string(z));
    if (!is_float(z.dtype))
      return invalid("head.logits", std::string("dtype ") + dtype_name(z.dtype) + " not allowed; expected f32, bf16, f16 or f64");
    call.linear = false;
    call.n_tokens = z.shape[0];
    call.vocab = z.shape[1];
    call.hidden = 0;
    call.input_dtype = z.dtype;
  } else {
    const lmloss_tensor& x = head.hidden;
    const lmloss_tensor& w = head.weight;
    if (x.ndim != 2) return invalid("head.hidden", "expected shape (n_tokens, hidden), got " + shape_string(x));
    if (w.ndim != 2) return invalid("head.weight", "expected shape (vocab, hidden), got " + shape_string(w));
    if (!is_float(x.dtype))
      return invalid("head.hidden", std::string("dtype ") + dtype_name(x.dtype) + " not allowed; expected f32, bf16, f16 or f64");
    if (w.dtype != x.dtype)
      return invalid("head.weight", std::string("dtype ") + dtype_name(w.dtype) + " differs from head.hidden's " + dtype_name(x.dtype));
    if (w.shape[1] != x.shape[1])
      return invalid("head.weight", "expected shape (vocab, " + std::to_string(x.shape[1]) + ") to match head.hidden, got " + shape_string(w));
    call.linear = true;
    call.n_tokens = x.shape[0];
    call.vocab = w.shape[0];
    call.hidden = x.shape[1];
    call.input_dtype = x.dtype;
    if (call.hidden < 1) return invalid("head.hidden", "hidden size must be at least 1");
    if (head.bias.data) {
      LMLOSS_CHECK(expect_shape(head.bias, "head.bias", 1, call.vocab, 0, "(vocab)"));
      if (head.bias.dtype != x.dtype)
        return invalid("head.bias", std::string("dtype ") + dtype_name(head.bias.dtype) + " differs from head.hidden's " + dtype_name(x.dtype));
    }
  }
  if (call.vocab < 1) return invalid(call.linear ? "head.weight" : "head.logits", "vocabulary must have at least one entry");
  call.head = head;
  call.compute_dtype = compute_dtype_of(call.input_dtype);
  return LMLOSS_SUCCESS;
}

lmloss_status check_scaling(double softcap, double temperature, const char* softcap_name,
                            const char* temperature_name) {
  if (!finite(softcap) || softcap < 0) return invalid(softcap_name, "must be finite and >= 0 (0 turns soft-capping off)");
  if (!finite(temperature) || temperature <= 0) return invalid(temperature_name, "must be finite and > 0");
  return LMLOSS_SUCCESS;
}

lmloss_status check_options(const lmloss_loss_options& o) {
  const int64_t reduction = raw_enum(o.reduction);
  if (reduction < 0 || reduction >= LMLOSS_REDUCTION_COUNT)
    return invalid("options.reduction", "unknown reduction " + std::to_string(reduction));
  if (!finite(o.normalizer) || o.normalizer < 0) return invalid("options.normalizer", "must be finite and >= 0 (0: the counted tokens)");
  if (!finite(o.ce_weight)) return invalid("options.ce_weight", "must be finite");
  if (!finite(o.kd_weight)) return invalid("options.kd_weight", "must be finite");
  if (!finite(o.label_smoothing) || o.label_smoothing < 0 || o.label_smoothing > 1)
    return invalid("options.label_smoothing", "must be in [0, 1]");
  if (!finite(o.z_loss) || o.z_loss < 0) return invalid("options.z_loss", "must be finite and >= 0");
  LMLOSS_CHECK(check_scaling(o.softcap, o.temperature, "options.softcap", "options.temperature"));
  if (o.flags & ~(LMLOSS_ACCUMULATE_GRAD_WEIGHT | LMLOSS_ACCUMULATE_GRAD_BIAS | LMLOSS_SUM_GRAD_WEIGHT_IN_F32))
    return invalid("options.flags", "unknown flag bits");
  return LMLOSS_SUCCESS;
}

// An optional scale (NULL: 1): one element of the product's dtype.
lmloss_status read_scale(const lmloss_tensor* scale, lmloss_dtype product, lmloss_tensor& out) {
  out = scale ? *scale : lmloss_tensor_none();
  if (!out.data) return LMLOSS_SUCCESS;
  LMLOSS_CHECK(check_tensor(out, "scale"));
  LMLOSS_CHECK(expect_shape(out, "scale", 0, 0, 0, "() or (1)"));
  return expect_dtype(out, "scale", product, product, dtype_name(product));
}

// lmloss_loss_options as 0.1 and 0.2 had them, before grad_weight_sum_tail and before
// grad_weight_deferred: still accepted, the later fields absent.
constexpr size_t kLossOptionsSizeV01 = offsetof(lmloss_loss_options, grad_weight_sum_tail);
constexpr size_t kLossOptionsSizeV02 = offsetof(lmloss_loss_options, grad_weight_deferred);

// The caller's options, read only as far as its struct_size says, then checked.
lmloss_status read_options(const lmloss_loss_options& given, lmloss_loss_options& o) {
  if (given.struct_size != sizeof(lmloss_loss_options) && given.struct_size != kLossOptionsSizeV01 &&
      given.struct_size != kLossOptionsSizeV02)
    return invalid("options.struct_size", "must be sizeof(lmloss_loss_options); initialise with LMLOSS_LOSS_OPTIONS_INIT");
  o = lmloss_loss_options_default();
  std::memcpy(static_cast<void*>(&o), &given, given.struct_size);
  o.struct_size = sizeof(lmloss_loss_options);
  LMLOSS_CHECK(check_options(o));
  LMLOSS_CHECK(check_tensor(o.grad_weight_deferred, "options.grad_weight_deferred"));
  return check_tensor(o.grad_weight_sum_tail, "options.grad_weight_sum_tail");
}

// A buffer for a step's deferred dW product (options.grad_weight_deferred): u8 bytes of its own,
// aligned for the products that read it. Its size is the backend's to check.
lmloss_status check_deferred(const lmloss_tensor& deferred, const char* name) {
  LMLOSS_CHECK(expect_dtype(deferred, name, LMLOSS_U8, LMLOSS_U8, "u8"));
  if (deferred.ndim != 1 || deferred.shape[0] < 1)
    return invalid(name, "expected a shape (bytes) as lmloss_loss_deferred_bytes gives it, got " + shape_string(deferred));
  if (reinterpret_cast<uintptr_t>(deferred.data) % 256 != 0) return invalid(name, "its data must be 256-byte aligned");
  return LMLOSS_SUCCESS;
}

// A 16-bit grad_weight's f32 sum kept in its own bytes (rows [0, split)) and in the caller's tail
// (rows [split, vocab)): the layout both the loss calls and lmloss_round_grad_weight rely on.
// Fills `split`.
lmloss_status check_f32_weight_sum(const lmloss_tensor& grad_weight, const char* grad_name, const lmloss_tensor& tail,
                                   const char* tail_name, int64_t vocab, int64_t hidden, int64_t& split) {
  if (grad_weight.dtype != LMLOSS_BF16 && grad_weight.dtype != LMLOSS_F16)
    return invalid(grad_name, std::string("dtype ") + dtype_name(grad_weight.dtype) +
                                  ": a kept f32 sum is for a bf16 or f16 grad_weight (an f32 one is the sum itself)");
  LMLOSS_CHECK(expect_dtype(tail, tail_name, LMLOSS_F32, LMLOSS_F32, "f32 (or u8 beside a bf16 grad_weight)"));
  const int64_t least = LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS(vocab);
  if (tail.ndim != 2 || tail.shape[1] != hidden || tail.shape[0] < vocab - vocab / 2 || tail.shape[0] > vocab)
    return invalid(tail_name, "expected shape (tail_rows, hidden = " + std::to_string(hidden) + ") with tail_rows in [" +
                                  std::to_string(vocab - vocab / 2) + ", vocab = " + std::to_string(vocab) + "] (" +
                                  std::to_string(least) + " at least as LMLOSS_GRAD_WEIGHT_SUM_TAIL_ROWS gives it), got " +
                                  shape_string(tail));
  split = vocab - tail.shape[0];
  if (split % 8 != 0)
    return invalid(tail_name, "vocab - tail_rows = " + std::to_string(split) +
                                  " rows held in grad_weight's bytes must be a multiple of 8");
  if (split > 0 && !weight_sum_fits_in_place(grad_weight, hidden))
    return invalid(grad_name, "holds rows of the f32 sum, so its rows must be dense (row stride = hidden) and its "
                              "data 16-byte aligned; a tail of vocab rows leaves its bytes alone");
  return LMLOSS_SUCCESS;
}

// Either form of a kept sum (see check_f32_weight_sum and core/weight_sum_rest.hpp), by the tail's
// dtype. Fills `split` (0 for rests: no rows of an f32 sum in grad_weight's bytes).
lmloss_status check_weight_sum(const lmloss_tensor& grad_weight, const char* grad_name, const lmloss_tensor& tail,
                               const char* tail_name, int64_t vocab, int64_t hidden, int64_t& split) {
  if (tail.dtype == LMLOSS_U8) {  // the sum as grad_weight's bf16 values and the tail's 8-bit rests
    if (grad_weight.dtype != LMLOSS_BF16)
      return invalid(grad_name, std::string("dtype ") + dtype_name(grad_weight.dtype) +
                                    ": a kept sum with a u8 tail of rests is for a bf16 grad_weight");
    if (tail.ndim != 2 || tail.shape[0] != vocab || tail.shape[1] != hidden)
      return invalid(tail_name, "a u8 tail holds the rest of every weight of the sum: expected shape (vocab = " +
                                    std::to_string(vocab) + ", hidden = " + std::to_string(hidden) + "), got " +
                                    shape_string(tail));
    split = 0;
  } else {
    LMLOSS_CHECK(check_f32_weight_sum(grad_weight, grad_name, tail, tail_name, vocab, hidden, split));
  }
  if (tail.device_type == grad_weight.device_type && tail.device_index == grad_weight.device_index &&
      share_bytes(tail, grad_weight))
    return invalid(tail_name, "overlaps grads.grad_weight");
  return LMLOSS_SUCCESS;
}

lmloss_status check_targets(const lmloss_targets& t, const lmloss_loss_options& o, LossCall& call) {
  LMLOSS_CHECK(check_tensor(t.labels, "targets.labels"));
  LMLOSS_CHECK(check_tensor(t.teacher_ids, "targets.teacher_ids"));
  LMLOSS_CHECK(check_tensor(t.teacher_probs, "targets.teacher_probs"));
  LMLOSS_CHECK(check_tensor(t.token_mask, "targets.token_mask"));
  const int64_t n = call.n_tokens;
  if (t.labels.data) {
    LMLOSS_CHECK(expect_shape(t.labels, "targets.labels", 1, n, 0, "(n_tokens)"));
    LMLOSS_CHECK(expect_dtype(t.labels, "targets.labels", LMLOSS_I32, LMLOSS_I64, "i32 or i64"));
  } else if (o.ce_weight != 0) {
    return invalid("targets.labels", "are missing but options.ce_weight is not 0");
  }
  if (t.token_mask.data) {
    LMLOSS_CHECK(expect_shape(t.token_mask, "targets.token_mask", 1, n, 0, "(n_tokens)"));
    LMLOSS_CHECK(expect_dtype(t.token_mask, "targets.token_mask", LMLOSS_U8, LMLOSS_U8, "u8"));
  }
  if (t.teacher_ids.data || t.teacher_probs.data) {
    if (!t.teacher_ids.data) return invalid("targets.teacher_ids", "are missing while teacher_probs are given");
    if (!t.teacher_probs.data) return invalid("targets.teacher_probs", "are missing while teacher_ids are given");
    if (t.teacher_ids.ndim != 2 || t.teacher_ids.shape[0] != n)
      return invalid("targets.teacher_ids", "expected shape (n_tokens, top_k), got " + shape_string(t.teacher_ids));
    const int64_t k = t.teacher_ids.shape[1];
    if (k < 1 || k > call.vocab)
      return invalid("targets.teacher_ids", "top_k " + std::to_string(k) + " must be in [1, vocab = " + std::to_string(call.vocab) + "]");
    LMLOSS_CHECK(expect_dtype(t.teacher_ids, "targets.teacher_ids", LMLOSS_I32, LMLOSS_I64, "i32 or i64"));
    LMLOSS_CHECK(expect_shape(t.teacher_probs, "targets.teacher_probs", 2, n, k, "(n_tokens, top_k) like targets.teacher_ids"));
    LMLOSS_CHECK(expect_dtype(t.teacher_probs, "targets.teacher_probs", call.compute_dtype, call.compute_dtype,
                              dtype_name(call.compute_dtype)));
    call.top_k = k;
  } else if (o.kd_weight != 0) {
    return invalid("targets.teacher_ids", "are missing but options.kd_weight is not 0");
  }
  call.targets = t;
  return LMLOSS_SUCCESS;
}

// A gradient tensor: the input's dtype or f32 (f64 inputs: f64).
lmloss_status check_grad(const lmloss_tensor& g, const char* name, int ndim, int64_t d0, int64_t d1,
                         const char* meaning, lmloss_dtype input, lmloss_dtype compute) {
  if (!g.data) return LMLOSS_SUCCESS;
  LMLOSS_CHECK(expect_shape(g, name, ndim, d0, d1, meaning));
  const std::string allowed = input == compute ? dtype_name(input) : std::string(dtype_name(input)) + " or " + dtype_name(compute);
  return expect_dtype(g, name, input, compute, allowed.c_str());
}

}  // namespace

lmloss_status validate_loss(Mode mode, const lmloss_head* head, const lmloss_targets* targets,
                            const lmloss_loss_options* options, const lmloss_tensor* loss,
                            const lmloss_tensor* lse, const lmloss_tensor* grad_loss,
                            const lmloss_grads* grads, LossCall& call) {
  if (!head) return invalid("head", "is NULL");
  if (!targets) return invalid("targets", "is NULL");
  if (!options) return invalid("options", "is NULL");
  call = LossCall{};
  call.mode = mode;
  LMLOSS_CHECK(read_options(*options, call.options));
  LMLOSS_CHECK(check_head(*head, call));
  LMLOSS_CHECK(check_targets(*targets, call.options, call));
  const int64_t n = call.n_tokens;
  const lmloss_dtype compute = call.compute_dtype;
  const bool per_token = options->reduction == LMLOSS_REDUCTION_NONE;
  const lmloss_tensor none = lmloss_tensor_none();

  if (mode != Mode::backward) {
    if (!loss || !loss->data) return invalid("loss", "is missing");
    LMLOSS_CHECK(check_tensor(*loss, "loss"));
    LMLOSS_CHECK(per_token ? expect_shape(*loss, "loss", 1, n, 0, "(n_tokens) for reduction none")
                           : expect_shape(*loss, "loss", 0, 0, 0, "() for reduction mean or sum"));
    LMLOSS_CHECK(expect_dtype(*loss, "loss", compute, compute, dtype_name(compute)));
    call.loss = *loss;
  } else {
    call.loss = none;
  }
  call.lse = lse ? *lse : none;
  if (mode == Mode::backward && !call.lse.data)
    return invalid("lse", "is missing: the backward recomputes from the forward's saved lse");
  if (call.lse.data) {
    LMLOSS_CHECK(check_tensor(call.lse, "lse"));
    LMLOSS_CHECK(expect_shape(call.lse, "lse", 1, n, 0, "(n_tokens)"));
    LMLOSS_CHECK(expect_dtype(call.lse, "lse", compute, compute, dtype_name(compute)));
  }
  call.grad_loss = (mode != Mode::forward && grad_loss) ? *grad_loss : none;
  if (call.grad_loss.data) {
    LMLOSS_CHECK(check_tensor(call.grad_loss, "grad_loss"));
    LMLOSS_CHECK(per_token ? expect_shape(call.grad_loss, "grad_loss", 1, n, 0, "(n_tokens) for reduction none")
                           : expect_shape(call.grad_loss, "grad_loss", 0, 0, 0, "() for reduction mean or sum"));
    LMLOSS_CHECK(expect_dtype(call.grad_loss, "grad_loss", compute, compute, dtype_name(compute)));
  }

  call.grads = lmloss_grads{none, none, none, none};
  if (mode != Mode::forward && grads) {
    const lmloss_grads& g = *grads;
    LMLOSS_CHECK(check_tensor(g.grad_logits, "grads.grad_logits"));
    LMLOSS_CHECK(check_tensor(g.grad_hidden, "grads.grad_hidden"));
    LMLOSS_CHECK(check_tensor(g.grad_weight, "grads.grad_weight"));
    LMLOSS_CHECK(check_tensor(g.grad_bias, "grads.grad_bias"));
    if (call.linear) {
      if (g.grad_logits.data) return invalid("grads.grad_logits", "only for logits inputs; a linear head gives grad_hidden, grad_weight, grad_bias");
      LMLOSS_CHECK(check_grad(g.grad_hidden, "grads.grad_hidden", 2, n, call.hidden, "(n_tokens, hidden)", call.input_dtype, compute));
      LMLOSS_CHECK(check_grad(g.grad_weight, "grads.grad_weight", 2, call.vocab, call.hidden, "(vocab, hidden)", call.input_dtype, compute));
      if (g.grad_bias.data && !head->bias.data) return invalid("grads.grad_bias", "is given but the head has no bias");
      LMLOSS_CHECK(check_grad(g.grad_bias, "grads.grad_bias", 1, call.vocab, 0, "(vocab)", call.input_dtype, compute));
    } else {
      if (g.grad_hidden.data || g.grad_weight.data || g.grad_bias.data)
        return invalid(g.grad_hidden.data ? "grads.grad_hidden" : g.grad_weight.data ? "grads.grad_weight" : "grads.grad_bias",
                       "only for a linear head; logits inputs give grad_logits");
      if (g.grad_logits.data) {
        LMLOSS_CHECK(expect_shape(g.grad_logits, "grads.grad_logits", 2, n, call.vocab, "(n_tokens, vocab) like head.logits"));
        LMLOSS_CHECK(expect_dtype(g.grad_logits, "grads.grad_logits", call.input_dtype, call.input_dtype, dtype_name(call.input_dtype)));
        if (g.grad_logits.data == head->logits.data) {
          if (row_stride(g.grad_logits) != row_stride(head->logits))
            return invalid("grads.grad_logits", "aliases head.logits with another row stride");
          call.in_place = true;
        }
      }
    }
    call.grads = g;
  }
  lmloss_tensor& sum_tail = call.options.grad_weight_sum_tail;
  if (call.grads.grad_weight.data && sum_tail.data) {
    LMLOSS_CHECK(check_weight_sum(call.grads.grad_weight, "grads.grad_weight", sum_tail, "options.grad_weight_sum_tail",
                                  call.vocab, call.hidden, call.weight_sum_split));
  } else if (sum_tail.data && mode != Mode::forward) {
    return invalid("options.grad_weight_sum_tail", "is given but grads.grad_weight is not");
  } else {
    sum_tail = none;  // a forward's options may be its backward's: the tail is not for it
  }
  lmloss_tensor& deferred = call.options.grad_weight_deferred;
  if (deferred.data) {
    if (mode != Mode::forward_backward || !sum_tail.data)
      return invalid("options.grad_weight_deferred", "is for a fused step with a kept sum (options.grad_weight_sum_tail)");
    LMLOSS_CHECK(check_deferred(deferred, "options.grad_weight_deferred"));
  }

  DeviceCheck device;
  LMLOSS_CHECK(device.add(call.head.logits, "head.logits"));
  LMLOSS_CHECK(device.add(call.head.hidden, "head.hidden"));
  LMLOSS_CHECK(device.add(call.head.weight, "head.weight"));
  LMLOSS_CHECK(device.add(call.head.bias, "head.bias"));
  LMLOSS_CHECK(device.add(call.targets.labels, "targets.labels"));
  LMLOSS_CHECK(device.add(call.targets.teacher_ids, "targets.teacher_ids"));
  LMLOSS_CHECK(device.add(call.targets.teacher_probs, "targets.teacher_probs"));
  LMLOSS_CHECK(device.add(call.targets.token_mask, "targets.token_mask"));
  LMLOSS_CHECK(device.add(call.loss, "loss"));
  LMLOSS_CHECK(device.add(call.lse, "lse"));
  LMLOSS_CHECK(device.add(call.grad_loss, "grad_loss"));
  LMLOSS_CHECK(device.add(call.grads.grad_logits, "grads.grad_logits"));
  LMLOSS_CHECK(device.add(call.grads.grad_hidden, "grads.grad_hidden"));
  LMLOSS_CHECK(device.add(call.grads.grad_weight, "grads.grad_weight"));
  LMLOSS_CHECK(device.add(sum_tail, "options.grad_weight_sum_tail"));
  LMLOSS_CHECK(device.add(deferred, "options.grad_weight_deferred"));
  LMLOSS_CHECK(device.add(call.grads.grad_bias, "grads.grad_bias"));
  const bool lse_is_input = mode == Mode::backward;
  const lmloss_tensor& lse_out = lse_is_input ? none : call.lse;
  const lmloss_tensor& lse_in = lse_is_input ? call.lse : none;
  const lmloss_grads& g = call.grads;
  LMLOSS_CHECK(check_no_overlap(
      {{&call.loss, "loss"}, {&lse_out, "lse"}, {&g.grad_logits, "grads.grad_logits"},
       {&g.grad_hidden, "grads.grad_hidden"}, {&g.grad_weight, "grads.grad_weight"},
       {&sum_tail, "options.grad_weight_sum_tail"}, {&deferred, "options.grad_weight_deferred"},
       {&g.grad_bias, "grads.grad_bias"}},
      {{&call.head.logits, "head.logits"}, {&call.head.hidden, "head.hidden"}, {&call.head.weight, "head.weight"},
       {&call.head.bias, "head.bias"}, {&call.targets.labels, "targets.labels"},
       {&call.targets.teacher_ids, "targets.teacher_ids"}, {&call.targets.teacher_probs, "targets.teacher_probs"},
       {&call.targets.token_mask, "targets.token_mask"}, {&lse_in, "lse"}, {&call.grad_loss, "grad_loss"}},
      {&g.grad_logits, &call.head.logits}, " (grads.grad_logits may be head.logits itself, for an in-place gradient)"));
  call.device_type = device.type;
  call.device_index = device.index;
  return LMLOSS_SUCCESS;
}

lmloss_status validate_topk(const lmloss_head* head, const lmloss_topk_options* options,
                            const lmloss_tensor* ids, const lmloss_tensor* probs,
                            const lmloss_tensor* tail, TopkCall& call) {
  if (!head) return invalid("head", "is NULL");
  if (!options) return invalid("options", "is NULL");
  call = TopkCall{};
  if (options->struct_size != sizeof(lmloss_topk_options))
    return invalid("options.struct_size", "must be sizeof(lmloss_topk_options); initialise with LMLOSS_TOPK_OPTIONS_INIT");
  LMLOSS_CHECK(check_head(*head, call));
  call.options = *options;
  if (call.vocab > INT32_MAX)
    return invalid(call.linear ? "head.weight" : "head.logits",
                   "vocabulary of " + std::to_string(call.vocab) + " entries: top-k's ids are i32, so at most 2^31 - 1");
  const int64_t k = options->k;
  if (k < 1 || k > call.vocab)
    return invalid("options.k", std::to_string(k) + " must be in [1, vocab = " + std::to_string(call.vocab) + "]");
  LMLOSS_CHECK(check_scaling(options->softcap, options->temperature, "options.softcap", "options.temperature"));
  if (options->renormalize != 0 && options->renormalize != 1) return invalid("options.renormalize", "must be 0 or 1");
  if (!ids || !ids->data) return invalid("ids", "is missing");
  if (!probs || !probs->data) return invalid("probs", "is missing");
  LMLOSS_CHECK(check_tensor(*ids, "ids"));
  LMLOSS_CHECK(check_tensor(*probs, "probs"));
  LMLOSS_CHECK(expect_shape(*ids, "ids", 2, call.n_tokens, k, "(n_tokens, k)"));
  LMLOSS_CHECK(expect_dtype(*ids, "ids", LMLOSS_I32, LMLOSS_I32, "i32"));
  LMLOSS_CHECK(expect_shape(*probs, "probs", 2, call.n_tokens, k, "(n_tokens, k)"));
  LMLOSS_CHECK(expect_dtype(*probs, "probs", call.compute_dtype, call.compute_dtype, dtype_name(call.compute_dtype)));
  call.ids = *ids;
  call.probs = *probs;
  call.tail = tail ? *tail : lmloss_tensor_none();
  if (call.tail.data) {
    LMLOSS_CHECK(check_tensor(call.tail, "tail"));
    LMLOSS_CHECK(expect_shape(call.tail, "tail", 1, call.n_tokens, 0, "(n_tokens)"));
    LMLOSS_CHECK(expect_dtype(call.tail, "tail", call.compute_dtype, call.compute_dtype, dtype_name(call.compute_dtype)));
  }
  DeviceCheck device;
  LMLOSS_CHECK(device.add(call.head.logits, "head.logits"));
  LMLOSS_CHECK(device.add(call.head.hidden, "head.hidden"));
  LMLOSS_CHECK(device.add(call.head.weight, "head.weight"));
  LMLOSS_CHECK(device.add(call.head.bias, "head.bias"));
  LMLOSS_CHECK(device.add(call.ids, "ids"));
  LMLOSS_CHECK(device.add(call.probs, "probs"));
  LMLOSS_CHECK(device.add(call.tail, "tail"));
  LMLOSS_CHECK(check_no_overlap({{&call.ids, "ids"}, {&call.probs, "probs"}, {&call.tail, "tail"}},
                                {{&call.head.logits, "head.logits"}, {&call.head.hidden, "head.hidden"},
                                 {&call.head.weight, "head.weight"}, {&call.head.bias, "head.bias"}}));
  call.device_type = device.type;
  call.device_index = device.index;
  return LMLOSS_SUCCESS;
}

lmloss_status validate_scale(const lmloss_tensor* grad, const lmloss_tensor* scale, const lmloss_tensor* out,
                             ScaleCall& call) {
  call = ScaleCall{};
  if (!grad || !grad->data) return invalid("grad", "is missing");
  if (!out || !out->data) return invalid("out", "is missing");
  LMLOSS_CHECK(check_tensor(*grad, "grad"));
  LMLOSS_CHECK(check_tensor(*out, "out"));
  if (!is_float(grad->dtype))
    return invalid("grad", std::string("dtype ") + dtype_name(grad->dtype) + " not allowed; expected a float dtype");
  for (const lmloss_tensor* t : {grad, out})
    if (t->ndim == 1 && t->stride > 1)
      return invalid(t == grad ? "grad" : "out", "a vector must be contiguous (stride 0 or 1)");
  if (!is_float(out->dtype))
    return invalid("out", std::string("dtype ") + dtype_name(out->dtype) + " not allowed; expected a float dtype");
  const int64_t rows = row_count(*grad), cols = row_length(*grad);
  const bool same_shape = out->ndim == grad->ndim && (grad->ndim < 1 || out->shape[0] == grad->shape[0]) &&
                          (grad->ndim < 2 || out->shape[1] == grad->shape[1]);
  if (!same_shape) return invalid("out", "expected grad's shape " + shape_string(*grad) + ", got " + shape_string(*out));
  if (out->data == grad->data && (out->dtype != grad->dtype || row_stride(*out) != row_stride(*grad)))
    return invalid("out", "shares grad's memory with another dtype or stride; only out = grad in place is allowed");
  call.grad = *grad;
  call.out = *out;
  // The product's dtype: f64 for an f64 grad, else f32 (a 16-bit grad is widened first).
  LMLOSS_CHECK(read_scale(scale, grad->dtype == LMLOSS_F64 ? LMLOSS_F64 : LMLOSS_F32, call.scale));
  DeviceCheck device;
  LMLOSS_CHECK(device.add(call.grad, "grad"));
  LMLOSS_CHECK(device.add(call.out, "out"));
  LMLOSS_CHECK(device.add(call.scale, "scale"));
  LMLOSS_CHECK(check_no_overlap({{&call.out, "out"}}, {{&call.grad, "grad"}, {&call.scale, "scale"}},
                                {&call.out, &call.grad}, " (out may be grad itself, in place)"));
  call.rows = rows;
  call.cols = cols;
  call.device_type = device.type;
  call.device_index = device.index;
  return LMLOSS_SUCCESS;
}

lmloss_status validate_round(const lmloss_tensor* grad_weight, const lmloss_tensor* tail, const lmloss_tensor* scale,
                             const lmloss_tensor* deferred, WeightSumCall& call) {
  call = WeightSumCall{};
  if (deferred) {
    if (!deferred->data) return invalid("deferred", "is missing");
    LMLOSS_CHECK(check_tensor(*deferred, "deferred"));
    LMLOSS_CHECK(check_deferred(*deferred, "deferred"));
    call.deferred = *deferred;
  }
  if (!grad_weight || !grad_weight->data) return invalid("grad_weight", "is missing");
  if (!tail || !tail->data) return invalid("tail", "is missing");
  LMLOSS_CHECK(check_tensor(*grad_weight, "grad_weight"));
  LMLOSS_CHECK(check_tensor(*tail, "tail"));
  if (grad_weight->ndim != 2 || grad_weight->shape[0] < 1 || grad_weight->shape[1] < 1)
    return invalid("grad_weight", "expected a shape (vocab, hidden) of at least one element, got " + shape_string(*grad_weight));
  call.vocab = grad_weight->shape[0];
  call.hidden = grad_weight->shape[1];
  LMLOSS_CHECK(check_weight_sum(*grad_weight, "grad_weight", *tail, "tail", call.vocab, call.hidden, call.split));
  call.grad_weight = *grad_weight;
  call.tail = *tail;
  LMLOSS_CHECK(read_scale(scale, LMLOSS_F32, call.scale));
  DeviceCheck device;
  LMLOSS_CHECK(device.add(call.grad_weight, "grad_weight"));
  LMLOSS_CHECK(device.add(call.tail, "tail"));
  LMLOSS_CHECK(device.add(call.scale, "scale"));
  LMLOSS_CHECK(device.add(call.deferred, "deferred"));
  LMLOSS_CHECK(check_no_overlap({{&call.grad_weight, "grad_weight"}, {&call.tail, "tail"}},
                                {{&call.scale, "scale"}, {&call.deferred, "deferred"}}));
  call.device_type = device.type;
  call.device_index = device.index;
  return LMLOSS_SUCCESS;
}

}  // namespace lmloss::core
