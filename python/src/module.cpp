// _lmloss: the extension module behind the `lmloss` Python package. It binds the C++ API
// (lmloss/lmloss.hpp) and nothing below it.
//
// Arrays arrive as DLPack views (nb::ndarray) and are described to the library in place: no copy
// is ever made here, so an output array the Python layer allocated is written directly, and an
// input given as its own gradient buffer is overwritten in place. The Python layer shapes every
// array to the rank the C API wants (leading batch dimensions folded) and allocates the outputs
// in the caller's kind of array; this file only describes, dispatches and reports.
//
// One lmloss context per thread and device, cached here: a context is not thread-safe, and the
// CUDA backend keeps per-device state in it. Its settings (budget, CPU threads, product tuning)
// are the thread's own where it made them, else the latest made on any thread. On CUDA the
// Python layer passes the stream to run on (PyTorch's current one) and, when PyTorch is loaded,
// callbacks into its caching allocator for the workspace.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "lmloss/lmloss.hpp"

namespace nb = nanobind;

namespace {

// Raised for every failed library call; args = (status name, message). The Python layer maps it
// to ValueError, TypeError, MemoryError or RuntimeError, renaming the argument to its own.
PyObject* g_error_type = nullptr;

const char* status_name(lmloss_status status) {
  switch (status) {
    case LMLOSS_SUCCESS: return "success";
    case LMLOSS_ERROR_INVALID_ARGUMENT: return "invalid_argument";
    case LMLOSS_ERROR_UNSUPPORTED: return "unsupported";
    case LMLOSS_ERROR_OUT_OF_MEMORY: return "out_of_memory";
    case LMLOSS_ERROR_ID_OUT_OF_RANGE: return "id_out_of_range";
    case LMLOSS_ERROR_BACKEND: return "backend";
    case LMLOSS_ERROR_INTERNAL: return "internal";
    default: return "unknown";
  }
}

// Errors found here, before the library is called, use the same channel.
[[noreturn]] void raise(lmloss_status status, const std::string& message) {
  throw lmloss::Error(status, message);
}

bool interpreter_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// ---- Describing arrays ---------------------------------------------------------------------

lmloss_dtype dtype_from_dlpack(nb::dlpack::dtype dt, const char* name) {
  using code = nb::dlpack::dtype_code;
  if (dt.lanes == 1) {
    if (dt.code == uint8_t(code::Float)) {
      if (dt.bits == 32) return LMLOSS_F32;
      if (dt.bits == 16) return LMLOSS_F16;
      if (dt.bits == 64) return LMLOSS_F64;
    }
    if (dt.code == uint8_t(code::Bfloat) && dt.bits == 16) return LMLOSS_BF16;
    if (dt.code == uint8_t(code::Int)) {
      if (dt.bits == 32) return LMLOSS_I32;
      if (dt.bits == 64) return LMLOSS_I64;
    }
    if ((dt.code == uint8_t(code::UInt) || dt.code == uint8_t(code::Bool)) && dt.bits == 8)
      return LMLOSS_U8;
  }
  const char* kind = dt.code == uint8_t(code::Int)       ? "int"
                     : dt.code == uint8_t(code::UInt)    ? "uint"
                     : dt.code == uint8_t(code::Float)   ? "float"
                     : dt.code == uint8_t(code::Bfloat)  ? "bfloat"
                     : dt.code == uint8_t(code::Complex) ? "complex"
                     : dt.code == uint8_t(code::Bool)    ? "bool"
                                                         : nullptr;
  const std::string dtype = kind ? kind + std::to_string(dt.bits)
                                 : "(code " + std::to_string(dt.code) + ", " + std::to_string(dt.bits) + " bits)";
  raise(LMLOSS_ERROR_INVALID_ARGUMENT,
        std::string(name) + ": dtype " + dtype + (dt.lanes == 1 ? "" : " x" + std::to_string(dt.lanes)) +
            " is not supported");
}

// A view of one argument: absent for None. The array object stays referenced by `array` for the
// duration of the call, so the described memory cannot go away under the library.
struct View {
  nb::ndarray<nb::ro> array;
  lmloss::Tensor tensor;
};

View describe(nb::handle object, const char* name, bool writable = false) {
  View view;
  if (object.is_none()) return view;
  bool ok = false;
  if (writable) {
    nb::ndarray<> a;
    ok = nb::try_cast(object, a, /*convert=*/false);
    if (ok) view.array = nb::ndarray<nb::ro>(a);
  } else {
    ok = nb::try_cast(object, view.array, /*convert=*/false);
  }
  if (!ok)
    raise(LMLOSS_ERROR_INVALID_ARGUMENT,
          std::string(name) + (writable ? ": expected a writable array" : ": expected an array") +
              " that exports DLPack (NumPy, PyTorch, ...)");
  const auto& a = view.array;
  lmloss_tensor& t = view.tensor;
  t.data = const_cast<void*>(a.data());
  t.dtype = dtype_from_dlpack(a.dtype(), name);
  const size_t ndim = a.ndim();
  if (ndim > 2)
    raise(LMLOSS_ERROR_INVALID_ARGUMENT, std::string(name) + ": rank must be 0, 1 or 2, got " +
                                             std::to_string(ndim));
  t.ndim = int32_t(ndim);
  for (size_t d = 0; d < ndim; ++d) t.shape[d] = int64_t(a.shape(d));
  if (a.size() == 0) {
    // An array of no elements may have no address (PyTorch's) and any strides: nothing of it is
    // read or written, and the library takes a null address for an absent argument.
    static char no_elements;
    if (!t.data) t.data = &no_elements;
  } else {
    // The library wants the last dimension contiguous; the stride of a size-1 dimension is
    // meaningless, so it is not checked.
    if (ndim >= 1 && a.shape(ndim - 1) > 1 && a.stride(ndim - 1) != 1)
      raise(LMLOSS_ERROR_INVALID_ARGUMENT,
            std::string(name) + ": the last dimension must be contiguous (stride 1), got stride " +
                std::to_string(a.stride(ndim - 1)));
    t.stride = (ndim == 2 && a.shape(0) > 1) ? a.stride(0) : 0;
    if (ndim == 2 && a.shape(0) > 1 && a.stride(0) < int64_t(a.shape(1)))
      raise(LMLOSS_ERROR_INVALID_ARGUMENT,
            std::string(name) + ": rows overlap or run backwards (row stride " +
                std::to_string(a.stride(0)) + ")");
  }
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory: the CPU reads it directly
      t.device_type = LMLOSS_DEVICE_CPU;
      t.device_index = 0;
      break;
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      t.device_type = LMLOSS_DEVICE_CUDA;
      t.device_index = a.device_id();
      break;
    default:
      raise(LMLOSS_ERROR_UNSUPPORTED, std::string(name) + ": arrays on DLPack device type " +
                                          std::to_string(a.device_type()) + " are not supported");
  }
  return view;
}

// ---- Per-thread contexts and the Python-side allocator -------------------------------------

// Callbacks into Python for CUDA workspace (PyTorch's caching allocator). Holds its callables
// as raw references so that a context torn down after the interpreter leaks them instead of
// touching a dead interpreter.
struct PyAllocator {
  PyObject* alloc = nullptr;  // alloc(bytes, device, stream) -> int address (0: failure)
  PyObject* free = nullptr;   // free(address, bytes, device, stream)

  ~PyAllocator() {
    if ((alloc || free) && interpreter_alive()) {
      nb::gil_scoped_acquire gil;
      Py_XDECREF(alloc);
      Py_XDECREF(free);
    }
  }
  static void* alloc_fn(void* user, size_t bytes, int32_t device, void* stream) {
    auto* self = static_cast<PyAllocator*>(user);
    if (!interpreter_alive()) return nullptr;
    nb::gil_scoped_acquire gil;
    try {
      nb::object address = nb::borrow(self->alloc)(bytes, device, uintptr_t(stream));
      return reinterpret_cast<void*>(nb::cast<uintptr_t>(address));
    } catch (nb::python_error& e) {
      e.discard_as_unraisable("lmloss workspace allocation");
      return nullptr;
    } catch (...) {
      return nullptr;
    }
  }
  static void free_fn(void* user, void* ptr, size_t bytes, int32_t device, void* stream) {
    auto* self = static_cast<PyAllocator*>(user);
    // At interpreter exit the allocator's pool is gone with it: nothing to give back to.
    if (!interpreter_alive()) return;
    nb::gil_scoped_acquire gil;
    try {
      nb::borrow(self->free)(uintptr_t(ptr), bytes, device, uintptr_t(stream));
    } catch (nb::python_error& e) {
      e.discard_as_unraisable("lmloss workspace release");
    } catch (...) {
    }
  }
};

struct DeviceContext {
  // Declared first so it outlives the context, whose teardown may still free workspace into it.
  std::unique_ptr<PyAllocator> allocator;
  lmloss::Context context;
};

// The settings of a thread: the workspace budget (0: the library's default), CPU threads (-1:
// the library's default) and product tuning.
struct Settings {
  size_t workspace_budget = 0;
  int num_threads = -1;
  bool tune_products = false;
};

// A setting made on any thread is also the setting of every thread that has made none of that
// kind itself: PyTorch runs backward for CUDA tensors on threads of its own, and they should
// follow what the training thread set. Each change bumps the generation, which a thread compares
// on each call before it takes a context.
struct ProcessSettings {
  std::mutex mutex;
  Settings settings;
  std::atomic<uint64_t> generation{0};
};

ProcessSettings& process_settings() {
  static ProcessSettings shared;
  return shared;
}

struct ThreadState {
  std::map<int, std::unique_ptr<DeviceContext>> contexts;  // key: -1 for the CPU, else the ordinal
  Settings settings;                                       // in effect on this thread's contexts
  std::optional<size_t> own_workspace_budget;              // what this thread set itself
  std::optional<int> own_num_threads;
  std::optional<bool> own_tune_products;
  uint64_t generation = ~uint64_t(0);                      // of the process settings applied

  // A thread's contexts go with it (the main thread's are released at the interpreter's exit,
  // by the package). Once the interpreter has finalized the process is exiting, and they are
  // left to the exit instead: PyTorch's autograd threads (where backward calls the library on
  // CUDA) end during the process's static destruction, when the CUDA runtime and cuBLASLt that a
  // context's teardown calls may already be gone. The driver reclaims an exiting process's
  // memory, streams and handles.
  ~ThreadState() {
    if (interpreter_alive()) return;
    for (auto& [key, dc] : contexts) static_cast<void>(dc.release());
  }

  // Brings the settings in effect up to date: this thread's own where it made them, the process's
  // latest otherwise. The generation is taken last, so that a context that refused a setting is
  // asked again at the next call.
  void refresh() {
    ProcessSettings& shared = process_settings();
    if (shared.generation.load(std::memory_order_acquire) == generation) return;
    std::lock_guard<std::mutex> lock(shared.mutex);
    Settings next;
    next.workspace_budget = own_workspace_budget.value_or(shared.settings.workspace_budget);
    next.num_threads = own_num_threads.value_or(shared.settings.num_threads);
    next.tune_products = own_tune_products.value_or(shared.settings.tune_products);
    for (auto& [key, dc] : contexts) apply(dc->context, next, &settings);
    settings = next;
    generation = shared.generation.load(std::memory_order_relaxed);
  }

  // `to` on a context whose settings are `from` (null: a new context, at the library's defaults).
  static void apply(lmloss::Context& context, const Settings& to, const Settings* from) {
    const Settings defaults;
    if (!from) from = &defaults;
    if (to.workspace_budget != from->workspace_budget)
      context.set_workspace_budget(to.workspace_budget ? to.workspace_budget : LMLOSS_DEFAULT_WORKSPACE_BYTES);
    if (to.num_threads != from->num_threads) context.set_num_threads(to.num_threads >= 0 ? to.num_threads : 0);
    if (to.tune_products != from->tune_products) context.set_product_tuning(to.tune_products);
  }

  DeviceContext& get(int key) {
    refresh();
    auto& slot = contexts[key];
    if (!slot) {
      slot = std::make_unique<DeviceContext>();
      apply(slot->context, settings, nullptr);
    }
    return *slot;
  }
};

ThreadState& thread_state() {
  thread_local ThreadState state;
  return state;
}

// A setting made on the calling thread: the process's too, for the threads that make none; the
// calling thread's contexts take it now, the others' at their next call.
template <typename Edit>
void change_settings(Edit&& edit) {
  ProcessSettings& shared = process_settings();
  {
    std::lock_guard<std::mutex> lock(shared.mutex);
    edit(shared.settings);
    shared.generation.fetch_add(1, std::memory_order_release);
  }
  thread_state().refresh();
}

int device_key(const lmloss::Tensor& t) {
  return t.device_type == LMLOSS_DEVICE_CUDA ? int(t.device_index) : -1;
}

// The context for the call's device, set to run on `stream` and to take workspace from
// `allocator` (a pair of callables, or None). Once a context has a Python allocator it keeps
// it: workspace it may still cache was taken from that pool.
lmloss::Context& context_for(int key, uintptr_t stream, nb::handle allocator) {
  DeviceContext& dc = thread_state().get(key);
  if (key >= 0) {
    dc.context.set_stream(reinterpret_cast<void*>(stream));
    if (!allocator.is_none() && !dc.allocator) {
      auto pair = nb::cast<nb::tuple>(allocator);
      if (pair.size() != 2) raise(LMLOSS_ERROR_INVALID_ARGUMENT, "allocator: expected (alloc, free)");
      auto a = std::make_unique<PyAllocator>();
      a->alloc = pair[0].inc_ref().ptr();
      a->free = pair[1].inc_ref().ptr();
      lmloss_allocator callbacks{&PyAllocator::alloc_fn, &PyAllocator::free_fn, a.get()};
      dc.context.set_allocator(&callbacks);
      dc.allocator = std::move(a);
    }
  }
  return dc.context;
}

// The device of the call: that of its first present tensor (the library checks the rest).
int first_device_key(std::initializer_list<const lmloss::Tensor*> tensors) {
  for (const lmloss::Tensor* t : tensors)
    if (t->present()) return device_key(*t);
  return -1;
}

lmloss_reduction reduction_from(const std::string& name) {
  if (name == "mean") return LMLOSS_REDUCTION_MEAN;
  if (name == "sum") return LMLOSS_REDUCTION_SUM;
  if (name == "none") return LMLOSS_REDUCTION_NONE;
  raise(LMLOSS_ERROR_INVALID_ARGUMENT,
        "reduction: expected \"mean\", \"sum\" or \"none\", got \"" + name + "\"");
}

// ---- The calls -----------------------------------------------------------------------------

// mode: "forward", "backward" or "forward_backward". Absent arrays are None. grad_weight_deferred
// is an array, or for a fused step a callable that makes one: called with the bytes the step
// defers (lmloss_loss_deferred_bytes) where it defers any, so that the arrays are described once
// for both. Returns the array it made, else None.
nb::object loss_call(const std::string& mode, nb::handle logits, nb::handle hidden, nb::handle weight,
                     nb::handle bias, nb::handle labels, nb::handle teacher_ids,
                     nb::handle teacher_probs, nb::handle token_mask, const std::string& reduction,
                     int64_t ignore_index, double normalizer, double ce_weight, double kd_weight,
                     double label_smoothing, double z_loss, double softcap, double temperature,
                     bool accumulate_grad_weight, bool accumulate_grad_bias, nb::handle grad_weight_sum_tail,
                     nb::handle grad_weight_deferred, nb::handle grad_loss,
                     nb::handle loss, nb::handle lse, nb::handle grad_logits, nb::handle grad_hidden,
                     nb::handle grad_weight, nb::handle grad_bias, size_t extra_workspace, uintptr_t stream,
                     nb::handle allocator) {
  if (mode != "forward" && mode != "backward" && mode != "forward_backward")
    raise(LMLOSS_ERROR_INVALID_ARGUMENT, "mode: unknown \"" + mode + "\"");
  const bool make_deferred = mode == "forward_backward" && PyCallable_Check(grad_weight_deferred.ptr());
  lmloss::LossOptions options;
  options.reduction = reduction_from(reduction);
  options.ignore_index = ignore_index;
  options.normalizer = normalizer;
  options.ce_weight = ce_weight;
  options.kd_weight = kd_weight;
  options.label_smoothing = label_smoothing;
  options.z_loss = z_loss;
  options.softcap = softcap;
  options.temperature = temperature;
  options.flags = (accumulate_grad_weight ? LMLOSS_ACCUMULATE_GRAD_WEIGHT : 0u) |
                  (accumulate_grad_bias ? LMLOSS_ACCUMULATE_GRAD_BIAS : 0u);

  View v_logits = describe(logits, "logits"), v_hidden = describe(hidden, "hidden"),
       v_weight = describe(weight, "weight"), v_bias = describe(bias, "bias"),
       v_labels = describe(labels, "labels"), v_ids = describe(teacher_ids, "teacher_ids"),
       v_probs = describe(teacher_probs, "teacher_probs"),
       v_mask = describe(token_mask, "token_mask"), v_grad_loss = describe(grad_loss, "grad_loss");
  View v_loss = describe(loss, "loss", true), v_lse = describe(lse, "lse", mode != "backward"),
       v_g_logits = describe(grad_logits, "grad_logits", true),
       v_g_hidden = describe(grad_hidden, "grad_hidden", true),
       v_g_weight = describe(grad_weight, "grad_weight", true),
       v_g_bias = describe(grad_bias, "grad_bias", true),
       v_sum_tail = describe(grad_weight_sum_tail, "grad_weight_sum_tail", true),
       v_deferred = make_deferred ? View{} : describe(grad_weight_deferred, "grad_weight_deferred", true);
  options.grad_weight_sum_tail = v_sum_tail.tensor;
  options.grad_weight_deferred = v_deferred.tensor;

  const lmloss_head head{v_logits.tensor, v_hidden.tensor, v_weight.tensor, v_bias.tensor};
  const lmloss_targets targets{v_labels.tensor, v_ids.tensor, v_probs.tensor, v_mask.tensor};
  const lmloss_grads grads{v_g_logits.tensor, v_g_hidden.tensor, v_g_weight.tensor,
                           v_g_bias.tensor};
  const int key = first_device_key({&v_logits.tensor, &v_hidden.tensor});
  lmloss::Context& ctx = context_for(key, stream, allocator);
  // `extra_workspace` bytes beyond the thread's budget for this call alone (planned with them too).
  struct BudgetRaised {
    lmloss::Context& ctx;
    size_t budget;
    ~BudgetRaised() { ctx.set_workspace_budget(budget); }
  } raised{ctx, ctx.workspace_budget()};
  if (extra_workspace > 0) ctx.set_workspace_budget(raised.budget + extra_workspace);

  nb::object made = nb::none();
  if (make_deferred) {
    size_t bytes = 0;
    {
      nb::gil_scoped_release release;
      bytes = lmloss::loss_deferred_bytes(ctx, head, targets, options, v_grad_loss.tensor, v_loss.tensor,
                                          v_lse.tensor, grads);
    }
    if (bytes > 0) {
      made = nb::borrow(grad_weight_deferred)(bytes);
      v_deferred = describe(made, "grad_weight_deferred", true);
      options.grad_weight_deferred = v_deferred.tensor;
    }
  }

  // The arrays are held by the views above; the GIL is free for other Python threads while
  // the library works (an allocator callback takes it back).
  nb::gil_scoped_release release;
  if (mode == "forward") {
    lmloss::loss_forward(ctx, head, targets, options, v_loss.tensor, v_lse.tensor);
  } else if (mode == "backward") {
    lmloss::loss_backward(ctx, head, targets, options, v_lse.tensor, v_grad_loss.tensor, grads);
  } else {
    lmloss::loss_forward_backward(ctx, head, targets, options, v_grad_loss.tensor, v_loss.tensor,
                                  v_lse.tensor, grads);
  }
  return made;
}

void topk_call(nb::handle logits, nb::handle hidden, nb::handle weight, nb::handle bias,
               int64_t k, double softcap, double temperature, bool renormalize, nb::handle ids,
               nb::handle probs, nb::handle tail, uintptr_t stream, nb::handle allocator) {
  lmloss::TopkOptions options(k);
  options.softcap = softcap;
  options.temperature = temperature;
  options.renormalize = renormalize ? 1 : 0;
  View v_logits = describe(logits, "logits"), v_hidden = describe(hidden, "hidden"),
       v_weight = describe(weight, "weight"), v_bias = describe(bias, "bias");
  View v_ids = describe(ids, "ids", true), v_probs = describe(probs, "probs", true),
       v_tail = describe(tail, "tail", true);
  const lmloss_head head{v_logits.tensor, v_hidden.tensor, v_weight.tensor, v_bias.tensor};
  const int key = first_device_key({&v_logits.tensor, &v_hidden.tensor});
  lmloss::Context& ctx = context_for(key, stream, allocator);
  nb::gil_scoped_release release;
  lmloss::topk(ctx, head, options, v_ids.tensor, v_probs.tensor, v_tail.tensor);
}

void scale_gradient_call(nb::handle grad, nb::handle scale, nb::handle out, uintptr_t stream, nb::handle allocator) {
  View v_grad = describe(grad, "grad"), v_scale = describe(scale, "scale"), v_out = describe(out, "out", true);
  lmloss::Context& ctx = context_for(device_key(v_grad.tensor), stream, allocator);
  nb::gil_scoped_release release;
  lmloss::scale_gradient(ctx, v_grad.tensor, v_scale.tensor, v_out.tensor);
}

// With `deferred` (not None): lmloss_round_grad_weight_deferred.
void round_grad_weight_call(nb::handle grad_weight, nb::handle tail, nb::handle scale, nb::handle deferred,
                            uintptr_t stream, nb::handle allocator) {
  View v_grad = describe(grad_weight, "grad_weight", true), v_tail = describe(tail, "tail"),
       v_scale = describe(scale, "scale"), v_deferred = describe(deferred, "deferred");
  lmloss::Context& ctx = context_for(device_key(v_grad.tensor), stream, allocator);
  nb::gil_scoped_release release;
  if (v_deferred.tensor.data)
    lmloss::round_grad_weight_deferred(ctx, v_grad.tensor, v_tail.tensor, v_deferred.tensor, v_scale.tensor);
  else
    lmloss::round_grad_weight(ctx, v_grad.tensor, v_tail.tensor, v_scale.tensor);
}

}  // namespace

NB_MODULE(_lmloss, m) {
  m.doc() = "lmloss extension module; use the lmloss package, not this module.";

  g_error_type = PyErr_NewException("lmloss._lmloss.Error", PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(g_error_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const lmloss::Error& e) {
      nb::object args = nb::make_tuple(status_name(e.status()), e.what());
      PyErr_SetObject(g_error_type, args.ptr());
    }
  });

  m.def("loss", &loss_call, nb::arg("mode"), nb::kw_only(), nb::arg("logits").none() = nb::none(),
        nb::arg("hidden").none() = nb::none(), nb::arg("weight").none() = nb::none(), nb::arg("bias").none() = nb::none(),
        nb::arg("labels").none() = nb::none(), nb::arg("teacher_ids").none() = nb::none(), nb::arg("teacher_probs").none() = nb::none(),
        nb::arg("token_mask").none() = nb::none(), nb::arg("reduction"), nb::arg("ignore_index"),
        nb::arg("normalizer"), nb::arg("ce_weight"), nb::arg("kd_weight"),
        nb::arg("label_smoothing"), nb::arg("z_loss"), nb::arg("softcap"),
        nb::arg("temperature"), nb::arg("accumulate_grad_weight") = false,
        nb::arg("accumulate_grad_bias") = false, nb::arg("grad_weight_sum_tail").none() = nb::none(),
        nb::arg("grad_weight_deferred").none() = nb::none(), nb::arg("grad_loss").none() = nb::none(),
        nb::arg("loss").none() = nb::none(), nb::arg("lse").none() = nb::none(), nb::arg("grad_logits").none() = nb::none(),
        nb::arg("grad_hidden").none() = nb::none(), nb::arg("grad_weight").none() = nb::none(),
        nb::arg("grad_bias").none() = nb::none(), nb::arg("extra_workspace") = 0, nb::arg("stream") = 0,
        nb::arg("allocator").none() = nb::none());

  m.def("topk", &topk_call, nb::kw_only(), nb::arg("logits").none() = nb::none(), nb::arg("hidden").none() = nb::none(),
        nb::arg("weight").none() = nb::none(), nb::arg("bias").none() = nb::none(), nb::arg("k"), nb::arg("softcap"),
        nb::arg("temperature"), nb::arg("renormalize"), nb::arg("ids"), nb::arg("probs"),
        nb::arg("tail").none() = nb::none(), nb::arg("stream") = 0, nb::arg("allocator").none() = nb::none());

  m.def("scale_gradient", &scale_gradient_call, nb::kw_only(), nb::arg("grad"), nb::arg("scale").none() = nb::none(),
        nb::arg("out"), nb::arg("stream") = 0, nb::arg("allocator").none() = nb::none());

  m.def("round_grad_weight", &round_grad_weight_call, nb::kw_only(), nb::arg("grad_weight"), nb::arg("tail"),
        nb::arg("scale").none() = nb::none(), nb::arg("deferred").none() = nb::none(), nb::arg("stream") = 0,
        nb::arg("allocator").none() = nb::none());

  // Waits for the device's queued work of this thread's context and reports an id found out of
  // range there (device -1: the CPU, where ids are checked before anything is written).
  m.def("synchronize", [](int device, uintptr_t stream) {
    DeviceContext& dc = thread_state().get(device);
    if (device >= 0) dc.context.set_stream(reinterpret_cast<void*>(stream));
    nb::gil_scoped_release release;
    dc.context.synchronize();
  }, nb::arg("device"), nb::arg("stream") = 0);

  m.def("set_workspace_budget", [](size_t bytes) {
    if (bytes == 0) raise(LMLOSS_ERROR_INVALID_ARGUMENT, "bytes: the workspace budget must be positive");
    thread_state().own_workspace_budget = bytes;
    change_settings([&](Settings& s) { s.workspace_budget = bytes; });
  }, nb::arg("bytes"));
  m.def("workspace_budget", []() {
    return thread_state().get(-1).context.workspace_budget();
  });
  m.def("peak_workspace", [](int device) { return thread_state().get(device).context.peak_workspace(); },
        nb::arg("device") = -1);
  m.def("reset_peak_workspace", [](int device) { thread_state().get(device).context.reset_peak_workspace(); },
        nb::arg("device") = -1);
  m.def("set_num_threads", [](int n) {
    if (n < 0) raise(LMLOSS_ERROR_INVALID_ARGUMENT, "num_threads: must be >= 0 (0: all cores)");
    thread_state().own_num_threads = n;
    change_settings([&](Settings& s) { s.num_threads = n; });
  }, nb::arg("num_threads"));
  m.def("set_product_tuning", [](bool enabled) {
    thread_state().own_tune_products = enabled;
    change_settings([&](Settings& s) { s.tune_products = enabled; });
  }, nb::arg("enabled"));
  m.def("backend_available", [](const std::string& device) {
    if (device == "cpu") return lmloss::backend_available(LMLOSS_DEVICE_CPU);
    if (device == "cuda") return lmloss::backend_available(LMLOSS_DEVICE_CUDA);
    raise(LMLOSS_ERROR_INVALID_ARGUMENT, "device: expected \"cpu\" or \"cuda\", got \"" + device + "\"");
  }, nb::arg("device"));
  m.def("version", []() {
    const int v = lmloss_version();
    return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
           std::to_string(v % 100);
  });
  // Drops this thread's contexts while the interpreter is alive (called at exit): a context
  // holding PyTorch workspace must give it back before PyTorch is gone.
  m.def("release_thread_state", []() { thread_state().contexts.clear(); });
}
