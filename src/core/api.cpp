// The C ABI: contexts, the error channel, and the public calls. Each call validates its
// arguments (core/validate.cpp), asks the backend of the tensors' device to check what only it
// can, and only then runs. No exception crosses this file's functions.
#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "core/backend.hpp"
#include "core/context.hpp"
#include "core/validate.hpp"

namespace lmloss::core {
namespace {

thread_local std::string last_error_message;

Backend* backend_for(lmloss_device_type type) {
  return type == LMLOSS_DEVICE_CUDA ? cuda_backend() : &cpu_backend();
}

lmloss_status choose_backend(lmloss_device_type type, Backend*& backend) {
  backend = backend_for(type);
  if (type == LMLOSS_DEVICE_CUDA && backend == nullptr)
    return fail(LMLOSS_ERROR_UNSUPPORTED, "tensors are on a CUDA device but this lmloss was built without CUDA");
  if (!backend->available())
    return fail(LMLOSS_ERROR_UNSUPPORTED, "tensors are on a CUDA device but no usable CUDA device, driver or cuBLASLt library was found");
  return LMLOSS_SUCCESS;
}

// Runs `body`, turning escaped exceptions into statuses.
template <typename Body>
lmloss_status guarded(Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return fail(LMLOSS_ERROR_OUT_OF_MEMORY, "host memory allocation failed");
  } catch (const std::exception& e) {
    return fail(LMLOSS_ERROR_INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return fail(LMLOSS_ERROR_INTERNAL, "internal error");
  }
}

// A call over no tokens computes nothing. A reduced loss is 0, as when every token is uncounted;
// the weight and bias gradients are 0 unless added to (a kept f32 sum, over grad_weight's bytes
// and the tail, is 0 as zero bytes too); the per-token outputs have no rows.
lmloss_status run_without_tokens(Backend& backend, lmloss_context& context, const LossCall& call) {
  const uint32_t flags = call.options.flags;
  if (call.mode != Mode::backward && call.options.reduction != LMLOSS_REDUCTION_NONE)
    LMLOSS_CHECK(backend.zero(context, call.loss));
  if (!call.wants_grads()) return LMLOSS_SUCCESS;
  const lmloss_grads& g = call.grads;
  if (g.grad_weight.data && !(flags & LMLOSS_ACCUMULATE_GRAD_WEIGHT)) {
    LMLOSS_CHECK(backend.zero(context, g.grad_weight));
    if (call.options.grad_weight_sum_tail.data) LMLOSS_CHECK(backend.zero(context, call.options.grad_weight_sum_tail));
  }
  if (g.grad_bias.data && !(flags & LMLOSS_ACCUMULATE_GRAD_BIAS)) LMLOSS_CHECK(backend.zero(context, g.grad_bias));
  return LMLOSS_SUCCESS;
}

lmloss_status run_loss(lmloss_context* context, Mode mode, const lmloss_head* head,
                       const lmloss_targets* targets, const lmloss_loss_options* options,
                       const lmloss_tensor* loss, const lmloss_tensor* lse,
                       const lmloss_tensor* grad_loss, const lmloss_grads* grads) {
  return guarded([&] {
    if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
    LossCall call;
    LMLOSS_CHECK(validate_loss(mode, head, targets, options, loss, lse, grad_loss, grads, call));
    Backend* backend = nullptr;
    LMLOSS_CHECK(choose_backend(call.device_type, backend));
    if (const lmloss_tensor& deferred = call.options.grad_weight_deferred; deferred.data) {
      size_t expected = 0;
      if (call.n_tokens > 0) LMLOSS_CHECK(backend->deferred_bytes(*context, call, expected));
      if (size_t(deferred.shape[0]) != expected)
        return fail(LMLOSS_ERROR_INVALID_ARGUMENT,
                    "options.grad_weight_deferred: has " + std::to_string(deferred.shape[0]) +
                        " bytes; lmloss_loss_deferred_bytes gives " + std::to_string(expected) + " for this call" +
                        (expected == 0 ? " (nothing is deferred: give none)" : ""));
    }
    if (call.n_tokens == 0) {
      LMLOSS_CHECK(run_without_tokens(*backend, *context, call));
      return succeed();
    }
    LMLOSS_CHECK(backend->check(*context, call));
    LMLOSS_CHECK(backend->run(*context, call));
    return succeed();
  });
}

lmloss_status round_weight_sum(lmloss_context* context, const lmloss_tensor* grad_weight, const lmloss_tensor* tail,
                               const lmloss_tensor* scale, const lmloss_tensor* deferred) {
  return guarded([&] {
    if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
    WeightSumCall call;
    LMLOSS_CHECK(validate_round(grad_weight, tail, scale, deferred, call));
    Backend* backend = nullptr;
    LMLOSS_CHECK(choose_backend(call.device_type, backend));
    LMLOSS_CHECK(backend->run(*context, call));
    return succeed();
  });
}

}  // namespace

lmloss_status fail(lmloss_status status, const std::string& message) {
  last_error_message = message;
  return status;
}

lmloss_status succeed() {
  last_error_message.clear();
  return LMLOSS_SUCCESS;
}

}  // namespace lmloss::core

using namespace lmloss::core;

extern "C" {

const char* lmloss_status_string(lmloss_status status) {
  switch (raw_enum(status)) {
    case LMLOSS_SUCCESS: return "success";
    case LMLOSS_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case LMLOSS_ERROR_UNSUPPORTED: return "unsupported";
    case LMLOSS_ERROR_OUT_OF_MEMORY: return "out of memory";
    case LMLOSS_ERROR_ID_OUT_OF_RANGE: return "label or teacher id out of range";
    case LMLOSS_ERROR_BACKEND: return "backend failure";
    case LMLOSS_ERROR_INTERNAL: return "internal error";
    default: return "unknown status";
  }
}

const char* lmloss_last_error(void) { return last_error_message.c_str(); }

int lmloss_version(void) {
  return LMLOSS_VERSION_MAJOR * 10000 + LMLOSS_VERSION_MINOR * 100 + LMLOSS_VERSION_PATCH;
}

lmloss_status lmloss_context_create(lmloss_context** context) {
  return guarded([&] {
    if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
    *context = new lmloss_context();
    return succeed();
  });
}

lmloss_status lmloss_context_destroy(lmloss_context* context) {
  return guarded([&] {
    delete context;
    return succeed();
  });
}

lmloss_status lmloss_context_set_workspace_budget(lmloss_context* context, size_t bytes) {
  if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
  if (bytes == 0) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "bytes: the workspace budget must be positive");
  context->workspace_budget = bytes;
  return succeed();
}

lmloss_status lmloss_context_get_workspace_budget(const lmloss_context* context, size_t* bytes) {
  if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
  if (!bytes) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "bytes: is NULL");
  *bytes = context->workspace_budget;
  return succeed();
}

lmloss_status lmloss_context_get_peak_workspace(const lmloss_context* context, size_t* bytes) {
  if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
  if (!bytes) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "bytes: is NULL");
  *bytes = context->workspace_peak;
  return succeed();
}

lmloss_status lmloss_context_reset_peak_workspace(lmloss_context* context) {
  if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
  context->workspace_peak = context->workspace_in_use;
  return succeed();
}

lmloss_status lmloss_context_set_num_threads(lmloss_context* context, int num_threads) {
  if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
  if (num_threads < 0) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "num_threads: must be >= 0 (0: all cores)");
  context->num_threads = num_threads;
  return succeed();
}

lmloss_status lmloss_context_set_product_tuning(lmloss_context* context, int enabled) {
  if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
  context->tune_products = enabled != 0;
  return succeed();
}

lmloss_status lmloss_context_set_stream(lmloss_context* context, void* stream) {
  if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
  context->stream = stream;
  return succeed();
}

lmloss_status lmloss_context_set_allocator(lmloss_context* context, const lmloss_allocator* allocator) {
  if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
  if (allocator && (!allocator->alloc || !allocator->free))
    return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "allocator: alloc and free must both be set");
  context->has_allocator = allocator != nullptr;
  context->allocator = allocator ? *allocator : lmloss_allocator{};
  return succeed();
}

lmloss_status lmloss_context_synchronize(lmloss_context* context) {
  return guarded([&] {
    if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
    Backend* cuda = cuda_backend();
    if (cuda && context->cuda_state) LMLOSS_CHECK(cuda->synchronize(*context));
    return succeed();
  });
}

int lmloss_backend_available(lmloss_device_type device_type) {
  const int64_t type = raw_enum(device_type);
  if (type == LMLOSS_DEVICE_CPU) return 1;
  if (type != LMLOSS_DEVICE_CUDA) return 0;
  Backend* cuda = cuda_backend();
  return cuda && cuda->available() ? 1 : 0;
}

lmloss_status lmloss_loss_forward(lmloss_context* context, const lmloss_head* head,
                                  const lmloss_targets* targets, const lmloss_loss_options* options,
                                  const lmloss_tensor* loss, const lmloss_tensor* lse) {
  return run_loss(context, Mode::forward, head, targets, options, loss, lse, nullptr, nullptr);
}

lmloss_status lmloss_loss_backward(lmloss_context* context, const lmloss_head* head,
                                   const lmloss_targets* targets, const lmloss_loss_options* options,
                                   const lmloss_tensor* lse, const lmloss_tensor* grad_loss,
                                   const lmloss_grads* grads) {
  return run_loss(context, Mode::backward, head, targets, options, nullptr, lse, grad_loss, grads);
}

lmloss_status lmloss_loss_forward_backward(lmloss_context* context, const lmloss_head* head,
                                           const lmloss_targets* targets,
                                           const lmloss_loss_options* options,
                                           const lmloss_tensor* grad_loss, const lmloss_tensor* loss,
                                           const lmloss_tensor* lse, const lmloss_grads* grads) {
  return run_loss(context, Mode::forward_backward, head, targets, options, loss, lse, grad_loss, grads);
}

lmloss_status lmloss_loss_deferred_bytes(lmloss_context* context, const lmloss_head* head,
                                         const lmloss_targets* targets, const lmloss_loss_options* options,
                                         const lmloss_tensor* grad_loss, const lmloss_tensor* loss,
                                         const lmloss_tensor* lse, const lmloss_grads* grads, size_t* bytes) {
  return guarded([&] {
    if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
    if (!bytes) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "bytes: is NULL");
    // The step's own arguments, as it will check them, without a buffer of its own yet.
    lmloss_loss_options unbuffered = lmloss_loss_options_default();
    if (options) {  // as far as the caller's struct_size reaches (validate_loss checks it)
      std::memcpy(static_cast<void*>(&unbuffered), options, std::min<size_t>(options->struct_size, sizeof(unbuffered)));
      unbuffered.grad_weight_deferred = {};
    }
    LossCall call;
    LMLOSS_CHECK(validate_loss(Mode::forward_backward, head, targets, options ? &unbuffered : nullptr, loss, lse,
                               grad_loss, grads, call));
    Backend* backend = nullptr;
    LMLOSS_CHECK(choose_backend(call.device_type, backend));
    size_t taken = 0;
    if (call.n_tokens > 0) LMLOSS_CHECK(backend->deferred_bytes(*context, call, taken));
    *bytes = taken;
    return succeed();
  });
}

lmloss_status lmloss_topk(lmloss_context* context, const lmloss_head* head,
                          const lmloss_topk_options* options, const lmloss_tensor* ids,
                          const lmloss_tensor* probs, const lmloss_tensor* tail) {
  return guarded([&] {
    if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
    TopkCall call;
    LMLOSS_CHECK(validate_topk(head, options, ids, probs, tail, call));
    Backend* backend = nullptr;
    LMLOSS_CHECK(choose_backend(call.device_type, backend));
    if (call.n_tokens == 0) return succeed();  // no rows to write
    LMLOSS_CHECK(backend->check(*context, call));
    LMLOSS_CHECK(backend->run(*context, call));
    return succeed();
  });
}

lmloss_status lmloss_scale_gradient(lmloss_context* context, const lmloss_tensor* grad,
                                    const lmloss_tensor* scale, const lmloss_tensor* out) {
  return guarded([&] {
    if (!context) return fail(LMLOSS_ERROR_INVALID_ARGUMENT, "context: is NULL");
    ScaleCall call;
    LMLOSS_CHECK(validate_scale(grad, scale, out, call));
    Backend* backend = nullptr;
    LMLOSS_CHECK(choose_backend(call.device_type, backend));
    LMLOSS_CHECK(backend->run(*context, call));
    return succeed();
  });
}

lmloss_status lmloss_round_grad_weight(lmloss_context* context, const lmloss_tensor* grad_weight,
                                       const lmloss_tensor* tail, const lmloss_tensor* scale) {
  return round_weight_sum(context, grad_weight, tail, scale, nullptr);
}

lmloss_status lmloss_round_grad_weight_deferred(lmloss_context* context, const lmloss_tensor* grad_weight,
                                                const lmloss_tensor* tail, const lmloss_tensor* scale,
                                                const lmloss_tensor* deferred) {
  static const lmloss_tensor missing{};  // a NULL deferred is reported as missing, not taken as none
  return round_weight_sum(context, grad_weight, tail, scale, deferred ? deferred : &missing);
}

}  // extern "C"
