// The CPU backend: every loss and the teacher top-k, a chunk of token rows at a time.
//
// For each chunk of R rows (R from the workspace budget):
//   Z (R, vocab)   = X_chunk W^T + b      BLAS, or the caller's logits converted to the compute type
//   row pass       max, lse, loss and dL/dz, in place over Z (one row per thread, row_math.hpp)
//   dX_chunk       = dZ W                 BLAS
//   dW            += dZ^T X_chunk         BLAS, accumulated over chunks in the compute type
//   db            += column sums of dZ    fixed order, so results are deterministic
// The full (n_tokens, vocab) logits never exist. bf16/f16 inputs are converted to f32 a chunk (and
// a vocabulary slice of W) at a time; when all of W fits in a quarter of the budget it is
// converted once per call.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.hpp"
#include "core/context.hpp"
#include "core/dtype.hpp"
#include "core/row_math.hpp"
#include "core/weight_sum_rest.hpp"
#include "cpu/blas.hpp"
#include "cpu/row_loops.hpp"
#include "cpu/vector_exp.hpp"

namespace lmloss::cpu {
namespace {

using core::LossCall;
using core::Mode;
using core::TopkCall;
using core::ScaleCall;
using core::WeightSumCall;

// Host blocks the context keeps between calls. A call's pieces go back to the pool, so the next
// call of the same shape reuses memory already mapped: fresh pages cost a fault and a zeroing
// each, which was ~0.1x of the products for the small bench problem in bf16. What the pool holds
// stays within the budget: a piece reuses only a block of its own size (a larger one would hold
// bytes the call's plan did not count, and a call of another shape could then pass the budget by
// them), and blocks no call is using are dropped before the pool would grow past the budget, or
// when it holds more than a budget since lowered.
class HostPool final : public core::BackendState {
 public:
  void* acquire(size_t bytes, size_t budget) {
    if (held() > budget) drop_unused();
    Block* same = nullptr;
    for (Block& b : blocks_)
      if (!b.in_use && b.bytes == bytes) same = &b;
    if (!same) {
      if (held() + bytes > budget) drop_unused();
      blocks_.push_back(Block{static_cast<std::byte*>(::operator new(bytes, std::align_val_t(64))), bytes, false});
      same = &blocks_.back();
    }
    same->in_use = true;
    return same->data;
  }
  void release(void* data) {
    for (Block& b : blocks_)
      if (b.data == data) b.in_use = false;
  }
  ~HostPool() override {
    for (Block& b : blocks_) ::operator delete(b.data, std::align_val_t(64));
  }

 private:
  struct Block {
    std::byte* data;
    size_t bytes;
    bool in_use;
  };
  size_t held() const {
    size_t total = 0;
    for (const Block& b : blocks_) total += b.bytes;
    return total;
  }
  void drop_unused() {
    std::vector<Block> kept;
    for (Block& b : blocks_) {
      if (b.in_use) kept.push_back(b);
      else ::operator delete(b.data, std::align_val_t(64));
    }
    blocks_ = std::move(kept);
  }
  std::vector<Block> blocks_;
};

HostPool& host_pool(lmloss_context& context) {
  if (!context.cpu_state) context.cpu_state = std::make_unique<HostPool>();
  return static_cast<HostPool&>(*context.cpu_state);
}

// Host memory from the context's pool, counted against its workspace.
template <typename T>
class Workspace {
 public:
  Workspace() = default;
  Workspace(lmloss_context& context, size_t count) : context_(&context), bytes_(count * sizeof(T)) {
    if (bytes_ == 0) return;
    data_ = static_cast<T*>(host_pool(context).acquire(bytes_, context.workspace_budget));
    core::note_workspace_acquired(context, bytes_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Workspace& operator=(Workspace&& other) noexcept {
    release();
    context_ = other.context_;
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    return *this;
  }
  ~Workspace() { release(); }
  T* get() const { return data_; }

 private:
  void release() {
    if (data_) {
      host_pool(*context_).release(data_);
      core::note_workspace_released(*context_, bytes_);
    }
    data_ = nullptr;
    bytes_ = 0;
  }
  lmloss_context* context_ = nullptr;
  T* data_ = nullptr;
  size_t bytes_ = 0;
};

int thread_count(const lmloss_context& context) {
  return context.num_threads > 0 ? context.num_threads : omp_get_max_threads();
}

// Whether a tensor can be used by BLAS in place as a matrix of C.
template <typename C>
bool is_compute_type(const lmloss_tensor& t) {
  return t.dtype == (sizeof(C) == 8 ? LMLOSS_F64 : LMLOSS_F32);
}

// ---- Planning ------------------------------------------------------------------------------

// Workspace of one call: what is held for the whole call, and what each chunk row adds.
struct Plan {
  size_t fixed_bytes = 0;
  size_t bytes_per_row = 0;
  int64_t chunk_rows = 0;
  int64_t weight_slice = 0;     // vocabulary rows of W converted at a time (linear, non-C inputs)
  bool weight_converted_once = false;
};

template <typename C>
Plan plan_head(size_t budget, bool linear, int64_t n_tokens, int64_t vocab, int64_t hidden, lmloss_dtype input_dtype,
               size_t extra_fixed, size_t extra_per_row) {
  Plan plan;
  const size_t s = sizeof(C);
  const bool convert = input_dtype != (s == 8 ? LMLOSS_F64 : LMLOSS_F32);
  plan.bytes_per_row = size_t(vocab) * s + extra_per_row;
  plan.fixed_bytes = extra_fixed;
  if (linear) {
    plan.fixed_bytes += size_t(vocab) * s;  // bias in the compute type (counted even when absent)
    if (convert) {
      plan.bytes_per_row += size_t(hidden) * s;  // the chunk of X, converted
      const size_t whole_weight = size_t(vocab) * size_t(hidden) * s;
      if (whole_weight <= budget / 4) {
        plan.weight_slice = vocab;
        plan.weight_converted_once = true;
      } else {
        plan.weight_slice = std::max<int64_t>(1, int64_t(budget / 8 / (size_t(hidden) * s)));
        plan.weight_slice = std::min(plan.weight_slice, vocab);
      }
      plan.fixed_bytes += size_t(plan.weight_slice) * size_t(hidden) * s;
    } else {
      plan.weight_slice = vocab;
    }
  }
  // The BLAS takes its sizes as 32-bit ints (OpenBLAS's blasint): a chunk of rows stays below 2^31.
  plan.chunk_rows = std::min<int64_t>(core::plan_chunk_rows(budget, plan.fixed_bytes, plan.bytes_per_row, n_tokens),
                                      std::numeric_limits<int32_t>::max());
  return plan;
}

// The budget above `refused` from which `plan_for(budget)` holds a row, one byte less holding none.
// Not the refused plan's own fixed + per-row bytes: W's slices, held throughout, grow with the budget.
template <typename PlanFor>
size_t least_budget(const PlanFor& plan_for, size_t refused) {
  size_t low = refused, high = refused;
  for (;;) {  // doubling up to a budget that holds a row
    if (high > std::numeric_limits<size_t>::max() / 2) return std::numeric_limits<size_t>::max();
    high = std::max<size_t>(2 * high, 64);
    if (plan_for(high).chunk_rows != 0) break;
    low = high;
  }
  while (high - low > 1) {  // plan_for(low) holds no row, plan_for(high) does
    const size_t middle = low + (high - low) / 2;
    (plan_for(middle).chunk_rows == 0 ? low : high) = middle;
  }
  return high;
}

// `held_for`: what, besides the logits, the call holds throughout (named when it is most of it).
lmloss_status budget_error(const lmloss_context& context, size_t least, const std::string& held_for = "") {
  return core::fail(LMLOSS_ERROR_INVALID_ARGUMENT,
                    "context workspace budget: " + std::to_string(context.workspace_budget) +
                        " bytes hold not even one row of logits; this problem needs at least " + std::to_string(least) +
                        " bytes" + held_for);
}

// Workspace bytes a call holds for a 16-bit dW's f32 sum beyond grad_weight's own bytes: its rows
// from core::weight_sum_rows_in_place on, unless the caller keeps them (grad_weight_sum_tail).
size_t own_weight_sum_bytes(const LossCall& call) {
  const lmloss_tensor& gw = call.grads.grad_weight;
  if (!call.wants_grads() || !gw.data || gw.dtype == call.compute_dtype || call.options.grad_weight_sum_tail.data)
    return 0;
  return size_t(call.vocab - core::weight_sum_rows_in_place(gw, call.vocab, call.hidden)) * size_t(call.hidden) *
         sizeof(float);
}

// A kept sum of bf16 values and 8-bit rests (core/weight_sum_rest.hpp) takes each chunk's dW
// product a slice of this many vocabulary rows at a time, in f32, then folds it into the pair.
constexpr int64_t kRestSliceRows = 256;

size_t rest_slice_bytes(const LossCall& call) {
  if (!call.wants_grads() || !call.grads.grad_weight.data || !core::weight_sum_keeps_rests(call.options.grad_weight_sum_tail))
    return 0;
  return size_t(std::min(call.vocab, kRestSliceRows)) * size_t(call.hidden) * sizeof(float);
}

// Rows [0, count) of a slice of dW's product (f32, dense) into the kept pair's rows there: s =
// product (+ the pair's value when adding), stored as bf16(s) and its rest.
void fold_into_rests(const float* product, int64_t count, int64_t hidden, bool add, void* values, int64_t values_ld,
                     uint8_t* rests, int64_t rests_ld, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < count; ++r) {
    auto* hi = static_cast<uint16_t*>(values) + r * values_ld;
    auto* rest = reinterpret_cast<int8_t*>(rests + r * rests_ld);
    for (int64_t j = 0; j < hidden; ++j) {
      float sum = product[r * hidden + j];
      if (add) sum += core::rest_join(core::rest_bf16_value(hi[j]), rest[j]);
      const core::RestPair pair = core::rest_split(sum);
      hi[j] = pair.hi;
      rest[j] = pair.rest;
    }
  }
}

// grad_weight = round(sum * scale), the sum's rows [0, split) over grad_weight's own bytes and
// the rest in the tail. Row u's 16-bit values go over f32 row u / 2, so rows [a, 2a) can be
// narrowed together once rows below a are (row 0, whose values go over its own, through a copy).
void round_weight_sum(const WeightSumCall& call, int threads) {
  const float scale = call.scale.data ? *static_cast<const float*>(call.scale.data) : 1.0f;
  const int64_t hidden = call.hidden;
  const lmloss_tensor& out = call.grad_weight;
  if (core::weight_sum_keeps_rests(call.tail)) {  // bf16(scale * (value + rest)), in place
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < call.vocab; ++r) {
      auto* hi = static_cast<uint16_t*>(core::row_ptr_mut(out, r));
      const auto* rest = static_cast<const int8_t*>(core::row_ptr(call.tail, r));
      for (int64_t j = 0; j < hidden; ++j)
        hi[j] = core::rest_bf16_bits(scale * core::rest_join(core::rest_bf16_value(hi[j]), rest[j]));
    }
    return;
  }
  auto* bytes = static_cast<char*>(out.data);
  auto narrow = [&](const float* in, int64_t row) {
    void* dst = core::row_ptr_mut(out, row);
    for (int64_t j = 0; j < hidden; ++j) core::store_float<float>(dst, out.dtype, j, in[j] * scale);
  };
  if (call.split > 0) {
    std::vector<float> first(reinterpret_cast<const float*>(bytes), reinterpret_cast<const float*>(bytes) + hidden);
    narrow(first.data(), 0);
  }
  for (int64_t a = 1; a < call.split; a *= 2) {
    const int64_t b = std::min(2 * a, call.split);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = a; r < b; ++r) narrow(reinterpret_cast<const float*>(bytes + r * hidden * int64_t(sizeof(float))), r);
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = call.split; r < call.vocab; ++r)
    narrow(static_cast<const float*>(core::row_ptr(call.tail, r - call.split)), r);
}

// The caller's 16-bit grad_weight as the start of its f32 sum (an added-to call): the rows from
// split into the tail, then the rows in place widened over their own bytes, downwards. f32 row u
// goes over 16-bit rows 2u and 2u + 1, which the tail or a higher wave has read by then, so rows
// [a, 2a) widen together (row 0, whose values its own f32 values go over, through a copy).
void widen_weight_sum(const lmloss_tensor& grad_weight, int64_t split, int64_t vocab, int64_t hidden,
                      const lmloss_tensor& tail, int threads) {
  auto widen = [&](const void* in, float* out) {
    for (int64_t j = 0; j < hidden; ++j) out[j] = core::load_float<float>(in, grad_weight.dtype, j);
  };
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = split; r < vocab; ++r)
    widen(core::row_ptr(grad_weight, r), static_cast<float*>(core::row_ptr_mut(tail, r - split)));
  auto* wide = static_cast<float*>(grad_weight.data);
  int64_t a = 1;
  while (2 * a < split) a *= 2;
  for (; a >= 1 && split > 1; a /= 2) {
    const int64_t b = std::min(2 * a, split);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = a; r < b; ++r) widen(core::row_ptr(grad_weight, r), wide + r * hidden);
  }
  if (split > 0) {
    std::vector<float> first(static_cast<size_t>(hidden));
    widen(grad_weight.data, first.data());
    std::copy(first.begin(), first.end(), wide);
  }
}

// ---- Producing a chunk of logits -----------------------------------------------------------

// Forms Z (rows, vocab) of type C for token rows [row0, row0 + rows): the caller's logits
// converted, or X W^T + b. For linear heads it also exposes the chunk of X and W's slices for the
// backward products.
template <typename C>
class LogitsChunks {
 public:
  LogitsChunks(lmloss_context& context, const lmloss_head& head, bool linear, int64_t vocab,
               int64_t hidden, const Plan& plan)
      : context_(context), head_(head), linear_(linear), vocab_(vocab), hidden_(hidden), plan_(plan) {
    convert_ = !is_compute_type<C>(linear ? head.hidden : head.logits);
    if (linear) {
      if (head.bias.data) {
        bias_ = Workspace<C>(context, size_t(vocab));
        for (int64_t j = 0; j < vocab; ++j)
          bias_.get()[j] = core::load_float<C>(head.bias.data, head.bias.dtype, j * core::row_stride(head.bias));
      }
      if (convert_) {
        weight_ = Workspace<C>(context, size_t(plan.weight_slice) * size_t(hidden));
        x_ = Workspace<C>(context, size_t(plan.chunk_rows) * size_t(hidden));
        if (plan.weight_converted_once) convert_weight_slice(0, vocab);
      }
    }
  }

  // Z rows of this chunk, before the bias and the scaling (finish_row).
  void produce(int64_t row0, int64_t rows, C* z, int threads) {
    if (!linear_) {
      const lmloss_tensor& logits = head_.logits;
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t i = 0; i < rows; ++i) {
        const void* src = core::row_ptr(logits, row0 + i);
        C* dst = z + i * vocab_;
        load_row(src, logits.dtype, dst, vocab_);
      }
      return;
    }
    load_x(row0, rows, threads);
    for (int64_t v0 = 0; v0 < vocab_; v0 += plan_.weight_slice) {
      const int64_t vs = std::min(plan_.weight_slice, vocab_ - v0);
      const C* w = weight_slice(v0, vs);
      gemm(false, true, rows, vs, hidden_, C(1), x_rows(), x_stride(), w, weight_stride(), C(0), z + v0, vocab_);
    }
  }

  // One row of Z as the losses and top-k read it: bias added, soft-capped, divided by T. Done per
  // row, while the row is in cache, rather than as a pass of its own over the chunk.
  void finish_row(C* z, const core::LogitScale<C>& scale, bool scaled) const {
    const C* bias = head_.bias.data ? bias_.get() : nullptr;
    if (bias && scaled) {
      for (int64_t j = 0; j < vocab_; ++j) z[j] = scale.apply(z[j] + bias[j]);
    } else if (bias) {
      for (int64_t j = 0; j < vocab_; ++j) z[j] += bias[j];
    } else if (scaled) {
      for (int64_t j = 0; j < vocab_; ++j) z[j] = scale.apply(z[j]);
    }
  }

  // dX (rows, hidden) = dZ W for the chunk last produced, into `dx` (leading dimension ldx).
  void grad_hidden(int64_t rows, const C* dz, C* dx, int64_t ldx) {
    for (int64_t v0 = 0; v0 < vocab_; v0 += plan_.weight_slice) {
      const int64_t vs = std::min(plan_.weight_slice, vocab_ - v0);
      const C* w = weight_slice(v0, vs);
      gemm(false, false, rows, hidden_, vs, C(1), dz + v0, vocab_, w, weight_stride(), v0 == 0 ? C(0) : C(1), dx, ldx);
    }
  }

  // dW (vocab, hidden) = beta dW + dZ^T X for the chunk last produced.
  void grad_weight(int64_t rows, const C* dz, C beta, C* dw, int64_t ldw) {
    grad_weight_rows(0, vocab_, rows, dz, beta, dw, ldw);
  }
  // dW's rows [v0, v1) only, from the gradient's columns [v0, v1).
  void grad_weight_rows(int64_t v0, int64_t v1, int64_t rows, const C* dz, C beta, C* dw, int64_t ldw) {
    if (v1 > v0) gemm(true, false, v1 - v0, hidden_, rows, C(1), dz + v0, vocab_, x_rows(), x_stride(), beta, dw, ldw);
  }

 private:
  void load_x(int64_t row0, int64_t rows, int threads) {
    row0_ = row0;
    if (!convert_) return;
    const lmloss_tensor& x = head_.hidden;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const void* src = core::row_ptr(x, row0 + i);
      load_row(src, x.dtype, x_.get() + i * hidden_, hidden_);
    }
  }
  const C* x_rows() const {
    return convert_ ? x_.get() : static_cast<const C*>(core::row_ptr(head_.hidden, row0_));
  }
  int64_t x_stride() const { return convert_ ? hidden_ : core::row_stride(head_.hidden); }
  int64_t weight_stride() const { return convert_ ? hidden_ : core::row_stride(head_.weight); }

  const C* weight_slice(int64_t v0, int64_t vs) {
    if (!convert_) return static_cast<const C*>(core::row_ptr(head_.weight, v0));
    if (plan_.weight_converted_once) return weight_.get() + v0 * hidden_;
    convert_weight_slice(v0, vs);
    return weight_.get();
  }
  void convert_weight_slice(int64_t v0, int64_t vs) {
    const lmloss_tensor& w = head_.weight;
    const int threads = thread_count(context_);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t v = 0; v < vs; ++v) {
      const void* src = core::row_ptr(w, v0 + v);
      load_row(src, w.dtype, weight_.get() + v * hidden_, hidden_);
    }
  }

  lmloss_context& context_;
  const lmloss_head& head_;
  bool linear_;
  int64_t vocab_, hidden_;
  Plan plan_;
  bool convert_ = false;
  int64_t row0_ = 0;
  Workspace<C> bias_, weight_, x_;
};

// ---- The loss ------------------------------------------------------------------------------

int64_t label_of(const LossCall& call, int64_t t) {
  return core::load_index(call.targets.labels.data, call.targets.labels.dtype, t * core::row_stride(call.targets.labels));
}

// Which tokens count: not ignore_index, mask true.
bool counted(const LossCall& call, int64_t t) {
  if (call.has_labels() && label_of(call, t) == call.options.ignore_index) return false;
  if (call.has_mask() && static_cast<const uint8_t*>(call.targets.token_mask.data)[t * core::row_stride(call.targets.token_mask)] == 0)
    return false;
  return true;
}

int64_t teacher_id(const LossCall& call, int64_t t, int64_t k) {
  return core::load_index(core::row_ptr(call.targets.teacher_ids, t), call.targets.teacher_ids.dtype, k);
}

template <typename C>
C teacher_prob(const LossCall& call, int64_t t, int64_t k) {
  return static_cast<const C*>(core::row_ptr(call.targets.teacher_probs, t))[k];
}

// Token t's upstream gradient: grad_loss[t] for reduction none, else its one element (a scalar
// may come as shape () or (1)), 1 without it.
template <typename C>
C upstream_of(const LossCall& call, int64_t t) {
  const lmloss_tensor& g = call.grad_loss;
  if (!g.data) return C(1);
  const bool per_token = call.options.reduction == LMLOSS_REDUCTION_NONE;
  return static_cast<const C*>(g.data)[per_token ? t * core::row_stride(g) : 0];
}

// Row sums run in double: a vocabulary of 10^5 terms summed in f32 drifts past the f32 tolerance.
using Accumulator = double;

template <typename C>
class LossRunner {
 public:
  LossRunner(lmloss_context& context, const LossCall& call, const Plan& plan)
      : context_(context), call_(call), plan_(plan), threads_(thread_count(context)),
        scale_(core::LogitScale<C>::make(call.options.softcap, call.options.temperature)),
        weights_(core::LossWeights<C>::make(call.options.ce_weight, call.options.kd_weight,
                                            call.options.label_smoothing, call.options.z_loss, call.vocab)) {}

  lmloss_status run() {
    const LossCall& call = call_;
    const int64_t n = call.n_tokens, vocab = call.vocab, hidden = call.hidden;
    const bool wants_grads = call.wants_grads();
    const lmloss_grads& g = call.grads;
    const bool mean = call.options.reduction == LMLOSS_REDUCTION_MEAN;

    // D, and the gradient scale per token, before anything is formed.
    int64_t n_counted = 0;
    for (int64_t t = 0; t < n; ++t) n_counted += counted(call, t) ? 1 : 0;
    const double divisor = call.options.normalizer > 0 ? call.options.normalizer : double(n_counted);
    inv_divisor_ = mean ? (divisor > 0 ? 1.0 / divisor : 0.0) : 1.0;

    LogitsChunks<C> chunks(context_, call.head, call.linear, vocab, hidden, plan_);
    Workspace<C> z(context_, size_t(plan_.chunk_rows) * size_t(vocab));
    Workspace<C> row_loss(context_, size_t(plan_.chunk_rows));
    Workspace<C> scratch(context_, size_t(threads_) * size_t(call.top_k + 1));
    // Gradient buffers in the compute type, where the caller's are of another dtype.
    const bool dx_direct = g.grad_hidden.data && is_compute_type<C>(g.grad_hidden);
    const bool dw_direct = g.grad_weight.data && is_compute_type<C>(g.grad_weight);
    // A 16-bit dW's f32 sum: rows [0, split) over grad_weight's own bytes, the rest in a tail, the
    // caller's (options.grad_weight_sum_tail: kept, left unrounded) or the call's own (rounded once
    // at the end; the caller's values widened first when the call adds to them).
    const bool dw_sum = wants_grads && g.grad_weight.data && !dw_direct;
    const bool dw_kept = dw_sum && call.options.grad_weight_sum_tail.data;
    const bool dw_rests = dw_kept && core::weight_sum_keeps_rests(call.options.grad_weight_sum_tail);
    Workspace<C> dx, own_tail, db, rest_slice;
    if (dw_rests) rest_slice = Workspace<C>(context_, rest_slice_bytes(call) / sizeof(C));
    lmloss_tensor sum_tail = call.options.grad_weight_sum_tail;
    const int64_t split = !dw_sum  ? 0
                          : dw_kept ? call.weight_sum_split
                                    : core::weight_sum_rows_in_place(g.grad_weight, vocab, hidden);
    if (dw_sum && !dw_kept) {
      own_tail = Workspace<C>(context_, size_t(vocab - split) * size_t(hidden));
      sum_tail = lmloss_tensor_2d(own_tail.get(), LMLOSS_F32, vocab - split, hidden, 0);
    }
    if (wants_grads && g.grad_hidden.data && !dx_direct) dx = Workspace<C>(context_, size_t(plan_.chunk_rows) * size_t(hidden));
    if (wants_grads && g.grad_bias.data) {
      db = Workspace<C>(context_, size_t(vocab));
      std::fill(db.get(), db.get() + vocab, C(0));
    }
    // The caller's 16-bit dW widened into its f32 sum in its own bytes only once every piece of
    // workspace is had: a call that fails for memory writes nothing.
    if (dw_sum && !dw_kept && (call.options.flags & LMLOSS_ACCUMULATE_GRAD_WEIGHT))
      widen_weight_sum(g.grad_weight, split, vocab, hidden, sum_tail, threads_);
    const bool dw_one_matrix = dw_sum && core::weight_sum_is_one_matrix(g.grad_weight, sum_tail, split, hidden);

    double loss_sum = 0;
    for (int64_t row0 = 0; row0 < n; row0 += plan_.chunk_rows) {
      const int64_t rows = std::min(plan_.chunk_rows, n - row0);
      chunks.produce(row0, rows, z.get(), threads_);
#pragma omp parallel for num_threads(threads_) schedule(static)
      for (int64_t i = 0; i < rows; ++i)
        row_loss.get()[i] = process_row(chunks, row0 + i, z.get() + i * vocab, scratch.get() + size_t(omp_get_thread_num()) * size_t(call.top_k + 1));
      if (call.wants_loss()) {
        for (int64_t i = 0; i < rows; ++i) loss_sum += double(row_loss.get()[i]);  // fixed order
        if (call.options.reduction == LMLOSS_REDUCTION_NONE)
          for (int64_t i = 0; i < rows; ++i) static_cast<C*>(call.loss.data)[(row0 + i) * core::row_stride(call.loss)] = row_loss.get()[i];
      }
      if (!wants_grads) continue;
      if (g.grad_logits.data) store_rows(g.grad_logits, row0, rows, z.get());
      if (g.grad_hidden.data) {
        if (dx_direct) {
          chunks.grad_hidden(rows, z.get(), static_cast<C*>(core::row_ptr_mut(g.grad_hidden, row0)), core::row_stride(g.grad_hidden));
        } else {
          chunks.grad_hidden(rows, z.get(), dx.get(), hidden);
          store_rows(g.grad_hidden, row0, rows, dx.get());
        }
      }
      if (g.grad_weight.data) {
        const bool add = row0 > 0 || (call.options.flags & LMLOSS_ACCUMULATE_GRAD_WEIGHT) != 0;
        const C beta = add ? C(1) : C(0);
        if (dw_direct) {
          chunks.grad_weight(rows, z.get(), beta, static_cast<C*>(g.grad_weight.data), core::row_stride(g.grad_weight));
        } else if constexpr (std::is_same_v<C, float>) {  // a 16-bit dW: 16-bit inputs, f32 compute
          auto* in_place = static_cast<C*>(g.grad_weight.data);
          if (dw_rests) {
            for (int64_t v0 = 0; v0 < vocab; v0 += kRestSliceRows) {
              const int64_t v1 = std::min(vocab, v0 + kRestSliceRows);
              chunks.grad_weight_rows(v0, v1, rows, z.get(), C(0), rest_slice.get(), hidden);
              fold_into_rests(rest_slice.get(), v1 - v0, hidden, add, core::row_ptr_mut(g.grad_weight, v0),
                              core::row_stride(g.grad_weight),
                              static_cast<uint8_t*>(core::row_ptr_mut(sum_tail, v0)), core::row_stride(sum_tail),
                              threads_);
            }
          } else if (dw_one_matrix) {
            chunks.grad_weight_rows(0, vocab, rows, z.get(), beta, in_place, hidden);
          } else {
            chunks.grad_weight_rows(0, split, rows, z.get(), beta, in_place, hidden);
            chunks.grad_weight_rows(split, vocab, rows, z.get(), beta, static_cast<C*>(sum_tail.data), core::row_stride(sum_tail));
          }
        }
      }
      if (g.grad_bias.data) add_column_sums(rows, z.get(), db.get());
    }

    if (call.wants_loss() && call.options.reduction != LMLOSS_REDUCTION_NONE)
      *static_cast<C*>(call.loss.data) = C(loss_sum * inv_divisor_);
    if (dw_sum && !dw_kept) {
      WeightSumCall round;
      round.grad_weight = g.grad_weight;
      round.tail = sum_tail;
      round.vocab = vocab;
      round.hidden = hidden;
      round.split = split;
      round_weight_sum(round, threads_);
    }
    if (wants_grads && g.grad_bias.data)
      finish_accumulator(g.grad_bias, db.get(), 1, vocab, (call.options.flags & LMLOSS_ACCUMULATE_GRAD_BIAS) != 0);
    return core::succeed();
  }

 private:
  // One token: z (vocab) in, dL/dz (vocab) out in place when gradients are wanted. Returns the
  // token's loss (0 when uncounted) and writes its lse.
  C process_row(const LogitsChunks<C>& chunks, int64_t t, C* z, C* saved) const {
    const LossCall& call = call_;
    const int64_t vocab = call.vocab, k = call.top_k;
    const bool is_counted = counted(call, t);
    const bool scaled = call.options.softcap > 0 || call.options.temperature != 1.0;
    chunks.finish_row(z, scale_, scaled);

    // p_j = exp(s_j - lse) in every mode, with lse rounded to C as it is saved, so the fused
    // gradient and the backward from a saved lse agree bitwise.
    C lse;
    if (call.mode == Mode::backward) {
      lse = static_cast<const C*>(call.lse.data)[t * core::row_stride(call.lse)];
    } else {
      C max_s = -std::numeric_limits<C>::infinity();
      for (int64_t j = 0; j < vocab; ++j) max_s = z[j] > max_s ? z[j] : max_s;  // NaN passes to the sum
      if (std::isinf(max_s)) max_s = 0;  // all -inf (or +inf) rows: keep the arithmetic defined
      // Summed in double: tens of thousands of f32 terms drift past the f32 tolerance.
      lse = C(Accumulator(max_s) + std::log(sum_exp(z, vocab, max_s)));
      if (call.lse.data) static_cast<C*>(call.lse.data)[t * core::row_stride(call.lse)] = lse;
    }

    // The few logits the loss and the sparse corrections read, saved before z is overwritten.
    const int64_t label = call.has_labels() && is_counted ? label_of(call, t) : -1;
    const C s_label = label >= 0 ? z[label] : C(0);
    Accumulator teacher_cross = 0, teacher_mass = 0;
    for (int64_t i = 0; i < k && is_counted; ++i) {
      const C prob = teacher_prob<C>(call, t, i);
      saved[i] = z[teacher_id(call, t, i)];
      teacher_cross += Accumulator(core::teacher_cross_term(prob, saved[i]));
      teacher_mass += Accumulator(prob);
    }
    C loss = 0;
    if (is_counted && call.wants_loss()) {
      Accumulator sum_s = 0;
      if (call.options.label_smoothing != 0 && call.options.ce_weight != 0)
        for (int64_t j = 0; j < vocab; ++j) sum_s += Accumulator(z[j]);
      loss = weights_.loss(lse, s_label, C(sum_s), C(teacher_cross), C(teacher_mass));
    }
    if (!call.wants_grads()) return loss;
    if (!is_counted) {
      std::fill(z, z + vocab, C(0));
      return loss;
    }

    const C upstream = C(upstream_of<C>(call, t) * inv_divisor_);
    const C p_coef = weights_.p_coef(upstream, lse, C(teacher_mass));
    const C offset = weights_.offset(upstream);
    if (scaled) {
      // The dense part chained to z, then the sparse corrections at their saved s.
      for (int64_t j = 0; j < vocab; ++j) {
        const C s = z[j];
        z[j] = (p_coef * vector_exp(s - lse) + offset) * scale_.derivative(s);
      }
      if (label >= 0) z[label] += weights_.label_correction(upstream) * scale_.derivative(s_label);
      for (int64_t i = 0; i < k; ++i)
        z[teacher_id(call, t, i)] += weights_.teacher_correction(upstream, teacher_prob<C>(call, t, i)) * scale_.derivative(saved[i]);
    } else {
      dense_grad(z, vocab, lse, p_coef, offset);
      if (label >= 0) z[label] += weights_.label_correction(upstream);
      for (int64_t i = 0; i < k; ++i) z[teacher_id(call, t, i)] += weights_.teacher_correction(upstream, teacher_prob<C>(call, t, i));
    }
    return loss;
  }

  // Rows of a compute-type buffer (rows, cols) into a caller's tensor of any float dtype.
  void store_rows(const lmloss_tensor& out, int64_t row0, int64_t rows, const C* src) const {
    const int64_t cols = out.shape[1];
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      void* dst = core::row_ptr_mut(out, row0 + i);
      store_row(src + i * cols, dst, out.dtype, cols);
    }
  }

  // acc[j] += sum_i dz[i, j], each column summed in row order (deterministic for any thread count).
  void add_column_sums(int64_t rows, const C* dz, C* acc) const {
    const int64_t vocab = call_.vocab;
    const int64_t block = 256;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (int64_t c0 = 0; c0 < vocab; c0 += block) {
      const int64_t c1 = std::min(vocab, c0 + block);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t c = c0; c < c1; ++c) acc[c] += dz[i * vocab + c];
    }
  }

  // A compute-type accumulator (rows, cols) into the caller's gradient, added when accumulating.
  void finish_accumulator(const lmloss_tensor& out, const C* acc, int64_t rows, int64_t cols, bool accumulate) const {
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      // A matrix row, or the whole of a (possibly strided) vector.
      void* dst = out.ndim == 2 ? core::row_ptr_mut(out, i) : out.data;
      const int64_t step = out.ndim == 2 ? 1 : core::row_stride(out);
      for (int64_t j = 0; j < cols; ++j) {
        C value = acc[i * cols + j];
        if (accumulate) value += core::load_float<C>(dst, out.dtype, j * step);
        core::store_float<C>(dst, out.dtype, j * step, value);
      }
    }
  }

  lmloss_context& context_;
  const LossCall& call_;
  Plan plan_;
  int threads_;
  core::LogitScale<C> scale_;
  core::LossWeights<C> weights_;
  double inv_divisor_ = 1.0;
};

// ---- Top-k ---------------------------------------------------------------------------------

// Orders candidates: larger value first, NaN above everything, ties to the lower id.
template <typename C>
struct TopkOrder {
  const C* s;
  bool operator()(int32_t a, int32_t b) const {
    const bool nan_a = std::isnan(s[a]), nan_b = std::isnan(s[b]);
    if (nan_a != nan_b) return nan_a;
    if (!nan_a && s[a] != s[b]) return s[a] > s[b];
    return a < b;
  }
};

template <typename C>
lmloss_status run_topk(lmloss_context& context, const TopkCall& call, const Plan& plan) {
  const int64_t vocab = call.vocab, k = call.options.k;
  const int threads = thread_count(context);
  const auto scale = core::LogitScale<C>::make(call.options.softcap, call.options.temperature);
  const bool scaled = call.options.softcap > 0 || call.options.temperature != 1.0;
  LogitsChunks<C> chunks(context, call.head, call.linear, vocab, call.hidden, plan);
  Workspace<C> z(context, size_t(plan.chunk_rows) * size_t(vocab));
  Workspace<int32_t> order(context, size_t(threads) * size_t(vocab));
  for (int64_t row0 = 0; row0 < call.n_tokens; row0 += plan.chunk_rows) {
    const int64_t rows = std::min(plan.chunk_rows, call.n_tokens - row0);
    chunks.produce(row0, rows, z.get(), threads);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = row0 + i;
      C* s = z.get() + i * vocab;
      chunks.finish_row(s, scale, scaled);
      int32_t* ids = order.get() + size_t(omp_get_thread_num()) * size_t(vocab);
      for (int64_t j = 0; j < vocab; ++j) ids[j] = int32_t(j);
      const TopkOrder<C> before{s};
      if (k < vocab) std::nth_element(ids, ids + k, ids + vocab, before);
      std::sort(ids, ids + k, before);

      // Probabilities: over the k (renormalised), or of the whole row with the tail beside them.
      C* probs = static_cast<C*>(core::row_ptr_mut(call.probs, t));
      int32_t* out_ids = static_cast<int32_t*>(core::row_ptr_mut(call.ids, t));
      C max_s = s[ids[0]];
      if (std::isinf(max_s)) max_s = 0;
      Accumulator tail = 0;
      Accumulator normalizer = 0;
      if (call.options.renormalize) {
        for (int64_t r = 0; r < k; ++r) normalizer += Accumulator(std::exp(s[ids[r]] - max_s));
      } else {
        // The tail is summed over the ids left out, not as 1 - sum: no cancellation.
        for (int64_t r = 0; r < k; ++r) normalizer += Accumulator(std::exp(s[ids[r]] - max_s));
        for (int64_t r = k; r < vocab; ++r) tail += Accumulator(std::exp(s[ids[r]] - max_s));
        normalizer += tail;
        tail /= normalizer;
      }
      for (int64_t r = 0; r < k; ++r) {
        out_ids[r] = ids[r];
        probs[r] = C(Accumulator(std::exp(s[ids[r]] - max_s)) / normalizer);
      }
      if (call.tail.data) static_cast<C*>(call.tail.data)[t * core::row_stride(call.tail)] = C(tail);
    }
  }
  return core::succeed();
}

// ---- The backend ---------------------------------------------------------------------------

class CpuBackend final : public core::Backend {
 public:
  bool available() const override { return true; }

  lmloss_status check(lmloss_context& context, const LossCall& call) override {
    // Ids are read here, on the host, so a bad one is reported before anything is written.
    for (int64_t t = 0; t < call.n_tokens; ++t) {
      if (!counted(call, t)) continue;
      if (call.has_labels()) {
        const int64_t y = label_of(call, t);
        if (y < 0 || y >= call.vocab)
          return core::fail(LMLOSS_ERROR_INVALID_ARGUMENT, "targets.labels: label " + std::to_string(y) + " of token " +
                                                               std::to_string(t) + " is outside [0, " + std::to_string(call.vocab) +
                                                               ") and is not ignore_index");
      }
      for (int64_t i = 0; i < call.top_k; ++i) {
        const int64_t id = teacher_id(call, t, i);
        if (id < 0 || id >= call.vocab)
          return core::fail(LMLOSS_ERROR_INVALID_ARGUMENT, "targets.teacher_ids: id " + std::to_string(id) + " of token " +
                                                               std::to_string(t) + " is outside [0, " + std::to_string(call.vocab) + ")");
      }
    }
    if (plan_loss(context, call, context.workspace_budget).chunk_rows == 0) {
      const size_t sum_bytes = own_weight_sum_bytes(call);
      const auto plan_for = [&](size_t budget) { return plan_loss(context, call, budget); };
      return budget_error(context, least_budget(plan_for, context.workspace_budget),
                          sum_bytes ? ", " + std::to_string(sum_bytes) +
                                          " of them the f32 sum of the bf16/f16 grads.grad_weight beyond its own "
                                          "bytes (which options.grad_weight_sum_tail keeps in the caller's memory instead)"
                                    : "");
    }
    return LMLOSS_SUCCESS;
  }

  lmloss_status check(lmloss_context& context, const TopkCall& call) override {
    if (plan_topk(context, call, context.workspace_budget).chunk_rows == 0) {
      const auto plan_for = [&](size_t budget) { return plan_topk(context, call, budget); };
      return budget_error(context, least_budget(plan_for, context.workspace_budget));
    }
    return LMLOSS_SUCCESS;
  }

  lmloss_status run(lmloss_context& context, const LossCall& call) override {
    const BlasThreads blas_threads(context);
    const Plan plan = plan_loss(context, call, context.workspace_budget);
    if (call.compute_dtype == LMLOSS_F64) return LossRunner<double>(context, call, plan).run();
    return LossRunner<float>(context, call, plan).run();
  }

  lmloss_status run(lmloss_context& context, const TopkCall& call) override {
    const BlasThreads blas_threads(context);
    const Plan plan = plan_topk(context, call, context.workspace_budget);
    if (call.compute_dtype == LMLOSS_F64) return run_topk<double>(context, call, plan);
    return run_topk<float>(context, call, plan);
  }

  lmloss_status run(lmloss_context&, const ScaleCall& call) override {
    if (call.grad.dtype == LMLOSS_F64) scale_rows<double>(call);
    else scale_rows<float>(call);
    return core::succeed();
  }

  lmloss_status deferred_bytes(lmloss_context&, const LossCall&, size_t& bytes) override {
    bytes = 0;  // the CPU's dW products add into the sum as they come
    return LMLOSS_SUCCESS;
  }

  lmloss_status run(lmloss_context& context, const WeightSumCall& call) override {
    if (call.deferred.data)
      return core::fail(LMLOSS_ERROR_UNSUPPORTED, "deferred: the CPU defers no product (lmloss_loss_deferred_bytes gives 0)");
    round_weight_sum(call, thread_count(context));
    return core::succeed();
  }

  lmloss_status zero(lmloss_context&, const lmloss_tensor& t) override {
    for (int64_t r = 0; r < core::row_count(t); ++r)
      std::memset(core::row_ptr_mut(t, r), 0, size_t(core::row_length(t)) * core::dtype_size(t.dtype));
    return core::succeed();
  }

  lmloss_status synchronize(lmloss_context&) override { return core::succeed(); }

 private:
  // out = grad * scale computed in C (f64 for an f64 grad, else f32), row by row (in place when out
  // is grad).
  template <typename C>
  static void scale_rows(const ScaleCall& call) {
    const C scale = call.scale.data ? core::load_float<C>(call.scale.data, call.scale.dtype, 0) : C(1);
    for (int64_t r = 0; r < call.rows; ++r) {
      const void* in = core::row_ptr(call.grad, r);
      void* out = core::row_ptr_mut(call.out, r);
      for (int64_t j = 0; j < call.cols; ++j)
        core::store_float<C>(out, call.out.dtype, j, core::load_float<C>(in, call.grad.dtype, j) * scale);
    }
  }

  // OpenBLAS's thread count is the process's, and its products' bits depend on it: a call on a
  // context with a count of its own sets it for the call's length and puts the caller's back
  // after, so that no context's setting carries into another's calls or into the application's
  // own BLAS calls. A context at the default (0) runs with the count the application has.
  class BlasThreads {
   public:
    explicit BlasThreads(const lmloss_context& context) : saved_(openblas_get_num_threads()) {
      if (context.num_threads > 0 && context.num_threads != saved_) {
        openblas_set_num_threads(context.num_threads);
        restore_ = true;
      }
    }
    ~BlasThreads() {
      if (restore_) openblas_set_num_threads(saved_);
    }
    BlasThreads(const BlasThreads&) = delete;
    BlasThreads& operator=(const BlasThreads&) = delete;

   private:
    int saved_;
    bool restore_ = false;
  };

  // The plans under `budget`: the context's, or one tried for the least that runs.
  static Plan plan_loss(const lmloss_context& context, const LossCall& call, size_t budget) {
    const int threads = thread_count(context);
    const bool f64 = call.compute_dtype == LMLOSS_F64;
    const size_t s = f64 ? 8 : 4;
    const lmloss_grads& g = call.grads;
    const lmloss_dtype c = call.compute_dtype;
    size_t fixed = size_t(threads) * size_t(call.top_k + 1) * s;
    size_t per_row = s;  // the row's loss
    if (call.wants_grads()) {
      if (g.grad_hidden.data && g.grad_hidden.dtype != c) per_row += size_t(call.hidden) * s;
      fixed += own_weight_sum_bytes(call) + rest_slice_bytes(call);
      if (g.grad_bias.data) fixed += size_t(call.vocab) * s;
    }
    const auto plan_head_in = f64 ? &plan_head<double> : &plan_head<float>;
    return plan_head_in(budget, call.linear, call.n_tokens, call.vocab, call.hidden, call.input_dtype, fixed, per_row);
  }

  static Plan plan_topk(const lmloss_context& context, const TopkCall& call, size_t budget) {
    const size_t fixed = size_t(thread_count(context)) * size_t(call.vocab) * sizeof(int32_t);
    const auto plan_head_in = call.compute_dtype == LMLOSS_F64 ? &plan_head<double> : &plan_head<float>;
    return plan_head_in(budget, call.linear, call.n_tokens, call.vocab, call.hidden, call.input_dtype, fixed, 0);
  }
};

}  // namespace
}  // namespace lmloss::cpu

namespace lmloss::core {
Backend& cpu_backend() {
  static cpu::CpuBackend backend;
  return backend;
}
}  // namespace lmloss::core
