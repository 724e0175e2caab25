// Row kernels of the losses (see loss_rows.cuh for the passes), and the small kernels around
// them: the per-call prologue (counted tokens, upstream gradient, f16 scale), the final loss
// reduction, the bias gradient's column sums, and lmloss_scale_gradient's scaled copy. Every
// reduction runs in a fixed order.
#include "cuda/loss_rows.cuh"

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/dtype.hpp"
#include "core/weight_sum_rest.hpp"
#include "cuda/row_stats_product.cuh"

namespace lmloss::cuda {
namespace {

constexpr int kRowThreads = 512;
// The column tiles a row's large entries may lie in, and the entries found, at most (more: none
// taken); of those found, the kLargeEntries of the lowest columns are taken.
constexpr int kLargeTilesMax = 32;
constexpr int kLargeFoundMax = 2 * kLargeEntries;
// The product path's rows read their column tiles' partials, not the logits (a kept row of the
// exponential form reads nothing else): short chains of dependent loads, which more rows in flight
// hide better than more threads a row (on an H200, 128 threads took gemma2-2b's row kernels from
// 0.26 to 0.16 ms a step, 0.79 to 0.34 with a teacher's k 64).
constexpr int kProductRowThreads = 128;
constexpr int kReduceThreads = 1024;

// Stores G values of TOut at once (8 or 16 bytes).
template <typename T, int G>
struct alignas(G * sizeof(T)) Pack {
  T v[G];
};

// out[j] = f(j, in[j]) over a row; 16-byte loads and G-wide stores when both rows line up, else
// scalar accesses. in may equal out (the gradient in place).
template <typename TIn, typename TOut, typename F>
__device__ __forceinline__ void map_row(const TIn* in, TOut* out, int64_t n, F&& f) {
  constexpr int G = Vec<TIn>::size;
  const uintptr_t in_addr = reinterpret_cast<uintptr_t>(in);
  const uintptr_t out_addr = reinterpret_cast<uintptr_t>(out);
  int64_t head = static_cast<int64_t>(((16 - (in_addr & 15)) & 15) / sizeof(TIn));
  const bool vector = in_addr % sizeof(TIn) == 0 && out_addr % sizeof(TOut) == 0 &&
                      ((out_addr / sizeof(TOut)) + head) % G == 0;
  if (!vector || head > n) head = n;
  const int64_t body = (n - head) / G;
  for (int64_t j = threadIdx.x; j < head; j += blockDim.x) out[j] = from_float<TOut>(f(j, to_float(in[j])));
  const Vec<TIn>* in_vec = reinterpret_cast<const Vec<TIn>*>(in + head);
  Pack<TOut, G>* out_vec = reinterpret_cast<Pack<TOut, G>*>(out + head);
  for (int64_t i = threadIdx.x; i < body; i += blockDim.x) {
    const Vec<TIn> x = in_vec[i];
    Pack<TOut, G> y;
#pragma unroll
    for (int e = 0; e < G; ++e) y.v[e] = from_float<TOut>(f(head + i * G + e, to_float(x.v[e])));
    out_vec[i] = y;
  }
  for (int64_t j = head + body * G + threadIdx.x; j < n; j += blockDim.x)
    out[j] = from_float<TOut>(f(j, to_float(in[j])));
}

// The max s of column j's tile in a row of the product's partials: what its shifted logit is
// relative to.
__device__ __forceinline__ float tile_shift(const float4* partial, int64_t j) {
  return __ldg(&partial[j / kRowStatsTileColumns].x);
}

// out[j] = f(in[j], tile_shift(partial, j)) over a row of the product's shifted logits. A
// 16-byte vector never straddles a tile (the tile width is a multiple of its length), so where
// both rows are 16-byte aligned (the product path's are) the shift is read once per vector, not
// once per element (measured on an H200: the gradient pass 29% faster at fixed clocks).
template <typename TIn, typename TOut, typename F>
__device__ __forceinline__ void map_shifted_row(const TIn* in, TOut* out, int64_t n, const float4* partial, F&& f) {
  constexpr int G = Vec<TIn>::size;
  static_assert(kRowStatsTileColumns % G == 0, "a vector within one column tile");
  if constexpr (std::is_same_v<TIn, TOut>) {
    if ((reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) % 16 == 0) {
      const int64_t body = n / G;
      const Vec<TIn>* in_vec = reinterpret_cast<const Vec<TIn>*>(in);
      Pack<TOut, G>* out_vec = reinterpret_cast<Pack<TOut, G>*>(out);
      for (int64_t i = threadIdx.x; i < body; i += blockDim.x) {
        const Vec<TIn> x = in_vec[i];
        const float shift = tile_shift(partial, i * G);
        Pack<TOut, G> y;
#pragma unroll
        for (int e = 0; e < G; ++e) y.v[e] = from_float<TOut>(f(to_float(x.v[e]), shift));
        out_vec[i] = y;
      }
      for (int64_t j = body * G + threadIdx.x; j < n; j += blockDim.x)
        out[j] = from_float<TOut>(f(to_float(in[j]), tile_shift(partial, j)));
      return;
    }
  }
  map_row(in, out, n, [&](int64_t j, float v) { return f(v, tile_shift(partial, j)); });
}

// out[j] = f(j, in[j]) where out is narrower than in and starts where in starts (a 16-bit gradient
// written over its own f32 logits row, so no second buffer is needed). The row goes in tiles,
// in order: every thread reads its share of a tile, a barrier, then the writes, which land on
// bytes of this tile or of tiles already read (out index j sits at in index j / 2).
template <typename TOut, typename F>
__device__ __forceinline__ void narrow_row(const float* in, TOut* out, int64_t n, F&& f) {
  static_assert(sizeof(TOut) == 2, "narrowing f32 to a 16-bit type");
  // Elements per thread per tile: two 16-byte loads before each barrier (32 per thread measured
  // slower on an H200, 2026-12-02).
  constexpr int G = 8;
  const int64_t tile = int64_t(blockDim.x) * G;
  for (int64_t base = 0; base < n; base += tile) {
    float x[G];
#pragma unroll
    for (int q = 0; q < G / 4; ++q) {  // thread t reads 4 floats at base + 4 (q blockDim + t)
      const int64_t j = base + 4 * (int64_t(q) * blockDim.x + threadIdx.x);
      if (j + 4 <= n) {
        const float4 v = *reinterpret_cast<const float4*>(in + j);
        x[4 * q] = v.x; x[4 * q + 1] = v.y; x[4 * q + 2] = v.z; x[4 * q + 3] = v.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) x[4 * q + e] = j + e < n ? in[j + e] : 0.f;
      }
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < G / 4; ++q) {
      const int64_t j = base + 4 * (int64_t(q) * blockDim.x + threadIdx.x);
      if (j + 4 <= n) {
        Pack<TOut, 4> y;
#pragma unroll
        for (int e = 0; e < 4; ++e) y.v[e] = from_float<TOut>(f(j + e, x[4 * q + e]));
        *reinterpret_cast<Pack<TOut, 4>*>(out + j) = y;
      } else {
        for (int e = 0; e < 4 && j + e < n; ++e) out[j + e] = from_float<TOut>(f(j + e, x[4 * q + e]));
      }
    }
  }
}

// Sort keys (a power of two) of a row's entries where the rows take their entries ordered, else 0.
__host__ __device__ constexpr int64_t entry_sort_keys(const LossRowsArgs& a) {
  if (!forms_gradient(a.work) || a.scales_only || a.entry_keys == nullptr || !orders_entries(a.top_k, a.vocab))
    return 0;
  int64_t keys = kOrderedEntriesMin;
  while (keys < a.top_k + 1) keys *= 2;
  return keys;
}

// Row t's entry e: 0 the label (label_id, -1 where it takes no fix-up), 1 + k teacher id k.
__device__ __forceinline__ int64_t entry_id(const LossRowsArgs& a, int64_t t, int64_t label_id, int64_t e) {
  return e == 0 ? label_id : load_id(a.teacher_ids, a.teacher_ids_dtype, t * a.teacher_ids_ld + e - 1);
}

// Sorts keys[0, n) ascending, n a power of two, with the block's threads (a bitonic network:
// a fixed sequence of compare-exchanges, so the same on every run).
__device__ __forceinline__ void block_bitonic_sort(uint64_t* keys, int64_t n) {
  for (int64_t size = 2; size <= n; size *= 2) {
    for (int64_t stride = size / 2; stride > 0; stride /= 2) {
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int64_t partner = i ^ stride;
        if (partner <= i) continue;
        const uint64_t x = keys[i], y = keys[partner];
        const bool ascending = (i & size) == 0;
        if ((x > y) == ascending) {
          keys[i] = y;
          keys[partner] = x;
        }
      }
      __syncthreads();
    }
  }
}

__device__ __forceinline__ bool is_counted(const void* labels, lmloss_dtype labels_dtype,
                                           int64_t ignore_index, const uint8_t* mask, int64_t t) {
  if (labels && load_id(labels, labels_dtype, t) == ignore_index) return false;
  if (mask && mask[t] == 0) return false;
  return true;
}

// The label's id where its entry takes a fix-up, else -1; `label` as loaded for the token.
__device__ __forceinline__ int64_t fixup_label(const LossRowsArgs& a, int64_t label) {
  return a.labels && a.weights.alpha != 0.f && label != a.ignore_index ? label : -1;
}

// Each row's entries ordered by (id, entry) into entry_keys: keys (id << 32 | entry) sorted in
// shared memory, ids out of range and the padding keyed past every id. A kernel of its own: the
// same sort inside the rows kernel came out unsorted on H100 and H200 (run 57), alone it does not
// (run 59 found the rows kernel's warp 0 reaching a barrier split, which may be why).
constexpr int kOrderThreads = 256;
__global__ void __launch_bounds__(kOrderThreads) entry_order_kernel(const LossRowsArgs a) {
  extern __shared__ uint64_t keys[];  // (entry_sort_keys(a))
  const int64_t n_keys = entry_sort_keys(a), entries = a.top_k + 1;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const int64_t t = a.row0 + r;
    const int64_t label_id = a.labels ? fixup_label(a, load_id(a.labels, a.labels_dtype, t)) : -1;
    for (int64_t e = threadIdx.x; e < n_keys; e += blockDim.x) {
      const int64_t id = e < entries ? entry_id(a, t, label_id, e) : -1;
      keys[e] = (id >= 0 && id < a.vocab ? uint64_t(id) : kNoEntryId) << 32 | uint64_t(e);
    }
    __syncthreads();
    block_bitonic_sort(keys, n_keys);
    uint64_t* sorted = a.entry_keys + r * entries;
    for (int64_t i = threadIdx.x; i < entries; i += blockDim.x) sorted[i] = keys[i];
    __syncthreads();  // the keys are written again for the next row
  }
}

// Two blocks of kRowThreads an SM: 64 registers a thread. Without that bound ptxas gave the bf16
// kernel 64 and 172 bytes of spill loads, or, once the large entries' tile bits were added, 93
// and fewer blocks an SM; with it every instantiation fits 64 without spilling.
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kRowThreads, 2) loss_rows_kernel(const LossRowsArgs a) {
  __shared__ float2 maxsum_scratch[32];
  __shared__ float sum_scratch[32];
  __shared__ int row_bad;
  // dW's large entries (LossRowsArgs::large_cols): the column tiles that may hold one; the
  // columns found, in the order found, with the sums of the corrections that land on them; then
  // the first kLargeEntries of them in column order.
  __shared__ int large_tiles[kLargeTilesMax];
  __shared__ int large_tile_count, large_found;
  __shared__ uint32_t found_cols[kLargeFoundMax], large_cols[kLargeEntries];
  __shared__ float found_corrections[kLargeFoundMax], large_corrections[kLargeEntries];
  const bool ordered = entry_sort_keys(a) > 0;
  const int64_t V = a.vocab;
  const int64_t K = a.top_k;
  const int64_t sparse_ld = K + 1;
  const float* bias = static_cast<const float*>(a.bias);
  const bool wants_grad = forms_gradient(a.work);
  const auto& scale = a.scale;
  const auto& weights = a.weights;
  // The exponential form is compiled into the bf16 product path's kernel only.
  constexpr bool kExpFormTypes = std::is_same_v<TIn, __nv_bfloat16> && std::is_same_v<TOut, __nv_bfloat16>;
  // The gradient over its own logits, in a narrower type: the tiled, ordered pass.
  const bool narrow = sizeof(TOut) < sizeof(TIn) && a.grad == a.logits;
  auto write_row = [&](const TIn* in, TOut* out, int64_t n, auto&& f) {
    if constexpr (sizeof(TOut) < sizeof(TIn)) {
      if (narrow) {
        narrow_row(in, out, n, f);
        return;
      }
    }
    map_row(in, out, n, f);
  };

  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const int64_t t = a.row0 + r;
    const TIn* z = static_cast<const TIn*>(a.logits) + r * a.logits_ld;  // (vocab)
    TOut* dz = wants_grad ? static_cast<TOut*>(a.grad) + r * a.grad_ld : nullptr;
    float* sparse = a.sparse_s + r * sparse_ld;  // (top_k + 1)
    // The product's path: the row's column-tile partials, and s of a shifted logit at column j
    // (the logit plus its tile's max s).
    const float4* partial = stats_from_product(a.work) ? a.partial + r * a.partial_ld : nullptr;  // (partial_tiles)
    auto unshift = [&](int64_t j, float shifted) { return shifted + tile_shift(partial, j); };
    // The exponential form (see LossRowsArgs): what the stored value at column j is relative to.
    const bool exp_form = kExpFormTypes && a.exp_shift != nullptr;
    const float shift = exp_form ? a.exp_shift[r] : 0.f;
    const bool finds_large = exp_form && a.large_cols != nullptr;
    // Token t's large-entry slots: slot l gets column col, dl/dz coef and the stored value there (a
    // warp's lane 0 writes it); the slots of no column keep what launch_clear_large_entries set.
    auto write_large_slot = [&](int l, uint32_t col, float coef, float stored) {
      const int64_t slot = t * kLargeEntries + l;
      a.large_cols[slot] = col;
      a.large_coefs[slot] = coef;
      a.large_stored[slot] = stored;
      a.large_slots[slot] = int32_t(slot);
    };
    auto reference = [&](float tile_max) { return fmaxf(shift, tile_max - kExpFormMargin); };
    // s at column j from its stored value v = exp(s - reference); from the head where v is too
    // small for its log to be exact (s far below the row's shift and tile maxima: rare).
    auto s_from_stored = [&](int64_t j, float v) {
      if (v >= 0x1p-100f) return reference(tile_shift(partial, j)) + logf(v);
      const int64_t x_row = t * a.hidden_ld, w_row = j * a.weight_ld;
      float dot = 0.f;
      for (int64_t h = 0; h < a.hidden_size; ++h)
        dot = fmaf(load_float(a.hidden, a.head_dtype, x_row + h), load_float(a.weight, a.head_dtype, w_row + h), dot);
      return dot * scale.inv_temperature;
    };

    // Which ids the row has, and whether any is out of range (then: NaN loss, zero gradient).
    const bool has_label = a.labels != nullptr;
    const int64_t label = has_label ? load_id(a.labels, a.labels_dtype, t) : -1;
    const bool label_used = has_label && label != a.ignore_index;
    const bool counted = is_counted(a.labels, a.labels_dtype, a.ignore_index, a.mask, t);
    if (threadIdx.x == 0) {
      row_bad = label_used && (label < 0 || label >= V);
      large_tile_count = large_found = 0;  // the last row read them before its last barrier
    }
    __syncthreads();
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
      const int64_t id = load_id(a.teacher_ids, a.teacher_ids_dtype, t * a.teacher_ids_ld + k);
      if (id < 0 || id >= V) row_bad = 1;
    }
    __syncthreads();
    if (row_bad) {
      if (threadIdx.x == 0) {
        if (a.token_loss) a.token_loss[t] = NAN;
        if (a.lse_out) a.lse_out[t] = NAN;
        if (a.row_scale) a.row_scale[r] = 0.f;
        if (a.label_grad) a.label_grad[r] = 0.f;
        if (a.row_coef) a.row_coef[r] = 0.f;
        *a.error_flag = 1;
      }
      if (wants_grad && !a.scales_only) write_row(z, dz, V, [](int64_t, float) { return 0.f; });
      __syncthreads();
      continue;
    }

    // lse: one read of the row (online max and sum of exponentials), the product's partials, or
    // the saved value.
    float lse;
    float sum_s = 0.f;
    if (stats_from_product(a.work)) {
      MaxSum acc{-INFINITY, 0.f};
      for (int64_t i = threadIdx.x; i < a.partial_tiles; i += blockDim.x) {
        const float4 p = partial[i];
        acc = merge(acc, MaxSum{p.x, p.y});
        sum_s += p.z;
      }
      lse = block_lse(acc, maxsum_scratch);
      if (weights.label_smoothing != 0.f) sum_s = block_reduce(sum_s, Sum{}, 0.f, sum_scratch);
    } else if (a.work != RowWork::grad_from_lse) {
      MaxSum acc{-INFINITY, 0.f};
      const bool smoothing = weights.label_smoothing != 0.f;
      for_each_in_row(z, V, [&](int64_t j, float v) {
        const float s = scale.apply(bias ? v + bias[j] : v);
        add_to_lse(acc, s);
        sum_s += s;
      });
      lse = block_lse(acc, maxsum_scratch);
      if (smoothing) sum_s = block_reduce(sum_s, Sum{}, 0.f, sum_scratch);
    } else {
      lse = a.lse_in[t];
    }

    // The sparse entries: s at the label and at the teacher ids, saved before any overwrite.
    float s_label = 0.f;
    if (label_used) {
      s_label = a.label_s ? a.label_s[r] : scale.apply(bias ? to_float(z[label]) + bias[label] : to_float(z[label]));
      if (threadIdx.x == 0) sparse[0] = s_label;
    }
    float teacher_cross = 0.f, teacher_mass = 0.f;
    if (K > 0) {
      for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
        const int64_t id = load_id(a.teacher_ids, a.teacher_ids_dtype, t * a.teacher_ids_ld + k);
        const float s = exp_form  ? s_from_stored(id, to_float(z[id]))
                        : partial ? unshift(id, to_float(z[id]))
                                  : scale.apply(bias ? to_float(z[id]) + bias[id] : to_float(z[id]));
        const float p = a.teacher_probs[t * a.teacher_probs_ld + k];
        sparse[1 + k] = s;
        teacher_cross += core::teacher_cross_term(p, s);
        teacher_mass += p;
      }
      teacher_cross = block_reduce(teacher_cross, Sum{}, 0.f, sum_scratch);
      teacher_mass = block_reduce(teacher_mass, Sum{}, 0.f, sum_scratch);
    }

    if (threadIdx.x == 0) {
      if (a.token_loss)
        a.token_loss[t] = counted ? weights.loss(lse, s_label, sum_s, teacher_cross, teacher_mass) : 0.f;
      if (a.lse_out) a.lse_out[t] = lse;
    }
    if (!wants_grad) {
      __syncthreads();
      continue;
    }

    // g_t, times the f16 scale S.
    float g = 0.f;
    if (counted) {
      g = a.reduction == LMLOSS_REDUCTION_NONE ? (a.grad_loss ? a.grad_loss[t] : 1.f)
                                               : a.scalars->upstream * a.scalars->inv_denominator;
      g *= a.scalars->grad_scale;
    }
    const float p_coef = weights.p_coef(g, lse, teacher_mass);
    const float offset = weights.offset(g);
    // dW's large entries: the columns of p >= 1 / kLargeEntryInverse, read before the in-place
    // writes (s from the stored value, in the tiles whose maximum passes), then (at the
    // fix-ups) the label's and teacher ids' of |dl/dz| >= |p_coef| / kLargeEntryInverse; none
    // where more tiles or columns pass than there is room for (then the row is not peaked).
    // Which columns are taken moves only how much rounding dW keeps, not what it sums to.
    if (finds_large) {
      const float bar = lse - logf(kLargeEntryInverse);
      // The tiles whose max passes, their partials read a second time (marking them during the lse
      // pass, before the bar is known, saved nothing measurable in run 64 and took registers).
      if (g != 0.f)
        for (int64_t i = threadIdx.x; i < a.partial_tiles; i += blockDim.x)
          if (partial[i].x >= bar) {
            const int at = atomicAdd(&large_tile_count, 1);
            if (at < kLargeTilesMax) large_tiles[at] = int(i);
          }
      __syncthreads();
      const int tiles = large_tile_count <= kLargeTilesMax ? large_tile_count : 0;
      for (int64_t i = threadIdx.x; i < tiles * kRowStatsTileColumns; i += blockDim.x) {
        const int64_t j = large_tiles[i / kRowStatsTileColumns] * kRowStatsTileColumns + i % kRowStatsTileColumns;
        if (j >= V) continue;
        const float v = to_float(z[j]);
        if (v > 0.f && reference(tile_shift(partial, j)) + logf(v) >= bar) {
          const int at = atomicAdd(&large_found, 1);
          if (at < kLargeFoundMax) {
            found_cols[at] = uint32_t(j);
            found_corrections[at] = 0.f;
          }
        }
      }
    }
    __syncthreads();  // every sparse read above happens before the in-place writes below
    // The dense columns found (the fix-ups add to large_found only after the next barrier).
    const int dense_found = finds_large && large_found <= kLargeFoundMax ? large_found : 0;
    // The value written at the label and the teacher ids, given s there and the sum of the
    // corrections that land on it.
    auto sparse_value = [&](float s, float correction) {
      return (p_coef * expf(s - lse) + offset + correction) * scale.derivative(s);
    };
    // The label's id where its entry takes a fix-up (as the order kernel keys it), else -1.
    const int64_t label_id = fixup_label(a, label);  // the row's label, loaded once above
    const bool label_entry = label_id >= 0;
    // The exponential form: rows kept as stored, the rest as the other forms but / token_scale;
    // either way the label's one-hot term goes to label_grad, not into the stored row.
    bool kept = false;
    float unscale = 1.f;
    if (exp_form) {
      // With scales_only every row is kept: its stored values are gone, its far tiles come later.
      kept = g == 0.f || a.scales_only || (fabsf(lse - shift) <= kExpFormRange && p_coef != 0.f);
      unscale = 1.f / a.scalars->token_scale;
      // Every thread forms the row's scales, thread 0 only stores them. With the division inside
      // a branch of thread 0, ptxas left warp 0 split up to the barrier after the gradient writes,
      // which let the other warps pass it before lanes 1-31 had written: their dense values then
      // went over the other warps' fix-ups (run 59).
      const float row_coef = g == 0.f ? 0.f : p_coef * scale.derivative(0.f);
      const float row_scale = g == 0.f ? 0.f : kept ? row_coef * expf(shift - lse) * unscale : 1.f;
      const float label_grad = label_entry ? weights.label_correction(g) * scale.derivative(0.f) : 0.f;
      if (threadIdx.x == 0) {
        a.row_scale[r] = row_scale;
        if (finds_large) a.large_row_scale[t] = row_scale;
        a.label_grad[r] = label_grad;
        if (a.scales_only) {
          a.row_coef[r] = row_coef;
          a.row_lse[r] = lse;
        }
      }
      if (a.scales_only) {  // nothing stored to correct
        __syncthreads();
        continue;
      }
    }
    if (kept) {
      // The stored row stands; at the sparse entries (below) exp(s - shift) gains
      // correction / (p_coef exp(shift - lse)).
    } else if (exp_form) {
      const float coef = p_coef * scale.derivative(0.f) * unscale;  // no soft-capping here: 1 / T
      map_shifted_row(z, dz, V, partial, [&](float v, float tile_max) { return coef * v * expf(reference(tile_max) - lse); });
    } else if (partial) {
      // exp(v + shift - lse) as 2^(v log2 e + (shift - lse) log2 e): one FMA and the exp unit.
      const float ds_dz = scale.derivative(0.f);  // no soft-capping here: 1 / T
      map_shifted_row(z, dz, V, partial, [&](float v, float tile_max) {
        return (p_coef * exp2f(fmaf(v, kLog2e, (tile_max - lse) * kLog2e)) + offset) * ds_dz;
      });
    } else if (!counted) {  // zeros, as on the CPU, even where exp(s - lse) is not defined (lse -inf)
      write_row(z, dz, V, [](int64_t, float) { return 0.f; });
    } else {
      write_row(z, dz, V, [&](int64_t j, float v) {
        const float s = scale.apply(bias ? v + bias[j] : v);
        return (p_coef * expf(s - lse) + offset) * scale.derivative(s);
      });
    }
    __syncthreads();

    // Fix-ups: the label and each distinct teacher id get the dense value plus every correction
    // that lands on them, written once by the first entry naming that id (so duplicates are
    // summed in entry order, deterministically). Entry 0 is the label, entry 1 + k teacher k.
    if (g != 0.f) {
      auto id_of = [&](int64_t e) { return entry_id(a, t, label_id, e); };
      auto entry_correction = [&](int64_t e) -> float {
        return e == 0 ? (exp_form ? 0.f : weights.label_correction(g))
                      : weights.teacher_correction(g, a.teacher_probs[t * a.teacher_probs_ld + e - 1]);
      };
      // Writes id's value, from leader e (the first entry naming it) and its corrections' sum.
      auto write_fixup = [&](int64_t id, int64_t e, float correction) {
        const float s = sparse[e];
        if (finds_large) {  // the id's one leader records its corrections, or adds it as large
          bool found = false;
          for (int l = 0; l < dense_found; ++l)
            if (found_cols[l] == uint64_t(id)) {
              found_corrections[l] = correction;
              found = true;
            }
          const float softmax_part = fabsf(p_coef * scale.derivative(s));  // |dl/dz| of p = 1
          if (!found && fabsf(sparse_value(s, correction)) * kLargeEntryInverse >= softmax_part) {
            const int at = atomicAdd(&large_found, 1);
            if (at < kLargeFoundMax) {
              found_cols[at] = uint32_t(id);
              found_corrections[at] = correction;
            }
          }
        }
        dz[id] = from_float<TOut>(kept ? expf(s - shift) + correction * expf(lse - shift) / p_coef
                                       : sparse_value(s, correction) * unscale);
      };
      if (ordered) {
        // An id's entries lie together, in entry order; the first of them leads. The keys carry
        // the ids: no entry's id is loaded again.
        const uint64_t* keys = a.entry_keys + r * sparse_ld;
        auto key_id = [](uint64_t key) { return key >> 32; };
        for (int64_t i = threadIdx.x; i <= K; i += blockDim.x) {
          const uint64_t key = keys[i];
          if (key_id(key) == kNoEntryId || (i > 0 && key_id(keys[i - 1]) == key_id(key))) continue;
          float correction = 0.f;
          for (int64_t f = i; f <= K && key_id(keys[f]) == key_id(key); ++f)
            correction += entry_correction(uint32_t(keys[f]));
          write_fixup(int64_t(key_id(key)), uint32_t(key), correction);
        }
      } else {
        for (int64_t e = threadIdx.x; e <= K; e += blockDim.x) {
          const int64_t id = id_of(e);
          if (id < 0) continue;
          bool leader = true;
          for (int64_t f = 0; f < e && leader; ++f) leader = id_of(f) != id;
          if (!leader) continue;
          float correction = 0.f;
          for (int64_t f = e; f <= K; ++f)
            if (id_of(f) == id) correction += entry_correction(f);
          write_fixup(id, e, correction);
        }
      }
    }
    __syncthreads();

    // The large entries in column order (the columns are distinct), the first kLargeEntries
    // taken; their dl/dz with s recomputed from the head, a warp a slot at a time.
    if (finds_large) {
      const int found = large_found <= kLargeFoundMax ? large_found : 0;
      if (threadIdx.x < found) {
        const uint32_t col = found_cols[threadIdx.x];
        int rank = 0;
        for (int m = 0; m < found; ++m) rank += found_cols[m] < col;
        if (rank < kLargeEntries) {
          large_cols[rank] = col;
          large_corrections[rank] = found_corrections[threadIdx.x];
        }
      }
      __syncthreads();
      // The slots past these keep the column of none they were cleared to. The next row writes
      // the shared columns only after its first barrier: no barrier here.
      const int large_taken = min(found, kLargeEntries);
      for (int l = threadIdx.x / 32; l < large_taken; l += blockDim.x / 32) {
        const uint32_t col = large_cols[l];
        const auto* x = static_cast<const __nv_bfloat16*>(a.hidden) + t * a.hidden_ld;
        const auto* w = static_cast<const __nv_bfloat16*>(a.weight) + int64_t(col) * a.weight_ld;
        const float s = warp_dot(x, w, a.hidden_size) * scale.inv_temperature;
        const float coef = sparse_value(s, large_corrections[l]);
        const float stored = to_float(dz[col]);  // the fix-ups' writes are the block's own, before the barrier above
        if (threadIdx.x % 32 == 0) write_large_slot(l, col, coef, stored);
      }
    }
  }
}

__global__ void prepare_kernel(const PrepareArgs a) {
  __shared__ long long count_scratch[32];
  __shared__ float max_scratch[32];
  long long counted = 0;
  float gmax = 0.f;
  const bool vector_grad = a.reduction == LMLOSS_REDUCTION_NONE && a.grad_loss;
  for (int64_t t = threadIdx.x; t < a.n_tokens; t += blockDim.x) {
    if (!is_counted(a.labels, a.labels_dtype, a.ignore_index, a.mask, t)) continue;
    ++counted;
    if (vector_grad) gmax = fmaxf(gmax, fabsf(a.grad_loss[t]));
  }
  counted = block_reduce(counted, Sum{}, 0ll, count_scratch);
  gmax = block_reduce(gmax, Max{}, 0.f, max_scratch);
  if (threadIdx.x != 0) return;
  CallScalars s{};
  s.counted = counted;
  s.upstream = (a.grad_loss && a.reduction != LMLOSS_REDUCTION_NONE) ? a.grad_loss[0] : 1.f;
  if (a.reduction == LMLOSS_REDUCTION_MEAN) {
    const double d = a.normalizer > 0 ? a.normalizer : static_cast<double>(counted);
    s.inv_denominator = d > 0 ? static_cast<float>(1.0 / d) : 0.f;
  } else {
    s.inv_denominator = 1.f;
  }
  if (a.reduction != LMLOSS_REDUCTION_NONE) gmax = fabsf(s.upstream) * s.inv_denominator;
  else if (!a.grad_loss) gmax = 1.f;
  s.grad_scale = 1.f;
  if (a.scale_gradient) {
    // A power of two, so scaling and unscaling are exact: the largest |dl/ds| lands near 2^10,
    // far from f16's underflow and with room below its overflow.
    const float m = gmax * a.max_row_factor;
    if (m > 0.f && isfinite(m)) s.grad_scale = exp2f(fminf(fmaxf(10.f - floorf(log2f(m)), -100.f), 100.f));
  }
  s.inv_grad_scale = 1.f / s.grad_scale;
  s.token_scale = a.reduction == LMLOSS_REDUCTION_NONE ? 1.f : s.upstream * s.inv_denominator;
  s.zero = 0.f;
  s.one = 1.f;
  *a.scalars = s;
}

__global__ void reduce_loss_kernel(const float* token_loss, int64_t n, const CallScalars* scalars,
                                   float* loss) {
  __shared__ float scratch[32];
  float sum = 0.f;
  for (int64_t t = threadIdx.x; t < n; t += blockDim.x) sum += token_loss[t];
  sum = block_reduce(sum, Sum{}, 0.f, scratch);
  if (threadIdx.x == 0) *loss = sum * scalars->inv_denominator;
}

__global__ void deferred_scalars_kernel(const float* alpha, const float* scale, float* alpha_beta) {
  const float s = scale ? *scale : 1.f;
  alpha_beta[0] = *alpha * s;
  alpha_beta[1] = s;
}

template <typename T>
__global__ void column_sum_kernel(const T* grad, int64_t ld, int64_t rows, int64_t vocab,
                                  bool accumulate, const CallScalars* scalars, float* acc) {
  const float unscale = scalars->inv_grad_scale;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < vocab;
       j += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.f;
    for (int64_t r = 0; r < rows; ++r) sum += to_float(grad[r * ld + j]);
    sum *= unscale;
    acc[j] = accumulate ? acc[j] + sum : sum;
  }
}

template <typename T>
__global__ void store_vector_kernel(const float* acc, int64_t n, bool accumulate, T* out) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n;
       j += int64_t(gridDim.x) * blockDim.x)
    out[j] = from_float<T>(accumulate ? to_float(out[j]) + acc[j] : acc[j]);
}

__global__ void to_f32_kernel(const void* in, lmloss_dtype dtype, int64_t n, float* out) {
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n;
       j += int64_t(gridDim.x) * blockDim.x)
    out[j] = load_float(in, dtype, j);
}

// Row r's label for the one-hot term, -1 where it has none.
__device__ __forceinline__ int64_t label_of(const LabelRows& label, int64_t r) {
  const int64_t y = load_id(label.labels, label.labels_dtype, label.row0 + r);
  return y >= 0 && y < label.vocab ? y : -1;
}

// out[r, j] = in[r, j] * scale * row_scale[r] (+ coef[r] table[label, j]): blocks along y take
// rows, along x column groups of 4 (one 16- or 8-byte load and store) where every row is aligned
// for them, else single columns. A thread loads kScaleLoads groups before it stores any, so that
// more bytes are in flight than one load a thread keeps (one load a thread moved an f32 dW into
// bf16 at 3.3 TB/s on an H200).
constexpr int kScaleThreads = 256;
constexpr int kScaleLoads = 4;
template <typename TIn, typename TOut, int kWidth>
__global__ void __launch_bounds__(kScaleThreads)
    scale_rows_kernel(const TIn* in, int64_t in_ld, const float* scale, const float* row_scale, int64_t rows,
                      int64_t cols, TOut* out, int64_t out_ld, const LabelRows label,
                      const __nv_bfloat16* table, int64_t table_ld) {
  const int64_t groups = cols / kWidth;
  const int64_t step = int64_t(gridDim.x) * kScaleThreads * kScaleLoads;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float s = (scale ? *scale : 1.f) * (row_scale ? row_scale[r] : 1.f);
    const int64_t y = label.coef ? label_of(label, r) : -1;
    const float c = y >= 0 ? label.coef[r] : 0.f;
    const __nv_bfloat16* w = c != 0.f ? table + y * table_ld : nullptr;
    const Pack<TIn, kWidth>* src = reinterpret_cast<const Pack<TIn, kWidth>*>(in + r * in_ld);
    Pack<TOut, kWidth>* dst = reinterpret_cast<Pack<TOut, kWidth>*>(out + r * out_ld);
    for (int64_t g0 = int64_t(blockIdx.x) * kScaleThreads * kScaleLoads + threadIdx.x; g0 < groups; g0 += step) {
      Pack<TIn, kWidth> x[kScaleLoads];
#pragma unroll
      for (int u = 0; u < kScaleLoads; ++u)
        if (g0 + u * kScaleThreads < groups) x[u] = src[g0 + u * kScaleThreads];
#pragma unroll
      for (int u = 0; u < kScaleLoads; ++u) {
        const int64_t g = g0 + u * kScaleThreads;
        if (g >= groups) break;
        Pack<TOut, kWidth> v;
#pragma unroll
        for (int e = 0; e < kWidth; ++e) {
          float o = to_float(x[u].v[e]) * s;
          if (w) o = fmaf(c, __bfloat162float(w[g * kWidth + e]), o);
          v.v[e] = from_float<TOut>(o);
        }
        dst[g] = v;
      }
    }
  }
}

// The label order (see launch_label_order): keys (the label, or vocab for none) and token indices,
// sorted by key, stably.
struct LabelOrder {
  uint32_t* keys_in;
  uint32_t* keys;
  int32_t* tokens_in;
  int32_t* tokens;
  void* sort_scratch;  // label_order_bytes' rest
};

// The sort's scratch for n keys of up to 32 bits (enough for fewer); 0 where the query fails.
size_t sort_scratch_bytes(int n) {
  size_t bytes = 0;
  const cudaError_t e = cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n);
  return e == cudaSuccess ? bytes : 0;
}

// One of the order's four vectors of n_tokens 32-bit values, rounded to 256 bytes.
size_t label_vector_bytes(int64_t n_tokens) { return align256(sizeof(uint32_t) * size_t(n_tokens)); }

// The pieces of the order's workspace: the four vectors, then the sort's scratch.
LabelOrder label_order_at(const void* workspace, int64_t n_tokens) {
  const size_t vec = label_vector_bytes(n_tokens);
  char* base = static_cast<char*>(const_cast<void*>(workspace));
  LabelOrder o;
  o.keys_in = reinterpret_cast<uint32_t*>(base);
  o.keys = reinterpret_cast<uint32_t*>(base + vec);
  o.tokens_in = reinterpret_cast<int32_t*>(base + 2 * vec);
  o.tokens = reinterpret_cast<int32_t*>(base + 3 * vec);
  o.sort_scratch = base + 4 * vec;
  return o;
}

__global__ void label_keys_kernel(const void* labels, lmloss_dtype labels_dtype, int64_t n_tokens, int64_t vocab,
                                  uint32_t* keys, int32_t* tokens) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < n_tokens; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t y = load_id(labels, labels_dtype, t);
    keys[t] = uint32_t(y >= 0 && y < vocab ? y : vocab);
    tokens[t] = int32_t(t);
  }
}

// One block per position of the order: the first of a label's tokens in the chunk sums the
// chunk's tokens of that label (adjacent in the order, in token order) and adds them to out's row
// of the label, rounding once. kWidth columns per thread at a time (8: one 16-byte load of x)
// where every row is aligned for it (a first version, a warp per label and one column per lane
// at a time, waited on its loads).
constexpr int kLabelThreads = 128;

// Adds sum to kWidth values of a dW row from column j, rounding once into TOut; or, where the row
// has rests (a kept pair beside a bf16 dW), into its values and their rests.
template <typename TOut, int kWidth>
__device__ __forceinline__ void add_to_weight_row(TOut* row, int8_t* rest_row, int64_t j, const float (&sum)[kWidth]) {
  Pack<TOut, kWidth>* at = reinterpret_cast<Pack<TOut, kWidth>*>(row + j);
  Pack<TOut, kWidth> ov = *at;
  if constexpr (std::is_same_v<TOut, __nv_bfloat16>) {
    if (rest_row) {
#pragma unroll
      for (int e = 0; e < kWidth; ++e) {
        const core::RestPair pair = core::rest_split(core::rest_join(to_float(ov.v[e]), rest_row[j + e]) + sum[e]);
        ov.v[e] = __ushort_as_bfloat16(pair.hi);
        rest_row[j + e] = pair.rest;
      }
      *at = ov;
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < kWidth; ++e) ov.v[e] = from_float<TOut>(to_float(ov.v[e]) + sum[e]);
  *at = ov;
}

template <typename TOut, int kWidth>
__global__ void __launch_bounds__(kLabelThreads)
    add_label_rows_kernel(const uint32_t* keys, const int32_t* tokens, int64_t n_tokens, const LabelRows label,
                          int64_t rows, const __nv_bfloat16* __restrict__ x, int64_t x_ld, int64_t cols,
                          TOut* __restrict__ out, int64_t out_ld, TOut* __restrict__ tail, int64_t tail_ld,
                          int64_t split, int8_t* __restrict__ rests, int64_t rests_ld) {
  const int64_t end = label.row0 + rows;
  for (int64_t p = blockIdx.x; p < n_tokens; p += gridDim.x) {
    const uint32_t key = keys[p];
    const int64_t token = tokens[p];
    if (key >= uint64_t(label.vocab) || token < label.row0 || token >= end) continue;
    if (p > 0 && keys[p - 1] == key && tokens[p - 1] >= label.row0) continue;  // not the first
    int64_t last = p;
    while (last + 1 < n_tokens && keys[last + 1] == key && tokens[last + 1] < end) ++last;
    TOut* o = key < split ? out + int64_t(key) * out_ld : tail + (int64_t(key) - split) * tail_ld;
    int8_t* rest_row = rests ? rests + int64_t(key) * rests_ld : nullptr;
    for (int64_t j = int64_t(threadIdx.x) * kWidth; j < cols; j += int64_t(blockDim.x) * kWidth) {
      float sum[kWidth] = {};
      for (int64_t q = p; q <= last; ++q) {
        const int64_t r = tokens[q] - label.row0;
        const float c = label.coef[r];
        const Pack<__nv_bfloat16, kWidth> xv = *reinterpret_cast<const Pack<__nv_bfloat16, kWidth>*>(x + r * x_ld + j);
#pragma unroll
        for (int e = 0; e < kWidth; ++e) sum[e] = fmaf(c, __bfloat162float(xv.v[e]), sum[e]);
      }
      add_to_weight_row<TOut, kWidth>(o, rest_row, j, sum);
    }
  }
}

// One block per position of the large entries' order (see launch_add_large_entries): the first
// slot of a column sums its slots' terms (adjacent in the order, tokens in order) and adds them to
// out's row of the column, rounding once; kWidth columns of X per thread at a time.
template <typename TOut, int kWidth>
__global__ void __launch_bounds__(kLabelThreads)
    add_large_entries_kernel(const uint32_t* cols, const int32_t* slots, const LargeEntries entries, int64_t n,
                             const LargeEntriesTerms terms, TOut* __restrict__ out, int64_t out_ld,
                             TOut* __restrict__ tail, int64_t tail_ld, int64_t split, int8_t* __restrict__ rests,
                             int64_t rests_ld) {
  const auto* x = static_cast<const __nv_bfloat16*>(terms.x);
  const float token_scale = terms.scalars->token_scale;
  for (int64_t p = blockIdx.x; p < n; p += gridDim.x) {
    const uint32_t col = cols[p];
    // The slots of no column sort after every column: most slots are such (1024 blocks walking
    // them one load after another took 19.6 us a chunk at llama3-8b, with nothing to add).
    if (col >= uint64_t(terms.vocab)) break;
    if (p > 0 && cols[p - 1] == col) continue;
    int64_t last = p;
    while (last + 1 < n && cols[last + 1] == col) ++last;
    TOut* o = col < split ? out + int64_t(col) * out_ld : tail + (int64_t(col) - split) * tail_ld;
    int8_t* rest_row = rests ? rests + int64_t(col) * rests_ld : nullptr;
    for (int64_t j = int64_t(threadIdx.x) * kWidth; j < terms.cols; j += int64_t(blockDim.x) * kWidth) {
      float sum[kWidth] = {};
      for (int64_t q = p; q <= last; ++q) {
        const int64_t slot = slots[q], t = slot / kLargeEntries;
        const float c = entries.coefs[slot];
        const float product_coef = token_scale * entries.stored[slot];
        const float row_scale = entries.row_scale[t];
        using Row = Pack<__nv_bfloat16, kWidth>;
        const Row xv = *reinterpret_cast<const Row*>(x + t * terms.x_ld + j);
#pragma unroll
        for (int e = 0; e < kWidth; ++e) {
          const float xe = __bfloat162float(xv.v[e]);
          const float staged = __bfloat162float(from_float<__nv_bfloat16>(xe * row_scale));  // as scale_rows_kernel
          sum[e] += fmaf(c, xe, -product_coef * staged);
        }
      }
      add_to_weight_row<TOut, kWidth>(o, rest_row, j, sum);
    }
  }
}

// Row 0 of a 16-bit dW summed in f32 over its own bytes (launch_regroup_rows), the one row whose
// f32 and 16-bit values share bytes: one block walks it in steps, each read whole before any of it
// is written, up the row when narrowing and down when widening, so that no step writes over values
// a later one reads.
constexpr int kFirstRowThreads = 256;
template <typename T16, int kWidth, bool kNarrow>
__global__ void __launch_bounds__(kFirstRowThreads) regroup_first_row_kernel(void* base, int64_t cols,
                                                                             const float* scale) {
  float* wide = static_cast<float*>(base);
  T16* narrow = static_cast<T16*>(base);
  const float by = kNarrow && scale ? *scale : 1.0f;
  constexpr int64_t kStep = int64_t(kFirstRowThreads) * kWidth;
  const int64_t steps = (cols + kStep - 1) / kStep;
  for (int64_t i = 0; i < steps; ++i) {
    const int64_t j = (kNarrow ? i : steps - 1 - i) * kStep + int64_t(threadIdx.x) * kWidth;
    const bool mine = j < cols;  // kWidth divides cols
    Pack<float, kWidth> v;
    if (mine) {
      if constexpr (kNarrow) {
        v = *reinterpret_cast<const Pack<float, kWidth>*>(wide + j);
      } else {
        const Pack<T16, kWidth> h = *reinterpret_cast<const Pack<T16, kWidth>*>(narrow + j);
#pragma unroll
        for (int e = 0; e < kWidth; ++e) v.v[e] = to_float(h.v[e]);
      }
    }
    __syncthreads();
    if (mine) {
      if constexpr (kNarrow) {
        Pack<T16, kWidth> h;
#pragma unroll
        for (int e = 0; e < kWidth; ++e) h.v[e] = from_float<T16>(v.v[e] * by);
        *reinterpret_cast<Pack<T16, kWidth>*>(narrow + j) = h;
      } else {
        *reinterpret_cast<Pack<float, kWidth>*>(wide + j) = v;
      }
    }
    __syncthreads();
  }
}

// One warp per row: the row's shift (see ExpShiftArgs).
constexpr int kShiftRowsPerBlock = 8;
__global__ void __launch_bounds__(32 * kShiftRowsPerBlock) exp_shift_kernel(const ExpShiftArgs a) {
  const int64_t r = blockIdx.x * int64_t(kShiftRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= a.rows) return;
  const int64_t t = a.row0 + r;
  int64_t id = -1;
  if (a.labels && is_counted(a.labels, a.labels_dtype, a.ignore_index, a.mask, t)) id = load_id(a.labels, a.labels_dtype, t);
  if ((id < 0 || id >= a.vocab) && a.teacher_ids && !(a.mask && a.mask[t] == 0))
    id = load_id(a.teacher_ids, a.teacher_ids_dtype, t * a.teacher_ids_ld);
  if (id < 0 || id >= a.vocab) {  // no gradient: values relative to the tile maxima, scale 0
    if (lane == 0) a.shift[r] = -INFINITY;
    return;
  }
  // bf16 rows of 8-element multiples on 16-byte boundaries (what the product path requires).
  const auto* x = static_cast<const __nv_bfloat16*>(a.hidden) + r * a.hidden_ld;
  const auto* w = static_cast<const __nv_bfloat16*>(a.weight) + id * a.weight_ld;
  const float dot = warp_dot(x, w, a.hidden_size);
  if (lane == 0) a.shift[r] = dot * a.inv_temperature;
}

// One warp per row (see FoldSliceArgs): each lane takes whole 32-tile words of the slice.
constexpr int kFoldRowsPerBlock = 8;
__global__ void __launch_bounds__(32 * kFoldRowsPerBlock) fold_slice_kernel(const FoldSliceArgs a) {
  const int64_t r = blockIdx.x * int64_t(kFoldRowsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= a.rows) return;
  const float shift = a.shift[r];
  const float4* partial = a.partial + r * a.partial_ld;
  auto* stored = static_cast<__nv_bfloat16*>(a.stored) + r * a.stored_ld;
  MaxSum acc{-INFINITY, 0.f};
  float sum_s = 0.f;
  const int64_t words = (a.tiles + 31) / 32;
  for (int64_t w = lane; w < words; w += 32) {
    uint32_t bits = 0;
    for (int b = 0; b < 32; ++b) {
      const int64_t t = w * 32 + b;
      if (t >= a.tiles) break;
      const float4 p = partial[t];
      acc = merge(acc, MaxSum{p.x, p.y});
      sum_s += p.z;
      // The product stored this tile relative to max(shift, p.x - margin) (its epilogue's
      // reference, the same operations): anything but the shift cannot go into this dX.
      if (shift != -INFINITY && p.x - kExpFormMargin > shift) {
        bits |= 1u << b;
        const int64_t end = min((t + 1) * kRowStatsTileColumns, a.columns);
        for (int64_t j = t * kRowStatsTileColumns; j < end; ++j) stored[j] = __float2bfloat16(0.f);
      }
    }
    a.flags[r * a.flags_ld + a.first_word + w] = bits;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    acc = merge(acc, MaxSum{__shfl_xor_sync(0xffffffffu, acc.max, offset), __shfl_xor_sync(0xffffffffu, acc.sum, offset)});
    sum_s += __shfl_xor_sync(0xffffffffu, sum_s, offset);
  }
  // The butterfly's lanes may differ in the last bit (see block_reduce_maxsum): lane 0's counts.
  if (lane == 0) a.folded[r * a.folded_ld + a.slice] = make_float4(acc.max, acc.sum, sum_s, 0.f);
}

// One block per row with a coefficient; its flagged tiles in order (see FlaggedTilesArgs).
constexpr int kFlaggedThreads = 256;
__global__ void __launch_bounds__(kFlaggedThreads) add_flagged_tiles_kernel(const FlaggedTilesArgs a) {
  __shared__ float p[kRowStatsTileColumns];
  const int warp = threadIdx.x / 32, warps = kFlaggedThreads / 32;
  const auto* weight = static_cast<const __nv_bfloat16*>(a.weight);
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const float coef = a.row_coef[r];
    if (coef == 0.f) continue;
    const float lse = a.row_lse[r];
    const auto* x = static_cast<const __nv_bfloat16*>(a.hidden) + r * a.hidden_ld;
    float* dx = a.dx + r * a.hidden_size;
    for (int64_t w = 0; w < a.flags_ld; ++w) {
      for (uint32_t bits = a.flags[r * a.flags_ld + w]; bits != 0; bits &= bits - 1) {
        const int64_t j0 = (w * 32 + __ffs(bits) - 1) * kRowStatsTileColumns;
        const int n = int(min(kRowStatsTileColumns, a.vocab - j0));
        for (int c = warp; c < n; c += warps) {
          const float dot = warp_dot(x, weight + (j0 + c) * a.weight_ld, a.hidden_size);
          if ((threadIdx.x & 31) == 0) p[c] = coef * expf(dot * a.inv_temperature - lse);
        }
        __syncthreads();
        for (int64_t h = threadIdx.x; h < a.hidden_size; h += kFlaggedThreads) {
          float sum = dx[h];
          for (int c = 0; c < n; ++c) sum = fmaf(p[c], __bfloat162float(weight[(j0 + c) * a.weight_ld + h]), sum);
          dx[h] = sum;
        }
        __syncthreads();  // p is written again for the next tile
      }
    }
  }
}

unsigned int flat_grid(int64_t n, int threads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

template <typename TIn, typename TOut>
lmloss_status launch_rows_typed(const LossRowsArgs& args, cudaStream_t stream) {
  const int threads = stats_from_product(args.work) ? kProductRowThreads : kRowThreads;
  if (const int64_t keys = entry_sort_keys(args); keys > 0) {
    entry_order_kernel<<<row_grid(args.rows), kOrderThreads, sizeof(uint64_t) * size_t(keys), stream>>>(args);
    LMLOSS_CUDA_LAUNCHED("entry_order_kernel");
  }
  loss_rows_kernel<TIn, TOut><<<row_grid(args.rows), threads, 0, stream>>>(args);
  LMLOSS_CUDA_LAUNCHED("loss_rows_kernel");
  return LMLOSS_SUCCESS;
}

// The bits of keys up to `vocab` (a radix sort's end bit).
int key_bits(int64_t vocab) {
  int bits = 1;
  while (bits < 32 && (uint64_t(1) << bits) <= uint64_t(vocab)) ++bits;
  return bits;
}

// Whether dW's rows (and tail) and the bf16 rows read beside them (pointer and row stride, cols
// wide) line up for 8-wide access.
bool rows_take_vectors(const WeightGradRows& out, int64_t vocab, int64_t cols,
                       std::initializer_list<std::pair<const void*, int64_t>> inputs) {
  const size_t out_size = core::dtype_size(out.dtype);
  auto lines_up = [](const void* p, int64_t ld, size_t size) {
    return ld % 8 == 0 && reinterpret_cast<uintptr_t>(p) % (8 * size) == 0;
  };
  bool vector = cols % 8 == 0 && lines_up(out.rows, out.ld, out_size) &&
                (out.split >= vocab || lines_up(out.tail, out.tail_ld, out_size));
  for (const auto& [p, ld] : inputs) vector = vector && lines_up(p, ld, sizeof(__nv_bfloat16));
  return vector;
}

// Calls launch with dW's rows typed as its dtype (f32, bf16 or f16).
template <typename F>
lmloss_status with_weight_grad_type(const WeightGradRows& out, F&& launch) {
  switch (out.dtype) {
    case LMLOSS_F32: launch(static_cast<float*>(out.rows)); return LMLOSS_SUCCESS;
    case LMLOSS_BF16: launch(static_cast<__nv_bfloat16*>(out.rows)); return LMLOSS_SUCCESS;
    case LMLOSS_F16: launch(static_cast<__half*>(out.rows)); return LMLOSS_SUCCESS;
    default: return core::fail(LMLOSS_ERROR_UNSUPPORTED, "CUDA: unsupported output dtype");
  }
}

}  // namespace

lmloss_status launch_loss_rows(const LossRowsArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return LMLOSS_SUCCESS;
  // Without gradients the output type is unused; pair it with the input.
  const lmloss_dtype out = forms_gradient(args.work) ? args.grad_dtype : args.logits_dtype;
  switch (args.logits_dtype) {
    case LMLOSS_F32:
      switch (out) {
        case LMLOSS_F32: return launch_rows_typed<float, float>(args, stream);
        case LMLOSS_BF16: return launch_rows_typed<float, __nv_bfloat16>(args, stream);
        case LMLOSS_F16: return launch_rows_typed<float, __half>(args, stream);
        default: break;
      }
      break;
    case LMLOSS_BF16:
      if (out == LMLOSS_BF16) return launch_rows_typed<__nv_bfloat16, __nv_bfloat16>(args, stream);
      break;
    case LMLOSS_F16:
      if (out == LMLOSS_F16) return launch_rows_typed<__half, __half>(args, stream);
      break;
    default: break;
  }
  return core::fail(LMLOSS_ERROR_UNSUPPORTED, "CUDA: unsupported logits/gradient dtype pair");
}

lmloss_status launch_prepare(const PrepareArgs& args, cudaStream_t stream) {
  prepare_kernel<<<1, kReduceThreads, 0, stream>>>(args);
  LMLOSS_CUDA_LAUNCHED("prepare_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_reduce_loss(const float* token_loss, int64_t n_tokens,
                                 const CallScalars* scalars, float* loss, cudaStream_t stream) {
  reduce_loss_kernel<<<1, kReduceThreads, 0, stream>>>(token_loss, n_tokens, scalars, loss);
  LMLOSS_CUDA_LAUNCHED("reduce_loss_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_deferred_scalars(const float* alpha, const float* scale, float* alpha_beta, cudaStream_t stream) {
  deferred_scalars_kernel<<<1, 1, 0, stream>>>(alpha, scale, alpha_beta);
  LMLOSS_CUDA_LAUNCHED("deferred_scalars_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_column_sum(const void* grad, int64_t grad_ld, lmloss_dtype grad_dtype,
                                int64_t rows, int64_t vocab, bool accumulate,
                                const CallScalars* scalars, float* acc, cudaStream_t stream) {
  const unsigned int grid = flat_grid(vocab, 256);
  switch (grad_dtype) {
    case LMLOSS_F32:
      column_sum_kernel<<<grid, 256, 0, stream>>>(static_cast<const float*>(grad), grad_ld, rows,
                                                   vocab, accumulate, scalars, acc);
      break;
    case LMLOSS_BF16:
      column_sum_kernel<<<grid, 256, 0, stream>>>(static_cast<const __nv_bfloat16*>(grad), grad_ld,
                                                   rows, vocab, accumulate, scalars, acc);
      break;
    case LMLOSS_F16:
      column_sum_kernel<<<grid, 256, 0, stream>>>(static_cast<const __half*>(grad), grad_ld, rows,
                                                   vocab, accumulate, scalars, acc);
      break;
    default: return core::fail(LMLOSS_ERROR_UNSUPPORTED, "CUDA: unsupported gradient dtype");
  }
  LMLOSS_CUDA_LAUNCHED("column_sum_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_to_f32(const void* in, lmloss_dtype dtype, int64_t n, float* out,
                            cudaStream_t stream) {
  to_f32_kernel<<<flat_grid(n, 256), 256, 0, stream>>>(in, dtype, n, out);
  LMLOSS_CUDA_LAUNCHED("to_f32_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_store_vector(const float* acc, int64_t n, bool accumulate, void* out,
                                  lmloss_dtype out_dtype, cudaStream_t stream) {
  const unsigned int grid = flat_grid(n, 256);
  switch (out_dtype) {
    case LMLOSS_F32:
      store_vector_kernel<<<grid, 256, 0, stream>>>(acc, n, accumulate, static_cast<float*>(out));
      break;
    case LMLOSS_BF16:
      store_vector_kernel<<<grid, 256, 0, stream>>>(acc, n, accumulate,
                                                     static_cast<__nv_bfloat16*>(out));
      break;
    case LMLOSS_F16:
      store_vector_kernel<<<grid, 256, 0, stream>>>(acc, n, accumulate, static_cast<__half*>(out));
      break;
    default: return core::fail(LMLOSS_ERROR_UNSUPPORTED, "CUDA: unsupported output dtype");
  }
  LMLOSS_CUDA_LAUNCHED("store_vector_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_scale_rows(const void* in, lmloss_dtype in_dtype, int64_t in_ld, const float* scale,
                                const float* row_scale, int64_t rows, int64_t cols, void* out,
                                int64_t out_ld, lmloss_dtype out_dtype, cudaStream_t stream,
                                const LabelRows& label, const void* table, int64_t table_ld) {
  if (rows == 0 || cols == 0) return LMLOSS_SUCCESS;
  const size_t in_size = core::dtype_size(in_dtype), out_size = core::dtype_size(out_dtype);
  const bool vector = cols % 4 == 0 && in_ld % 4 == 0 && out_ld % 4 == 0 &&
                      reinterpret_cast<uintptr_t>(in) % (4 * in_size) == 0 &&
                      reinterpret_cast<uintptr_t>(out) % (4 * out_size) == 0;
  const int64_t groups = vector ? cols / 4 : cols;
  const int64_t per_block = int64_t(kScaleThreads) * kScaleLoads;
  const dim3 grid(unsigned(std::min<int64_t>((groups + per_block - 1) / per_block, 1024)),
                  unsigned(std::min<int64_t>(rows, 65535)));
  auto launch = [&](auto* typed_in, auto* typed_out) {
    using TIn = std::remove_const_t<std::remove_pointer_t<decltype(typed_in)>>;
    using TOut = std::remove_pointer_t<decltype(typed_out)>;
    const auto* w = static_cast<const __nv_bfloat16*>(table);
    if (vector)
      scale_rows_kernel<TIn, TOut, 4><<<grid, kScaleThreads, 0, stream>>>(
          typed_in, in_ld, scale, row_scale, rows, cols, typed_out, out_ld, label, w, table_ld);
    else
      scale_rows_kernel<TIn, TOut, 1><<<grid, kScaleThreads, 0, stream>>>(
          typed_in, in_ld, scale, row_scale, rows, cols, typed_out, out_ld, label, w, table_ld);
  };
  auto with_out = [&](auto* typed_in) -> lmloss_status {
    switch (out_dtype) {
      case LMLOSS_F32: launch(typed_in, static_cast<float*>(out)); break;
      case LMLOSS_BF16: launch(typed_in, static_cast<__nv_bfloat16*>(out)); break;
      case LMLOSS_F16: launch(typed_in, static_cast<__half*>(out)); break;
      default: return core::fail(LMLOSS_ERROR_UNSUPPORTED, "CUDA: unsupported output dtype");
    }
    LMLOSS_CUDA_LAUNCHED("scale_rows_kernel");
    return LMLOSS_SUCCESS;
  };
  switch (in_dtype) {
    case LMLOSS_F32: return with_out(static_cast<const float*>(in));
    case LMLOSS_BF16: return with_out(static_cast<const __nv_bfloat16*>(in));
    case LMLOSS_F16: return with_out(static_cast<const __half*>(in));
    default: return core::fail(LMLOSS_ERROR_UNSUPPORTED, "CUDA: unsupported input dtype for a row scaling");
  }
}

size_t label_order_bytes(int64_t n_tokens) {
  if (n_tokens <= 0 || n_tokens > std::numeric_limits<int32_t>::max()) return 0;
  const size_t scratch = sort_scratch_bytes(int(n_tokens));
  return scratch > 0 ? 4 * label_vector_bytes(n_tokens) + scratch : 0;
}

lmloss_status launch_label_order(const void* labels, lmloss_dtype labels_dtype, int64_t n_tokens,
                                 int64_t vocab, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const LabelOrder o = label_order_at(workspace, n_tokens);
  const unsigned blocks = unsigned(std::min<int64_t>((n_tokens + 255) / 256, 1024));
  label_keys_kernel<<<blocks, 256, 0, stream>>>(labels, labels_dtype, n_tokens, vocab, o.keys_in, o.tokens_in);
  LMLOSS_CUDA_LAUNCHED("label_keys_kernel");
  size_t scratch = workspace_bytes - 4 * label_vector_bytes(n_tokens);  // no second query per call
  LMLOSS_CUDA_TRY(cub::DeviceRadixSort::SortPairs(o.sort_scratch, scratch, o.keys_in, o.keys, o.tokens_in,
                                                    o.tokens, int(n_tokens), 0, key_bits(vocab), stream));
  return LMLOSS_SUCCESS;
}

lmloss_status launch_add_label_rows(const void* workspace, int64_t n_tokens, const LabelRows& label,
                                    int64_t rows, const void* x, int64_t x_ld, int64_t cols,
                                    const WeightGradRows& out, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return LMLOSS_SUCCESS;
  const LabelOrder o = label_order_at(workspace, n_tokens);
  const unsigned blocks = unsigned(std::min<int64_t>(n_tokens, 1 << 20));
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  const bool vector = rows_take_vectors(out, label.vocab, cols, {{x, x_ld}});
  const lmloss_status status = with_weight_grad_type(out, [&](auto* typed_out) {
    using TOut = std::remove_pointer_t<decltype(typed_out)>;
    auto* tail = static_cast<TOut*>(out.tail);
    if (vector)
      add_label_rows_kernel<TOut, 8><<<blocks, kLabelThreads, 0, stream>>>(
          o.keys, o.tokens, n_tokens, label, rows, xb, x_ld, cols, typed_out, out.ld, tail, out.tail_ld, out.split,
          out.rests, out.rests_ld);
    else
      add_label_rows_kernel<TOut, 1><<<blocks, kLabelThreads, 0, stream>>>(
          o.keys, o.tokens, n_tokens, label, rows, xb, x_ld, cols, typed_out, out.ld, tail, out.tail_ld, out.split,
          out.rests, out.rests_ld);
  });
  if (status != LMLOSS_SUCCESS) return status;
  LMLOSS_CUDA_LAUNCHED("add_label_rows_kernel");
  return LMLOSS_SUCCESS;
}

size_t large_entries_bytes(int64_t tokens) {
  const int64_t slots = tokens * kLargeEntries;
  if (tokens <= 0 || slots > std::numeric_limits<int32_t>::max()) return 0;
  // The sort runs on buffers given in pairs (its scratch then holds no copies of them).
  cub::DoubleBuffer<uint32_t> cols(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> order(nullptr, nullptr);
  size_t sort = 0;
  if (cub::DeviceRadixSort::SortPairs(nullptr, sort, cols, order, int(slots)) != cudaSuccess) return 0;
  return 6 * label_vector_bytes(slots) + label_vector_bytes(tokens) + sort;
}

LargeEntries large_entries_at(void* workspace, size_t bytes, int64_t tokens) {
  const size_t vec = label_vector_bytes(tokens * kLargeEntries);
  char* base = static_cast<char*>(workspace);
  LargeEntries e;
  e.cols = reinterpret_cast<uint32_t*>(base);
  e.coefs = reinterpret_cast<float*>(base + vec);
  e.stored = reinterpret_cast<float*>(base + 2 * vec);
  e.slots = reinterpret_cast<int32_t*>(base + 3 * vec);
  e.sorted_cols = reinterpret_cast<uint32_t*>(base + 4 * vec);
  e.sorted_slots = reinterpret_cast<int32_t*>(base + 5 * vec);
  e.row_scale = reinterpret_cast<float*>(base + 6 * vec);
  const size_t taken = 6 * vec + label_vector_bytes(tokens);
  e.sort_scratch = base + taken;
  e.sort_scratch_bytes = bytes - taken;
  return e;
}

lmloss_status launch_clear_large_entries(const LargeEntries& entries, int64_t tokens, cudaStream_t stream) {
  LMLOSS_CUDA_TRY(cudaMemsetAsync(entries.cols, 0xff, sizeof(uint32_t) * size_t(tokens * kLargeEntries), stream));
  return LMLOSS_SUCCESS;
}

lmloss_status launch_add_large_entries(const LargeEntries& entries, const LargeEntriesTerms& terms,
                                       const WeightGradRows& out, cudaStream_t stream) {
  if (terms.tokens == 0 || terms.cols == 0) return LMLOSS_SUCCESS;
  const int n = int(terms.tokens * kLargeEntries);
  size_t scratch = entries.sort_scratch_bytes;
  // The sort leaves its result in either buffer of each pair (which one is known here, on the host).
  // Columns below vocab, so the sort takes only the bits of vocab (17 at V 128256: 3 passes, not 4),
  // in which the column of none (all bits) still sorts last.
  cub::DoubleBuffer<uint32_t> cols(entries.cols, entries.sorted_cols);
  cub::DoubleBuffer<int32_t> slots(entries.slots, entries.sorted_slots);
  LMLOSS_CUDA_TRY(
      cub::DeviceRadixSort::SortPairs(entries.sort_scratch, scratch, cols, slots, n, 0, key_bits(terms.vocab), stream));
  const unsigned blocks = unsigned(std::min<int64_t>(n, 1024));
  const bool vector = rows_take_vectors(out, terms.vocab, terms.cols, {{terms.x, terms.x_ld}});
  const lmloss_status status = with_weight_grad_type(out, [&](auto* typed_out) {
    using TOut = std::remove_pointer_t<decltype(typed_out)>;
    auto* tail = static_cast<TOut*>(out.tail);
    if (vector)
      add_large_entries_kernel<TOut, 8><<<blocks, kLabelThreads, 0, stream>>>(
          cols.Current(), slots.Current(), entries, n, terms, typed_out, out.ld, tail, out.tail_ld, out.split,
          out.rests, out.rests_ld);
    else
      add_large_entries_kernel<TOut, 1><<<blocks, kLabelThreads, 0, stream>>>(
          cols.Current(), slots.Current(), entries, n, terms, typed_out, out.ld, tail, out.tail_ld, out.split,
          out.rests, out.rests_ld);
  });
  if (status != LMLOSS_SUCCESS) return status;
  LMLOSS_CUDA_LAUNCHED("add_large_entries_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_regroup_rows(void* base, lmloss_dtype dtype, int64_t rows, int64_t cols, int64_t ld,
                                  bool narrow, const float* scale, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return LMLOSS_SUCCESS;
  if (dtype != LMLOSS_BF16 && dtype != LMLOSS_F16)
    return core::fail(LMLOSS_ERROR_INTERNAL, "regrouping rows: bf16 or f16 only");
  auto* bytes = static_cast<char*>(base);
  auto first_row = [&]() -> lmloss_status {
    const bool vector = cols % 4 == 0 && reinterpret_cast<uintptr_t>(base) % 16 == 0;
    auto with_type = [&](auto typed) {
      using T16 = decltype(typed);
      auto launch = [&](auto kernel) { kernel<<<1, kFirstRowThreads, 0, stream>>>(base, cols, scale); };
      if (vector) launch(narrow ? regroup_first_row_kernel<T16, 4, true> : regroup_first_row_kernel<T16, 4, false>);
      else launch(narrow ? regroup_first_row_kernel<T16, 1, true> : regroup_first_row_kernel<T16, 1, false>);
    };
    if (dtype == LMLOSS_BF16) with_type(__nv_bfloat16{});
    else with_type(__half{});
    LMLOSS_CUDA_LAUNCHED("regroup_first_row_kernel");
    return LMLOSS_SUCCESS;
  };
  // Rows [a, b) with b <= 2a: narrowing row u writes over f32 row u / 2 and widening it over
  // 16-bit rows 2u and 2u + 1, so within such a wave no row's values go over another's of the same
  // wave, and the rows' own rounding (launch_scale_rows) takes them. The waves run [1, 2), [2, 4),
  // ... upwards after row 0 to narrow, downwards before it to widen: none writes what a later one
  // reads.
  const size_t size16 = core::dtype_size(dtype);
  auto wave = [&](int64_t a, int64_t b) {
    char* wide = bytes + a * ld * int64_t(sizeof(float));
    char* narrowed = bytes + a * ld * int64_t(size16);
    return narrow ? launch_scale_rows(wide, LMLOSS_F32, ld, scale, nullptr, b - a, cols, narrowed, ld, dtype, stream)
                  : launch_scale_rows(narrowed, dtype, ld, nullptr, nullptr, b - a, cols, wide, ld, LMLOSS_F32, stream);
  };
  std::vector<int64_t> starts;
  for (int64_t a = 1; a < rows; a *= 2) starts.push_back(a);
  if (narrow) {
    LMLOSS_CHECK(first_row());
    for (const int64_t a : starts) LMLOSS_CHECK(wave(a, std::min(2 * a, rows)));
  } else {
    for (auto a = starts.rbegin(); a != starts.rend(); ++a) LMLOSS_CHECK(wave(*a, std::min(2 * *a, rows)));
    LMLOSS_CHECK(first_row());
  }
  return LMLOSS_SUCCESS;
}

namespace {

// A kept pair's rows (rows x cols): a block a row, grid-strided over the rows, kWidth values a
// thread at a time (8: 16 bytes of values, 8 of rests, 32 of an f32 product) where every row is
// aligned for it. (A first form, a thread a value with a 64-bit division for its row and column,
// left llama3-8b's step on an H100 ~2.5 ms slower with the rounding than with the deferred store,
// where an f32 sum's two were level: run 76.)
constexpr int kRestThreads = 256;

template <int kWidth>
__global__ void __launch_bounds__(kRestThreads)
    fold_rests_kernel(const float* __restrict__ product, int64_t rows, int64_t cols, bool add,
                      __nv_bfloat16* __restrict__ values, int64_t values_ld, int8_t* __restrict__ rests,
                      int64_t rests_ld) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    for (int64_t j = int64_t(threadIdx.x) * kWidth; j < cols; j += int64_t(blockDim.x) * kWidth) {
      auto* value = reinterpret_cast<Pack<__nv_bfloat16, kWidth>*>(values + r * values_ld + j);
      auto* rest = reinterpret_cast<Pack<int8_t, kWidth>*>(rests + r * rests_ld + j);
      const Pack<float, kWidth> p = *reinterpret_cast<const Pack<float, kWidth>*>(product + r * cols + j);
      Pack<__nv_bfloat16, kWidth> v = *value;
      Pack<int8_t, kWidth> q = *rest;
#pragma unroll
      for (int e = 0; e < kWidth; ++e) {
        const float s = add ? p.v[e] + core::rest_join(__bfloat162float(v.v[e]), q.v[e]) : p.v[e];
        const core::RestPair pair = core::rest_split(s);
        v.v[e] = __ushort_as_bfloat16(pair.hi);
        q.v[e] = pair.rest;
      }
      *value = v;
      *rest = q;
    }
  }
}

template <int kWidth>
__global__ void __launch_bounds__(kRestThreads)
    round_rests_kernel(__nv_bfloat16* __restrict__ values, int64_t values_ld, const int8_t* __restrict__ rests,
                       int64_t rests_ld, int64_t rows, int64_t cols, const float* scale) {
  const float by = scale ? *scale : 1.f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    for (int64_t j = int64_t(threadIdx.x) * kWidth; j < cols; j += int64_t(blockDim.x) * kWidth) {
      auto* value = reinterpret_cast<Pack<__nv_bfloat16, kWidth>*>(values + r * values_ld + j);
      const Pack<int8_t, kWidth> q = *reinterpret_cast<const Pack<int8_t, kWidth>*>(rests + r * rests_ld + j);
      Pack<__nv_bfloat16, kWidth> v = *value;
#pragma unroll
      for (int e = 0; e < kWidth; ++e)
        v.v[e] = __ushort_as_bfloat16(core::rest_bf16_bits(by * core::rest_join(__bfloat162float(v.v[e]), q.v[e])));
      *value = v;
    }
  }
}

// Whether a pair's rows (and an f32 product's, dense) take 8 values at a time.
bool rests_take_vectors(const void* values, int64_t values_ld, const void* rests, int64_t rests_ld, int64_t cols) {
  return cols % 8 == 0 && values_ld % 8 == 0 && rests_ld % 8 == 0 && reinterpret_cast<uintptr_t>(values) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(rests) % 8 == 0;
}

unsigned rest_blocks(int64_t rows) { return unsigned(std::min<int64_t>(rows, 1 << 20)); }

}  // namespace

lmloss_status launch_fold_rests(const float* product, int64_t rows, int64_t cols, bool add, void* values,
                                int64_t values_ld, int8_t* rests, int64_t rests_ld, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return LMLOSS_SUCCESS;
  auto* v = static_cast<__nv_bfloat16*>(values);
  const bool vector = rests_take_vectors(values, values_ld, rests, rests_ld, cols) &&
                      reinterpret_cast<uintptr_t>(product) % 32 == 0;
  if (vector)
    fold_rests_kernel<8><<<rest_blocks(rows), kRestThreads, 0, stream>>>(product, rows, cols, add, v, values_ld, rests,
                                                                         rests_ld);
  else
    fold_rests_kernel<1><<<rest_blocks(rows), kRestThreads, 0, stream>>>(product, rows, cols, add, v, values_ld, rests,
                                                                         rests_ld);
  LMLOSS_CUDA_LAUNCHED("fold_rests_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_round_rests(void* values, int64_t values_ld, const int8_t* rests, int64_t rests_ld, int64_t rows,
                                 int64_t cols, const float* scale, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return LMLOSS_SUCCESS;
  auto* v = static_cast<__nv_bfloat16*>(values);
  if (rests_take_vectors(values, values_ld, rests, rests_ld, cols))
    round_rests_kernel<8><<<rest_blocks(rows), kRestThreads, 0, stream>>>(v, values_ld, rests, rests_ld, rows, cols,
                                                                          scale);
  else
    round_rests_kernel<1><<<rest_blocks(rows), kRestThreads, 0, stream>>>(v, values_ld, rests, rests_ld, rows, cols,
                                                                          scale);
  LMLOSS_CUDA_LAUNCHED("round_rests_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_fold_slice(const FoldSliceArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return LMLOSS_SUCCESS;
  const unsigned blocks = unsigned((args.rows + kFoldRowsPerBlock - 1) / kFoldRowsPerBlock);
  fold_slice_kernel<<<blocks, 32 * kFoldRowsPerBlock, 0, stream>>>(args);
  LMLOSS_CUDA_LAUNCHED("fold_slice_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_add_flagged_tiles(const FlaggedTilesArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return LMLOSS_SUCCESS;
  add_flagged_tiles_kernel<<<row_grid(std::min<int64_t>(args.rows, 65536)), kFlaggedThreads, 0, stream>>>(args);
  LMLOSS_CUDA_LAUNCHED("add_flagged_tiles_kernel");
  return LMLOSS_SUCCESS;
}

lmloss_status launch_exp_shift(const ExpShiftArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return LMLOSS_SUCCESS;
  const unsigned blocks = unsigned((args.rows + kShiftRowsPerBlock - 1) / kShiftRowsPerBlock);
  exp_shift_kernel<<<blocks, 32 * kShiftRowsPerBlock, 0, stream>>>(args);
  LMLOSS_CUDA_LAUNCHED("exp_shift_kernel");
  return LMLOSS_SUCCESS;
}

}  // namespace lmloss::cuda
