// Radix top-k selection (see topk.cuh): histogram passes over order-preserving keys, a shared
// memory candidate sort, and a device-memory path for k beyond shared memory.
#include "cuda/topk.cuh"

#include <algorithm>
#include <climits>
#include <cmath>

#include <cub/device/device_segmented_radix_sort.cuh>
#include <cuda_pipeline.h>

#include "cuda/topk_keys.cuh"

namespace lmloss::cuda {
namespace {

constexpr int kTopkThreads = 512;
constexpr int kCapacity = 8192;  // candidates sorted in shared memory (64 KiB of keys)
constexpr int kBins = 2048;
// The rows kernel keeps rows in flight on each SM, one block's reads under another's sorts (at
// kTopkThreads it held 124 registers a thread, one block per SM); the L1/shared split must then
// leave room for three blocks' candidates, 3 x 73 KiB.
constexpr int kTopkRowsThreads = 256;
constexpr int kTopkRowsBlocksPerSM = 3;

// The least power of two at least n (n >= 1).
__host__ __device__ constexpr int64_t pow2_at_least(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// hist[bin] += 1 for each calling lane, one shared-memory atomic per distinct bin of the warp:
// candidates crowd a few of the top digit's bins (sign, exponent and two mantissa bits). (Over a
// whole logits row, in topk_rows_kernel, the matching cost more than it saved: top-k 2048 at
// llama3-8b 20.6 ms against 17.1-18.1 with plain atomics, measured on an H200.)
__device__ __forceinline__ void histogram_add(int* hist, int bin) {
  const unsigned peers = __match_any_sync(__activemask(), bin);
  if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
}

// A place in a shared list for each calling lane that takes one, *count advanced once per warp
// (one atomic per lane on one address serialises the warp).
__device__ __forceinline__ int warp_append(int* count, bool take) {
  const unsigned active = __activemask();
  const unsigned takers = __ballot_sync(active, take);
  const int lane = threadIdx.x & 31, leader = __ffs(active) - 1;
  int base = 0;
  if (lane == leader && takers) base = atomicAdd(count, __popc(takers));
  base = __shfl_sync(active, base, leader);
  return base + __popc(takers & ((1u << lane) - 1u));
}

// Radix stages: digit of the key at (shift, bits).
struct Stage {
  int shift;
  int bits;
};
__device__ constexpr Stage kStages[3] = {{21, 11}, {10, 11}, {0, 10}};

// The digit (bin, scanned from the top) holding the k_rem-th largest entry of hist, and how many
// entries lie in the bins above it, into *digit and *above. Called by the block's first `threads`
// threads, 32 (warp 0) or all; the caller synchronises before reading them. Each thread sums a run
// of bins (thread 0 the top ones), a scan over the threads finds the one whose run holds the
// entry, and that thread scans its run. (Warp 0 alone over 2048 bins, 64 a lane in turn, kept the
// block's other warps at the barrier after it: 12% of the list kernel's stall samples at k 2048
// on an H200. Over the bar's 256 bins the block's scan and its barrier cost more than warp 0's:
// 75 against 51 us for 8192 rows.)
__device__ void find_digit(const int* hist, int bins, int64_t k_rem, int* digit, int* above, int threads) {
  __shared__ int warp_totals[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per_thread = max(1, bins / threads);
  const int top = bins - 1 - int(threadIdx.x) * per_thread;  // this thread's bins: top, top-1, ...
  int own = 0;
  for (int b = 0; b < per_thread && top - b >= 0; ++b) own += hist[top - b];
  int inclusive = own;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (threads > 32) {  // every thread of the block is here
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    for (int w = 0; w < warp; ++w) inclusive += warp_totals[w];
  }
  const int exclusive = inclusive - own;
  if (exclusive < k_rem && k_rem <= inclusive) {
    int cum = exclusive;
    for (int b = 0; b < per_thread; ++b) {
      if (cum + hist[top - b] >= k_rem) {
        *digit = top - b;
        *above = cum;
        break;
      }
      cum += hist[top - b];
    }
  }
}

// One compare-exchange step of the bitonic network over keys in shared memory: the pairs
// (lo, lo + stride) of sequences of `size`, the larger first where lo & size is 0.
__device__ __forceinline__ void bitonic_step_shared(uint64_t* keys, int n, int size, int stride) {
  for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
    const int lo = 2 * i - (i & (stride - 1));
    const int hi = lo + stride;
    const bool desc = (lo & size) == 0;
    const uint64_t x = keys[lo], y = keys[hi];
    if ((x < y) == desc) {
      keys[lo] = y;
      keys[hi] = x;
    }
  }
  __syncthreads();
}

// The bitonic steps of strides top_stride down to 1 (top_stride below 32 kPerLane) of the
// sequences of `size` over a warp's segment of 32 kPerLane keys held in registers: lane l holds
// keys i0 + 32 e, e < kPerLane, i0 = the segment's first index + l. Strides of 32 and above pair
// two of a lane's own keys; smaller ones pair lanes, by shuffles. Every loop unrolls, so each key
// stays in its register.
template <int kPerLane>
__device__ __forceinline__ void segment_steps(uint64_t (&x)[kPerLane], int i0, int size, int top_stride) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int level = 0; (1 << level) < 32 * kPerLane; ++level) {
    const int s = (32 * kPerLane / 2) >> level;  // the stride, halving
    if (s > top_stride) continue;
    if (s >= 32) {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        if (e & (s / 32)) continue;  // the lower of the pair (e, e + s / 32)
        const bool desc = ((i0 + 32 * e) & size) == 0;
        const uint64_t lo = x[e], hi = x[e + s / 32];
        if ((lo < hi) == desc) {
          x[e] = hi;
          x[e + s / 32] = lo;
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        // The partner of key i is i ^ s, s lanes over; the lower of the pair keeps the larger
        // where the sequence descends.
        const bool desc = ((i0 + 32 * e) & size) == 0;
        const bool keep_max = ((lane & s) == 0) == desc;
        const uint64_t y = __shfl_xor_sync(0xffffffffu, x[e], s);
        x[e] = keep_max == (y > x[e]) ? y : x[e];
      }
    }
  }
}

// Descending bitonic sort of n (a power of two, at least 32 kPerLane) keys in shared memory. Each
// warp takes segments of 32 kPerLane keys into registers: the sequences up to a segment long are
// sorted there in one visit, and every longer size takes its strides of a segment and more
// through shared memory, then the rest in one visit of each segment. (With every step through
// shared memory, 78 barriers and passes for 4096 keys, the rows kernel took 1.03 ms per 1920 rows
// of 128256 at k 2048, 0.48 ms at k 129, on an H200: the sort's size is the difference.)
template <int kPerLane>
__device__ void bitonic_sort_desc_in_segments(uint64_t* keys, int n) {
  constexpr int kSegment = 32 * kPerLane;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  auto visit_segments = [&](auto&& steps) {
    for (int segment = warp; segment < n / kSegment; segment += warps) {
      const int i0 = segment * kSegment + lane;
      uint64_t x[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) x[e] = keys[i0 + 32 * e];
      steps(x, i0);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) keys[i0 + 32 * e] = x[e];
    }
    __syncthreads();
  };
  visit_segments([&](uint64_t (&x)[kPerLane], int i0) {
    for (int size = 2; size <= kSegment; size <<= 1) segment_steps(x, i0, size, size / 2);
  });
  for (int size = 2 * kSegment; size <= n; size <<= 1) {
    for (int stride = size / 2; stride >= kSegment; stride >>= 1) bitonic_step_shared(keys, n, size, stride);
    visit_segments([&](uint64_t (&x)[kPerLane], int i0) { segment_steps(x, i0, size, kSegment / 2); });
  }
}

// Descending bitonic sort of n (a power of two) keys in shared memory; the caller has
// synchronised them. Segments of 256 keys (8 a lane) from 256 keys on, of 64 below (a sort of
// 2048 then takes 6 block-wide steps instead of 15, and 4 visits of the segments instead of 11).
__device__ void bitonic_sort_desc(uint64_t* keys, int n) {
  if (n >= 256) return bitonic_sort_desc_in_segments<8>(keys, n);
  if (n >= 64) return bitonic_sort_desc_in_segments<2>(keys, n);
  for (int size = 2; size <= n; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) bitonic_step_shared(keys, n, size, stride);
}

// Sorts keys[0, count) descending, zeros padding them to a power of two of at least `at_least`
// entries (a zero loses to every composite). The caller has synchronised the keys.
__device__ void sort_desc_padded(uint64_t* keys, int count, int at_least = 1) {
  const int n = int(pow2_at_least(max(count, at_least)));
  for (int i = count + threadIdx.x; i < n; i += blockDim.x) keys[i] = 0;
  __syncthreads();
  bitonic_sort_desc(keys, n);
}

// A block's shared scratch for select_top.
struct SelectScratch {
  int* hist;  // (kBins)
  int* digit;
  int* above;
  int* count;
};

// Where the k largest of keys[0, n) start: a radix select over the 64-bit composites narrows to
// at most `capacity` of them (they are distinct, so it always can; capacity >= k), those whose
// bits above `shift` reach `prefix`. The caller has synchronised the keys.
struct TopBound {
  uint64_t prefix = 0;
  int shift = 64;
  bool real_only = false;  // fewer than k real keys: every nonzero one, and no zeros
  __device__ bool takes(uint64_t c) const {
    return (shift == 64 || (c >> shift) >= prefix) && !(real_only && c == 0);
  }
};
__device__ TopBound bound_top(const uint64_t* keys, int n, int k, int capacity, const SelectScratch& sh) {
  constexpr int kStageBits[6] = {11, 11, 10, 11, 11, 10};
  TopBound t;
  int k_rem = k, above = 0, count = n;
  for (int stage = 0; stage < 6 && count > capacity; ++stage) {
    const int bits = kStageBits[stage], next = t.shift - bits;
    const uint64_t mask = (uint64_t(1) << bits) - 1;
    for (int b = threadIdx.x; b < (1 << bits); b += blockDim.x) sh.hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const uint64_t c = keys[i];
      if (stage == 0 || (c >> t.shift) == t.prefix) histogram_add(sh.hist, int((c >> next) & mask));
    }
    __syncthreads();
    find_digit(sh.hist, 1 << bits, k_rem, sh.digit, sh.above, blockDim.x);
    __syncthreads();
    t.prefix = (t.prefix << bits) | uint64_t(*sh.digit);
    t.shift = next;
    above += *sh.above;
    k_rem -= *sh.above;
    count = above + sh.hist[*sh.digit];
    __syncthreads();  // hist and digit are written again
  }
  // Still too many only when the k-th is an empty slot (fewer than k real keys): the real ones.
  t.real_only = count > capacity;
  return t;
}

// out[0, count) = the keys of keys[0, n) that t takes, in no order; returns count. Synchronises
// the block before and after.
__device__ int gather_top(const uint64_t* keys, int n, const TopBound& t, uint64_t* out, const SelectScratch& sh) {
  if (threadIdx.x == 0) *sh.count = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const uint64_t c = keys[i];
    const bool take = t.takes(c);
    const int at = warp_append(sh.count, take);
    if (take) out[at] = c;
  }
  __syncthreads();
  return *sh.count;
}

// out[0, k) = the k largest of keys[0, n), descending (keys may hold zeros, which lose): those
// bound_top keeps, at most `capacity`, gathered into out and sorted by a bitonic sort padded to a
// power of two (out holds capacity's, itself a power of two). The caller has synchronised the
// keys; where n > capacity the caller may have read n from *sh.count (a stage's barriers pass
// before it is written).
__device__ void select_top(const uint64_t* keys, int n, int k, uint64_t* out, int capacity, const SelectScratch& sh) {
  const int count = gather_top(keys, n, bound_top(keys, n, k, capacity, sh), out, sh);
  sort_desc_padded(out, count, k);
}

// select_top with out = keys (shared memory with room for at least k's power of two): the kept
// keys move to the front a block-wide round at a time, each round's keys all read before any is
// written (a key moves to a place below the round's end, whose keys are read), so no room beside
// the keys is needed. The caller has synchronised the keys.
__device__ void select_top_in_place(uint64_t* keys, int n, int k, const SelectScratch& sh) {
  const TopBound t = bound_top(keys, n, k, int(pow2_at_least(k)), sh);
  if (threadIdx.x == 0) *sh.count = 0;
  __syncthreads();
  for (int first = 0; first < n; first += blockDim.x) {
    const int i = first + int(threadIdx.x);
    const uint64_t c = i < n ? keys[i] : 0;
    const bool take = i < n && t.takes(c);
    __syncthreads();
    const int at = warp_append(sh.count, take);
    if (take) keys[at] = c;
  }
  __syncthreads();
  sort_desc_padded(keys, *sh.count, k);
}

// Sorts of fewer keys than this cost less than the select passes that would halve them (top-k
// 129, 256 keys instead of 512, measured slower with a select).
constexpr int kSelectFromKeys = 4096;

// Whether the k largest of `count` keys are had cheaper by sorting all of them than by selecting
// first: fewer than kSelectFromKeys, or k's power of two no smaller than count's.
__device__ bool sorts_all(int count, int64_t k) {
  const int64_t count_pow2 = pow2_at_least(count);
  return count_pow2 < kSelectFromKeys || pow2_at_least(k) >= count_pow2;
}

// The k largest of the composites keys[0, count) in shared memory, sorted descending, at the
// returned address. Where selecting pays (not sorts_all) and the space after the keys holds k's
// power of two, select_top narrows them to at most that many behind the keys and sorts those (a
// sort of 2048 keys for k 2048 instead of 4096: the sort was most of the k 2048 rows kernel's
// time beyond its reads); else all count are sorted in place. The caller has synchronised the
// keys.
__device__ const uint64_t* sort_top_k(uint64_t* keys, int count, int64_t k, int capacity, const SelectScratch& sh) {
  const int k_pow2 = int(pow2_at_least(k));
  if (sorts_all(count, k) || count + k_pow2 > capacity) {
    sort_desc_padded(keys, count);
    return keys;
  }
  select_top(keys, count, int(k), keys + count, k_pow2, sh);
  return keys + count;
}

// ids, probs and tail of token t from its k sorted keys (shared or device memory).
__device__ void write_output(const TopkRowsArgs& a, int64_t t, const uint64_t* sorted, float lse,
                             float* scratch) {
  const int64_t k = a.k;
  const float top = composite_value(sorted[0]);
  // Renormalized: relative to the top value, or to 0 where it is infinite (as on the CPU: a +inf
  // logit's entry is inf / inf and the others 0, not NaN for every entry).
  const float base = a.renormalize ? (isinf(top) ? 0.f : top) : lse;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x)
    sum += expf(composite_value(sorted[i]) - base);
  sum = block_reduce(sum, Sum{}, 0.f, scratch);
  const float inv = a.renormalize ? 1.f / sum : 1.f;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    const uint64_t c = sorted[i];
    a.ids[t * a.ids_ld + i] = composite_id(c);
    a.probs[t * a.probs_ld + i] = expf(composite_value(c) - base) * inv;
  }
  if (a.tail && threadIdx.x == 0) a.tail[t] = a.renormalize ? 0.f : 1.f - sum;
}

// The sample behind the one-pass threshold (see topk.cuh): `size` values of the row in runs of
// kSampleRun adjacent ones (one memory sector each), spread evenly, and the rank among them of
// the threshold; size 0 where the row is too short for it to pay or the values expected to pass
// would crowd shared memory. The rank is 1.5 times the sample's expected share of the top k plus
// 4: fewer than k values pass only when the sample is several standard deviations off (at k 2048
// and V 256000, 3.1), and the histogram passes then take the row.
struct SamplePlan {
  int size = 0;
  int rank = 0;
};
constexpr int kSampleRun = 8;

__device__ SamplePlan sample_plan(int64_t vocab, int64_t k) {
  SamplePlan p;
  constexpr int size = 1024;
  if (vocab < 16 * size || k > kCapacity) return p;
  const int64_t rank = (3 * k * size + 2 * vocab - 1) / (2 * vocab) + 4;
  if (rank >= size || rank * vocab / size > kCapacity * 3 / 4) return p;
  p.size = size;
  p.rank = int(rank);
  return p;
}

// A rows kernel block's shared memory besides its candidates.
struct RowsShared {
  int hist[kBins];
  int digit, above, count;
  float2 maxsum[32];
  float sum[32];
  int warp_counts[32];
};

// The top k of row r (token row0 + r), its `vocab` logits at z, by one block (see topk.cuh);
// `candidates` holds kCapacity keys in shared memory.
template <typename T>
__device__ void topk_of_row(const TopkRowsArgs& a, int64_t r, const T* z, uint64_t* candidates, RowsShared& sh) {
  const SelectScratch select_scratch{sh.hist, &sh.digit, &sh.above, &sh.count};
  const int64_t V = a.vocab;
  const bool large = a.k > kCapacity;
  const int warps = blockDim.x / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const SamplePlan sample = sample_plan(V, a.k);
  const int64_t t = a.row0 + r;
  auto scaled = [&](int64_t j, float v) { return a.scale.apply(a.bias ? v + a.bias[j] : v); };
  auto key_at = [&](int64_t j, float v) { return order_key(scaled(j, v)); };

  const bool want_lse = !a.renormalize;

  // Typical rows: the threshold from a sample, then one pass gathers every key at or above it
  // (and the lse); the histogram passes below only when fewer than k or more than shared
  // memory holds pass it (an unlucky sample, or ties).
  if (sample.size > 0) {
    const int runs = sample.size / kSampleRun;
    if (threadIdx.x == 0) sh.count = 0;
    for (int i = threadIdx.x; i < sample.size; i += blockDim.x) {
      const int64_t run_start = (2 * int64_t(i / kSampleRun) + 1) * V / (2 * runs) / kSampleRun * kSampleRun;
      const int64_t j = run_start + i % kSampleRun;
      candidates[i] = composite(key_at(j, to_float(z[j])), j);
    }
    __syncthreads();
    bitonic_sort_desc(candidates, sample.size);
    const uint32_t threshold = static_cast<uint32_t>(candidates[sample.rank - 1] >> 32);
    __syncthreads();  // every thread has the threshold before the candidates overwrite the sample
    MaxSum acc{-INFINITY, 0.f};
    for_each_in_row(z, V, [&](int64_t j, float v) {
      const float s = scaled(j, v);
      const uint32_t key = order_key(s);
      if (key >= threshold) {
        const int at = atomicAdd(&sh.count, 1);
        if (at < kCapacity) candidates[at] = composite(key, j);
      }
      if (want_lse) add_to_lse(acc, s);
    });
    __syncthreads();
    const float lse = want_lse ? block_lse(acc, sh.maxsum) : 0.f;
    const int n_candidates = sh.count;
    if (n_candidates >= a.k && n_candidates <= kCapacity) {
      const uint64_t* top = sort_top_k(candidates, n_candidates, a.k, kCapacity, select_scratch);
      write_output(a, t, top, lse, sh.sum);
      __syncthreads();
      return;
    }
    __syncthreads();  // sh.count and the candidates are reused below
  }

  // Pass 1: top digit histogram, and the row's lse when full-vocabulary probabilities are asked.
  for (int b = threadIdx.x; b < kBins; b += blockDim.x) sh.hist[b] = 0;
  __syncthreads();
  MaxSum acc{-INFINITY, 0.f};
  for_each_in_row(z, V, [&](int64_t j, float v) {
    const float s = scaled(j, v);
    atomicAdd(&sh.hist[order_key(s) >> kStages[0].shift], 1);
    if (want_lse) add_to_lse(acc, s);
  });
  __syncthreads();
  const float lse = want_lse ? block_lse(acc, sh.maxsum) : 0.f;

  // Narrow the bin of the k-th key until the candidates fit shared memory, or the key is exact.
  uint32_t prefix = 0;
  int shift = 32;
  int64_t k_rem = a.k, above = 0;
  bool collected = false;
  for (int stage = 0; stage < 3 && !collected; ++stage) {
    const Stage st = kStages[stage];
    if (stage > 0) {
      for (int b = threadIdx.x; b < kBins; b += blockDim.x) sh.hist[b] = 0;
      __syncthreads();
      const uint32_t mask = (1u << st.bits) - 1u;
      for_each_in_row(z, V, [&](int64_t j, float v) {
        const uint32_t key = key_at(j, v);
        if ((key >> shift) == prefix) atomicAdd(&sh.hist[(key >> st.shift) & mask], 1);
      });
      __syncthreads();
    }
    find_digit(sh.hist, 1 << st.bits, k_rem, &sh.digit, &sh.above, blockDim.x);
    __syncthreads();
    const int digit = sh.digit;
    prefix = (shift == 32 ? 0u : prefix << st.bits) | static_cast<uint32_t>(digit);
    shift = st.shift;
    above += sh.above;
    k_rem -= sh.above;
    const int64_t n_candidates = above + sh.hist[digit];
    __syncthreads();  // hist and the shared digit are reused below
    if (!large && n_candidates <= kCapacity) {
      if (threadIdx.x == 0) sh.count = 0;
      __syncthreads();
      for_each_in_row(z, V, [&](int64_t j, float v) {
        const uint32_t key = key_at(j, v);
        if ((key >> shift) >= prefix) candidates[atomicAdd(&sh.count, 1)] = composite(key, j);
      });
      __syncthreads();
      const uint64_t* top = sort_top_k(candidates, static_cast<int>(n_candidates), a.k, kCapacity, select_scratch);
      write_output(a, t, top, lse, sh.sum);
      collected = true;
    }
  }
  if (collected) {
    __syncthreads();
    return;
  }

  // Exact threshold T = prefix: every key above it, then the lowest-id keys equal to it.
  const uint32_t threshold = prefix;
  uint64_t* dest = large ? a.sorted_scratch + r * a.k : candidates;
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  for_each_in_row(z, V, [&](int64_t j, float v) {
    const uint32_t key = key_at(j, v);
    if (key > threshold) dest[atomicAdd(&sh.count, 1)] = composite(key, j);
  });
  __syncthreads();
  const int64_t need = a.k - above;
  int64_t taken = 0;
  for (int64_t base = 0; base < V && taken < need; base += blockDim.x) {
    const int64_t j = base + threadIdx.x;
    const bool tie = j < V && key_at(j, to_float(z[j])) == threshold;
    const unsigned ballot = __ballot_sync(0xffffffffu, tie);
    if (lane == 0) sh.warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int64_t offset = taken;
    for (int w = 0; w < warp; ++w) offset += sh.warp_counts[w];
    int64_t tile_total = 0;
    for (int w = 0; w < warps; ++w) tile_total += sh.warp_counts[w];
    const int64_t rank = offset + __popc(ballot & ((1u << lane) - 1u));
    if (tie && rank < need) dest[above + rank] = composite(threshold, j);
    taken += tile_total;
    __syncthreads();
  }
  if (!large) {
    sort_desc_padded(candidates, static_cast<int>(a.k));
    write_output(a, t, candidates, lse, sh.sum);
  } else if (threadIdx.x == 0) {
    a.lse_scratch[r] = lse;
  }
  __syncthreads();
}

template <typename T>
__global__ void __launch_bounds__(kTopkRowsThreads, kTopkRowsBlocksPerSM) topk_rows_kernel(const TopkRowsArgs a) {
  extern __shared__ uint64_t candidates[];  // (kCapacity)
  __shared__ RowsShared sh;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x)
    topk_of_row(a, r, static_cast<const T*>(a.logits) + r * a.logits_ld, candidates, sh);
}

__global__ void topk_finish_kernel(const TopkRowsArgs a, const uint64_t* sorted) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    write_output(a, a.row0 + r, sorted + r * a.k, a.lse_scratch[r], scratch);
    __syncthreads();
  }
}

__global__ void segment_offsets_kernel(int64_t* offsets, int64_t rows, int64_t k) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i <= rows;
       i += int64_t(gridDim.x) * blockDim.x)
    offsets[i] = i * k;
}

// ---- selection from the statistics product's kept logits (see topk.cuh) ----------------------

// Token t's logit at column j, x_t . w_j in f32, by one warp (every lane gets it).
template <typename T>
__device__ float head_dot(const TopkHead& h, int64_t t, int64_t j) {
  return warp_dot(static_cast<const T*>(h.hidden) + t * h.hidden_ld, static_cast<const T*>(h.weight) + j * h.weight_ld,
                  h.hidden_size);
}

// A row's lse from the statistics product's partials (max, sum of exponentials) of its tiles.
__device__ float lse_of_partials(const float4* partial, int64_t tiles, float2* scratch) {
  MaxSum acc{-INFINITY, 0.f};
  for (int64_t i = threadIdx.x; i < tiles; i += blockDim.x) acc = merge(acc, MaxSum{partial[i].x, partial[i].y});
  return block_lse(acc, scratch);
}

constexpr int kMergeCapacity = 1024;  // composites ranked at once: the top k and fresh candidates
constexpr int kRecomputeGroups = int((kMergeCapacity - kTopkFromProductMaxK) / kTopkGroupColumns);
constexpr int kMaxCandidates = kCapacity;
// The first selection's radix stages stop at this many times k keys, which are then ranked (at 4,
// ranking the ~256 keys one radix stage leaves cost more than a second stage: 0.222 against 0.188
// ms for 2048 rows at llama3-8b, k 64, on an H200).
constexpr int kSelectCapacity = 2;
static_assert(kRecomputeGroups >= 1, "room to merge at least one recomputed group");
static_assert(2 * kTopkFromProductMaxK <= kMergeCapacity, "room for the top k and a second of each selected group");
constexpr int kRankKeysPerThread = 2;  // keys a thread ranks (keep_top_ranked)
static_assert(kMergeCapacity <= kRankKeysPerThread * kTopkThreads, "room to rank a whole merge");

// keys[0, n) = list[0, n) by asynchronous 16-byte copies (list and keys 16-byte aligned), every
// thread's copies in flight at once: start_copy_list sends them, finish_copy_list waits for them
// and synchronises the block, so other reads can go out between. (Copied a key at a time, each
// store waited on its load: 17% of the list kernel's stall samples at k 2048 on an H200. With this
// copy and find_digit over the whole block, the list kernel took 1.18 ms for 8192 rows at
// gemma2-2b instead of 1.65, 0.88 instead of 1.16 at llama3-8b.)
__device__ void start_copy_list(uint64_t* keys, const uint64_t* list, int n) {
  for (int i = threadIdx.x; 2 * i + 1 < n; i += blockDim.x) __pipeline_memcpy_async(keys + 2 * i, list + 2 * i, 16);
  __pipeline_commit();
  if ((n & 1) && threadIdx.x == 0) keys[n - 1] = list[n - 1];
}
__device__ void finish_copy_list() {
  __pipeline_wait_prior(0);
  __syncthreads();
}
__device__ void copy_list(uint64_t* keys, const uint64_t* list, int n) {
  start_copy_list(keys, list, n);
  finish_copy_list();
}

// The keys of keys[0, count) a thread holds, and each one's rank: how many keys are larger, ties
// (zeros) by position, so every rank below count is taken once. Thread i holds keys i + e blockDim
// (count <= kPerThread blockDim); only the warps holding keys scan them, as broadcast reads.
// (Sorting the few hundred keys a radix stage leaves fell to one or two warps of the block while
// the others waited at a barrier: 18% of the candidates kernel's stall samples at k 64.)
template <int kPerThread>
struct RankedKeys {
  uint64_t key[kPerThread];
  int rank[kPerThread];
};
template <int kPerThread>
__device__ RankedKeys<kPerThread> rank_keys(const uint64_t* keys, int count) {
  RankedKeys<kPerThread> m;
#pragma unroll
  for (int e = 0; e < kPerThread; ++e) {
    const int i = int(threadIdx.x) + e * int(blockDim.x);
    m.key[e] = i < count ? keys[i] : 0;
    m.rank[e] = 0;
  }
  if (int(threadIdx.x & ~31u) < count) {
    for (int j = 0; j < count; ++j) {
      const uint64_t other = keys[j];
#pragma unroll
      for (int e = 0; e < kPerThread; ++e) {
        const int i = int(threadIdx.x) + e * int(blockDim.x);
        m.rank[e] += other > m.key[e] || (other == m.key[e] && j < i);
      }
    }
  }
#pragma unroll
  for (int e = 0; e < kPerThread; ++e)
    if (int(threadIdx.x) + e * int(blockDim.x) >= count) m.rank[e] = INT_MAX;  // holds no key
  return m;
}

// keys[0, k) = the k largest of keys[0, count), descending, each put at its rank (zeros after every
// nonzero key, and in [count, k) where count < k). Returns the thread's keys and ranks.
__device__ RankedKeys<kRankKeysPerThread> keep_top_ranked(uint64_t* keys, int count, int k) {
  const RankedKeys<kRankKeysPerThread> m = rank_keys<kRankKeysPerThread>(keys, count);
  __syncthreads();  // every key read before any moves
#pragma unroll
  for (int e = 0; e < kRankKeysPerThread; ++e)
    if (m.rank[e] < k) keys[m.rank[e]] = m.key[e];
  for (int i = count + int(threadIdx.x); i < k; i += blockDim.x) keys[i] = 0;
  __syncthreads();
  return m;
}

struct SelectShared {
  uint64_t merge[kMergeCapacity];
  int hist[kBins];
  int digit, above, count;
};

// Three rows in flight an SM where their candidates fit (V 128256: 49 KiB of shared memory a
// block; at V 256000 two): the kernel waits on device memory, the candidates and the recomputed
// groups' rows of W. (At 58 registers a thread, two blocks an SM: 0.207 ms for 2048 rows at
// llama3-8b on an H200; at 40, three: 0.154 ms.)
constexpr int kCandidatesBlocksPerSM = 3;

template <typename T>
__global__ void __launch_bounds__(kTopkThreads, kCandidatesBlocksPerSM) topk_candidates_kernel(const TopkCandidatesArgs a) {
  extern __shared__ uint64_t candidates[];  // (n) of the row
  __shared__ SelectShared sh;
  __shared__ float2 maxsum_scratch[32];
  __shared__ float sum_scratch[32];
  __shared__ int flagged[kTopkFromProductMaxK];  // only selected groups are flagged: at most k
  __shared__ int flagged_count;
  __shared__ int joined_count;  // seconds joining the selection, at merge[k, k + joined_count)
  const int n = int(a.tiles * kTopkCandidatesPerTile);
  const int k = int(a.select.k);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const SelectScratch select_scratch{sh.hist, &sh.digit, &sh.above, &sh.count};

  for (int64_t r = blockIdx.x; r < a.select.rows; r += gridDim.x) {
    const int64_t t = a.select.row0 + r;
    const uint64_t* row = a.candidates + r * a.candidates_ld;
    if (threadIdx.x == 0) flagged_count = joined_count = 0;
    // The partials' reads go out beside the candidates' copies.
    start_copy_list(candidates, row, n);
    const float lse = a.select.renormalize ? 0.f : lse_of_partials(a.partial + r * a.partial_ld, a.tiles, maxsum_scratch);
    finish_copy_list();

    // The radix stages narrow the candidates to at most kSelectCapacity k, gathered into merge.
    const int gathered =
        gather_top(candidates, n, bound_top(candidates, n, k, kSelectCapacity * k, select_scratch), sh.merge,
                   select_scratch);
    // Each gathered key's group's runners-up, read before the ranking that hides their wait.
    const uint64_t* row_runners_up = a.runners_up + r * a.candidates_ld;
    uint64_t runner_up[kRankKeysPerThread];
#pragma unroll
    for (int e = 0; e < kRankKeysPerThread; ++e) {
      const int i = int(threadIdx.x) + e * int(blockDim.x);
      const uint64_t c = i < gathered ? sh.merge[i] : 0;
      runner_up[e] = c != 0 ? row_runners_up[column_group(composite_id(c))] : 0;
    }
    const RankedKeys<kRankKeysPerThread> top = keep_top_ranked(sh.merge, gathered, k);

    // A selected group whose second-largest value reaches the k-th may hold more of the top k: its
    // second joins the selection, or, where its third may reach the k-th too, the group is
    // recomputed in full.
    const uint32_t kth_key = uint32_t(sh.merge[k - 1] >> 32);
#pragma unroll
    for (int e = 0; e < kRankKeysPerThread; ++e) {
      const uint32_t second_key = second_key_of(runner_up[e]);
      if (top.rank[e] < k && top.key[e] != 0 && second_key != 0 && second_key >= kth_key) {
        const int group = column_group(composite_id(top.key[e]));
        if (third_key_bound(runner_up[e]) >= kth_key)
          flagged[atomicAdd(&flagged_count, 1)] = group;
        else
          sh.merge[k + atomicAdd(&joined_count, 1)] =
              composite(second_key, group_column(group, second_place_of(runner_up[e])));
      }
    }
    __syncthreads();
    const int n_joined = joined_count;
    // No barrier after: keep_top_ranked ends with one, and without joins nothing was written.
    if (n_joined > 0) keep_top_ranked(sh.merge, k + n_joined, k);
    const int n_flagged = flagged_count;
    if (n_flagged > 0) {
      // The flagged groups' largest leave the top k (each comes back with its group's logits).
      // What stays is the top of every other group's largest: those beyond the k-th are below k
      // logits already, so they need no second selection.
      for (int f = threadIdx.x; f < n_flagged; f += blockDim.x) candidates[flagged[f]] = 0;
      __syncthreads();
      for (int i = threadIdx.x; i < k; i += blockDim.x)
        if (sh.merge[i] != 0 && candidates[column_group(composite_id(sh.merge[i]))] == 0) sh.merge[i] = 0;
      __syncthreads();
      for (int f0 = 0; f0 < n_flagged; f0 += kRecomputeGroups) {
        const int groups_now = min(kRecomputeGroups, n_flagged - f0);
        const int columns = groups_now * int(kTopkGroupColumns);
        for (int c = warp; c < columns; c += warps) {
          const int64_t j = group_column(flagged[f0 + c / kTopkGroupColumns], c % kTopkGroupColumns);
          uint64_t key = 0;
          if (j < a.select.vocab) {
            const float s = head_dot<T>(a.head, t, j) * a.inv_temperature;
            key = composite(order_key(s), j);
          }
          if (lane == 0) sh.merge[k + c] = key;
        }
        __syncthreads();
        keep_top_ranked(sh.merge, k + columns, k);
      }
    }

    write_output(a.select, t, sh.merge, lse, sum_scratch);
    __syncthreads();
  }
}

// ---- selection from the logits the product keeps above a sampled bar (see topk.cuh) -----------

constexpr int kBarThreads = 256;
constexpr int kRedoBlocks = 16;  // rows redone at once, each in a row of device memory
constexpr int kKeptBlocksPerSM = 3;  // rows selected at once on an SM: one's reads under another's sort

// The least z with z * inv_t >= bar in f32: rounding is monotone, so the z that pass form an upper
// set of the floats, whose least element a few steps of one ulp from bar / inv_t find. Infinite
// and NaN bars are their own (every z but NaN passes -inf, only +inf passes +inf, none NaN).
__device__ float unscaled_bar(float bar, float inv_t) {
  if (!(fabsf(bar) < INFINITY)) return bar;
  auto passes = [&](float z) { return __fmul_rn(z, inv_t) >= bar; };
  float z = __fdiv_rn(bar, inv_t);
  while (!passes(z)) z = nextafterf(z, INFINITY);
  for (float lower = nextafterf(z, -INFINITY); passes(lower); lower = nextafterf(z, -INFINITY)) z = lower;
  return z;
}

// The rank-th largest key of each row's sample by a radix select, 8 bits a pass, each thread
// holding its keys in registers (a bitonic sort of the 1024 composites took 0.24 ms for 8192 rows
// on an H200, its instructions the limit).
constexpr int kBarKeysPerThread = int(kTopkSampleColumns) / kBarThreads;
__global__ void __launch_bounds__(kBarThreads) topk_bar_kernel(const TopkBarArgs a) {
  __shared__ int hist[256];
  __shared__ int digit, above;
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const float* sample = a.sample + r * kTopkSampleColumns;
    uint32_t key[kBarKeysPerThread];
#pragma unroll
    for (int i = 0; i < kBarKeysPerThread; ++i)
      key[i] = order_key(sample[threadIdx.x + i * kBarThreads] * a.inv_temperature);
    uint32_t prefix = 0, known = 0;  // the bits of the rank-th key found so far, and which
    int64_t k_rem = a.rank;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kBarKeysPerThread; ++i) {
        const bool in = (key[i] & known) == prefix;
        const int bin = int((key[i] >> shift) & 255u);
        if (in) histogram_add(hist, bin);
      }
      __syncthreads();
      if (threadIdx.x < 32) find_digit(hist, 256, k_rem, &digit, &above, 32);
      __syncthreads();
      prefix |= uint32_t(digit) << shift;
      known |= 255u << shift;
      k_rem -= above;
      __syncthreads();  // hist, digit and above are written again
    }
    // Every thread finds the bar, thread 0 only stores it: its search (calls, loops) in a branch of
    // thread 0 could leave warp 0 split into the next row's barrier, as the rows kernel's was.
    const float bar = unscaled_bar(key_value(prefix), a.inv_temperature);
    if (threadIdx.x == 0) {
      a.bar[r] = bar;
      a.kept_count[r] = 0;
    }
  }
}

__device__ bool kept_list_holds_top_k(const TopkKeptArgs& a, int64_t r) {
  const int32_t n = a.kept_count[r];
  return n >= a.select.k && n <= a.kept_ld;
}

// One block per row whose list holds its top k. The list is copied into shared memory when it
// fits there (one coalesced read; the select's passes over device memory waited on L2 at every
// step: 2.1 ms for 8192 rows at k 2048, V 128256 on an H200, 1.4 with the copy), then selected
// and sorted in place; a longer list is selected from device memory. kCapacity keys leave room
// for three blocks an SM. (Beside the list, k's sorted power of two took room for 2,048 keys
// more: at gemma2-2b, lists of ~6,250 keys, two blocks an SM.)
__global__ void __launch_bounds__(kTopkRowsThreads, kKeptBlocksPerSM) topk_kept_kernel(const TopkKeptArgs a) {
  extern __shared__ uint64_t keys[];  // (kCapacity)
  __shared__ int hist[kBins];
  __shared__ int digit, above, count;
  __shared__ float2 maxsum_scratch[32];
  __shared__ float sum_scratch[32];
  const SelectScratch select_scratch{hist, &digit, &above, &count};
  const int k = int(a.select.k);
  const int k_pow2 = int(pow2_at_least(k));
  for (int64_t r = blockIdx.x; r < a.select.rows; r += gridDim.x) {
    if (!kept_list_holds_top_k(a, r)) continue;  // the redo kernel's row
    const uint64_t* list = a.kept + r * a.kept_ld;
    const int n = a.kept_count[r];
    if (n <= kCapacity) {
      copy_list(keys, list, n);
      if (sorts_all(n, k)) sort_desc_padded(keys, n);
      else select_top_in_place(keys, n, k, select_scratch);
    } else {
      select_top(list, n, k, keys, k_pow2, select_scratch);
    }
    const float lse = a.select.renormalize ? 0.f : lse_of_partials(a.partial + r * a.partial_ld, a.tiles, maxsum_scratch);
    write_output(a.select, a.select.row0 + r, keys, lse, sum_scratch);
    __syncthreads();
  }
}

// Row r's logits from scratch, a dot product of warp each, into z (device memory), then its top
// k from them by the rows kernel's selection.
template <typename T>
__device__ void redo_row(const TopkKeptArgs& a, int64_t r, float* z, uint64_t* candidates, RowsShared& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int64_t j = warp; j < a.select.vocab; j += warps) {
    const float dot = head_dot<T>(a.head, a.select.row0 + r, j);
    if (lane == 0) z[j] = dot;
  }
  __syncthreads();
  topk_of_row(a.select, r, static_cast<const float*>(z), candidates, sh);
}

// The rows whose list does not hold their top k, each block in its own row of device memory.
template <typename T>
__global__ void __launch_bounds__(kTopkRowsThreads) topk_redo_kernel(const TopkKeptArgs a) {
  extern __shared__ uint64_t candidates[];  // (kCapacity)
  __shared__ RowsShared sh;
  float* z = a.redo_logits + blockIdx.x * a.select.vocab;
  // The block's rows (blockIdx.x + gridDim.x i) are looked at blockDim.x at a time: most have
  // nothing to redo, and one at a time the scan alone took 0.17 ms for 8192 rows (H200).
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t first = blockIdx.x; first < a.select.rows; first += stride) {
    const int64_t mine = first + int64_t(threadIdx.x) * gridDim.x;
    if (!__syncthreads_or(mine < a.select.rows && !kept_list_holds_top_k(a, mine))) continue;
    for (int64_t r = first; r < a.select.rows && r < first + stride; r += gridDim.x)
      if (!kept_list_holds_top_k(a, r)) redo_row<T>(a, r, z, candidates, sh);
  }
}

// The candidates of k > kCapacity sorted a row (segment) at a time by CUB's segmented radix sort:
// its segmented merge sort splits more than 500 segments into groups whose sizes it copies to the
// host and waits for, a host sync (and a broken graph capture) inside the call. rows * k < 2^31
// (the callers' chunks are capped so): its sizes are ints.
size_t cub_temp_bytes(int64_t rows, int64_t k) {
  size_t temp = 0;
  cub::DeviceSegmentedRadixSort::SortKeysDescending(nullptr, temp, static_cast<const uint64_t*>(nullptr),
                                                    static_cast<uint64_t*>(nullptr), int(rows * k), int(rows),
                                                    static_cast<const int64_t*>(nullptr),
                                                    static_cast<const int64_t*>(nullptr) + 1);
  return temp;
}

// Lets `kernel` take up to `bytes` of dynamic shared memory on the current device. Set before each
// launch: the attribute belongs to one kernel on one device, and a process may use several.
template <typename Kernel>
lmloss_status allow_dynamic_shared(Kernel kernel, size_t bytes) {
  const cudaError_t st = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (st != cudaSuccess)
    return core::fail(LMLOSS_ERROR_BACKEND, std::string("topk shared memory: ") + cudaGetErrorString(st));
  return LMLOSS_SUCCESS;
}

// Has `kernel` take the largest shared-memory share of L1 on the current device: the rows and
// list kernels keep several blocks' candidates on an SM (left to the driver's split, one).
template <typename Kernel>
lmloss_status prefer_shared_memory(Kernel kernel) {
  const cudaError_t st =
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared));
  if (st != cudaSuccess)
    return core::fail(LMLOSS_ERROR_BACKEND, std::string("topk shared memory carveout: ") + cudaGetErrorString(st));
  return LMLOSS_SUCCESS;
}

template <typename T>
lmloss_status launch_typed(const TopkRowsArgs& a, cudaStream_t stream) {
  LMLOSS_CHECK(allow_dynamic_shared(topk_rows_kernel<T>, kCapacity * sizeof(uint64_t)));
  LMLOSS_CHECK(prefer_shared_memory(topk_rows_kernel<T>));
  topk_rows_kernel<T><<<row_grid(a.rows), kTopkRowsThreads, kCapacity * sizeof(uint64_t), stream>>>(a);
  LMLOSS_CUDA_LAUNCHED("topk_rows_kernel");
  return LMLOSS_SUCCESS;
}

}  // namespace

bool topk_from_candidates_supported(int64_t vocab, int64_t k) {
  const int64_t whole_tiles = vocab / kRowStatsTileColumns;
  return k >= 1 && k <= kTopkFromProductMaxK && k <= whole_tiles * kTopkCandidatesPerTile &&
         row_stats_tiles(vocab) * kTopkCandidatesPerTile <= kMaxCandidates;
}

// f(T{}) for the head's element type T (the selections from the product compute single logits
// from it again), before anything is launched; an error for a head that is not 16-bit.
template <typename F>
lmloss_status with_head_type(const TopkHead& head, F&& f) {
  if (head.dtype == LMLOSS_F16) return f(__half{});
  if (head.dtype == LMLOSS_BF16) return f(__nv_bfloat16{});
  return core::fail(LMLOSS_ERROR_UNSUPPORTED, "CUDA top-k from the product: bf16 or f16 only");
}

lmloss_status launch_topk_from_candidates(const TopkCandidatesArgs& a, cudaStream_t stream) {
  if (a.select.rows == 0) return LMLOSS_SUCCESS;
  return with_head_type(a.head, [&](auto element) -> lmloss_status {
    const auto kernel = topk_candidates_kernel<decltype(element)>;
    const size_t shared = size_t(a.tiles) * kTopkCandidatesPerTile * sizeof(uint64_t);
    LMLOSS_CHECK(allow_dynamic_shared(kernel, shared));
    kernel<<<row_grid(a.select.rows), kTopkThreads, shared, stream>>>(a);
    LMLOSS_CUDA_LAUNCHED("topk_candidates_kernel");
    return LMLOSS_SUCCESS;
  });
}

bool topk_bar_plan(int64_t vocab, int64_t k, TopkBarPlan* plan) {
  if (vocab < 16 * kTopkSampleColumns || k < 1 || k > kCapacity) return false;
  // About twice k expected at or above the bar, and 8 more of the sample: a row's list holds
  // fewer than k about once in 10^6 rows or less (the sample's binomial tail, at k 2048 and
  // V 256000 1.5e-6, at V 128256 1.6e-7).
  const int64_t rank = (2 * k * kTopkSampleColumns + vocab - 1) / vocab + 8;
  if (rank > kTopkSampleColumns / 4) return false;
  plan->step = vocab / kTopkSampleColumns;
  plan->offset = plan->step / 2;
  plan->rank = rank;
  // Room for the share of the row above the rank-th of the sample, 4 standard deviations of
  // the sample's count over (a row overflows it about once in 3 x 10^6 rows): at V 256000 and k
  // 2048, 112 KiB a row, so that 8192 rows fit the default budget in one chunk (132 KiB at 6
  // standard deviations made two).
  const double share = (double(rank) + 4.0 * std::sqrt(double(rank)) + 12.0) / double(kTopkSampleColumns);
  // A whole number of 256 keys, so each row's list starts 16-byte aligned for the copies.
  plan->kept_ld = (std::max<int64_t>(k, int64_t(std::ceil(double(vocab) * share))) + 255) / 256 * 256;
  return true;
}

lmloss_status launch_topk_bar(const TopkBarArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return LMLOSS_SUCCESS;
  topk_bar_kernel<<<row_grid(a.rows), kBarThreads, 0, stream>>>(a);
  LMLOSS_CUDA_LAUNCHED("topk_bar_kernel");
  return LMLOSS_SUCCESS;
}

size_t topk_redo_bytes(int64_t vocab) { return align256(sizeof(float) * size_t(kRedoBlocks) * size_t(vocab)); }

lmloss_status launch_topk_from_kept(const TopkKeptArgs& a, cudaStream_t stream) {
  if (a.select.rows == 0) return LMLOSS_SUCCESS;
  if (a.select.k > kCapacity) return core::fail(LMLOSS_ERROR_UNSUPPORTED, "CUDA top-k above a bar: k beyond shared memory");
  return with_head_type(a.head, [&](auto element) -> lmloss_status {
    const size_t keys_bytes = sizeof(uint64_t) * size_t(kCapacity);
    LMLOSS_CHECK(allow_dynamic_shared(topk_kept_kernel, keys_bytes));
    LMLOSS_CHECK(prefer_shared_memory(topk_kept_kernel));
    topk_kept_kernel<<<row_grid(a.select.rows), kTopkRowsThreads, keys_bytes, stream>>>(a);
    LMLOSS_CUDA_LAUNCHED("topk_kept_kernel");
    const auto redo = topk_redo_kernel<decltype(element)>;
    LMLOSS_CHECK(allow_dynamic_shared(redo, kCapacity * sizeof(uint64_t)));
    const unsigned blocks = unsigned(std::min<int64_t>(a.select.rows, kRedoBlocks));
    redo<<<blocks, kTopkRowsThreads, kCapacity * sizeof(uint64_t), stream>>>(a);
    LMLOSS_CUDA_LAUNCHED("topk_redo_kernel");
    return LMLOSS_SUCCESS;
  });
}

int64_t topk_shared_capacity() { return kCapacity; }

size_t topk_scratch_bytes(int64_t rows, int64_t k) {
  if (k <= kCapacity) return 0;
  const size_t keys = align256(sizeof(uint64_t) * size_t(rows) * size_t(k));
  return 2 * keys + align256(sizeof(int64_t) * (rows + 1)) + align256(cub_temp_bytes(rows, k));
}

lmloss_status launch_topk_rows(TopkRowsArgs a, void* scratch, cudaStream_t stream) {
  if (a.rows == 0) return LMLOSS_SUCCESS;
  uint64_t* keys_out = nullptr;
  int64_t* offsets = nullptr;
  void* temp = nullptr;
  size_t temp_bytes = 0;
  if (a.k > kCapacity) {
    char* p = static_cast<char*>(scratch);
    const size_t keys = align256(sizeof(uint64_t) * size_t(a.rows) * size_t(a.k));
    a.sorted_scratch = reinterpret_cast<uint64_t*>(p);
    keys_out = reinterpret_cast<uint64_t*>(p + keys);
    offsets = reinterpret_cast<int64_t*>(p + 2 * keys);
    temp = p + 2 * keys + align256(sizeof(int64_t) * (a.rows + 1));
    temp_bytes = cub_temp_bytes(a.rows, a.k);
  }
  lmloss_status st = LMLOSS_ERROR_UNSUPPORTED;
  switch (a.logits_dtype) {
    case LMLOSS_F32: st = launch_typed<float>(a, stream); break;
    case LMLOSS_BF16: st = launch_typed<__nv_bfloat16>(a, stream); break;
    case LMLOSS_F16: st = launch_typed<__half>(a, stream); break;
    default: return core::fail(LMLOSS_ERROR_UNSUPPORTED, "CUDA top-k: unsupported logits dtype");
  }
  if (st != LMLOSS_SUCCESS || a.k <= kCapacity) return st;

  segment_offsets_kernel<<<(a.rows + 256) / 256, 256, 0, stream>>>(offsets, a.rows, a.k);
  LMLOSS_CUDA_LAUNCHED("segment_offsets_kernel");
  LMLOSS_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeysDescending(
      temp, temp_bytes, static_cast<const uint64_t*>(a.sorted_scratch), keys_out, int(a.rows * a.k), int(a.rows),
      static_cast<const int64_t*>(offsets), static_cast<const int64_t*>(offsets) + 1, 0, 64, stream));
  topk_finish_kernel<<<row_grid(a.rows), kTopkThreads, 0, stream>>>(a, keys_out);
  LMLOSS_CUDA_LAUNCHED("topk_finish_kernel");
  return LMLOSS_SUCCESS;
}

}  // namespace lmloss::cuda
