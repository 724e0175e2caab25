// Radix top-k selection (see topk.cuh): histogram passes over order-preserving keys, a shared
// memory candidate sort, and a device-memory path for k beyond shared memory.
#include "cuda/topk.cuh"

#include <cub/device/device_segmented_sort.cuh>

namespace lmloss::cuda {
namespace {

constexpr int kTopkThreads = 512;
constexpr int kCapacity = 8192;  // candidates sorted in shared memory (64 KiB of keys)
constexpr int kBins = 2048;

// Larger float -> larger unsigned key.
__device__ __forceinline__ uint32_t order_key(float s) {
  const uint32_t u = __float_as_uint(s);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}
// Sorting these descending orders by value descending, then id ascending.
__device__ __forceinline__ uint64_t composite(uint32_t key, int64_t id) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(0xffffffffu - static_cast<uint32_t>(id));
}
__device__ __forceinline__ int32_t composite_id(uint64_t c) {
  return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(c & 0xffffffffu));
}

// Radix stages: digit of the key at (shift, bits).
struct Stage {
  int shift;
  int bits;
};
__device__ constexpr Stage kStages[3] = {{21, 11}, {10, 11}, {0, 10}};

// Warp 0: the digit (bin, scanned from the top) holding the k_rem-th largest entry, and how many
// entries lie in the bins above it.
__device__ void find_digit(const int* hist, int bins, int64_t k_rem, int* digit, int* above) {
  const int lane = threadIdx.x & 31;
  const int per_lane = bins / 32;
  const int top = bins - 1 - lane * per_lane;  // this lane's bins: top, top-1, ..., top-per_lane+1
  int lane_sum = 0;
  for (int b = 0; b < per_lane; ++b) lane_sum += hist[top - b];
  int inclusive = lane_sum;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  const int exclusive = inclusive - lane_sum;
  if (exclusive < k_rem && k_rem <= inclusive) {
    int cum = exclusive;
    for (int b = 0; b < per_lane; ++b) {
      if (cum + hist[top - b] >= k_rem) {
        *digit = top - b;
        *above = cum;
        break;
      }
      cum += hist[top - b];
    }
  }
}

// Descending bitonic sort of n (a power of two) keys in shared memory.
__device__ void bitonic_sort_desc(uint64_t* keys, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
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
  }
}

// ids, probs and tail of token t from its k sorted keys (shared or device memory).
__device__ void write_output(const TopkRowsArgs& a, int64_t t, const uint64_t* sorted, float lse,
                             float* scratch) {
  const int64_t k = a.k;
  const float top = key_value(static_cast<uint32_t>(sorted[0] >> 32));
  const float base = a.renormalize ? top : lse;
  float sum = 0.f;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x)
    sum += expf(key_value(static_cast<uint32_t>(sorted[i] >> 32)) - base);
  sum = block_reduce(sum, Sum{}, 0.f, scratch);
  const float inv = a.renormalize ? 1.f / sum : 1.f;
  for (int64_t i = threadIdx.x; i < k; i += blockDim.x) {
    const uint64_t c = sorted[i];
    a.ids[t * a.ids_ld + i] = composite_id(c);
    a.probs[t * a.probs_ld + i] = expf(key_value(static_cast<uint32_t>(c >> 32)) - base) * inv;
  }
  if (a.tail && threadIdx.x == 0) a.tail[t] = a.renormalize ? 0.f : 1.f - sum;
}

template <typename T>
__global__ void __launch_bounds__(kTopkThreads) topk_rows_kernel(const TopkRowsArgs a) {
  extern __shared__ uint64_t candidates[];  // (kCapacity)
  __shared__ int hist[kBins];
  __shared__ int digit_shared, above_shared, count_shared;
  __shared__ float2 maxsum_scratch[32];
  __shared__ float sum_scratch[32];
  __shared__ int warp_counts[32];
  const int64_t V = a.vocab;
  const bool large = a.k > kCapacity;
  const int warps = blockDim.x / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
    const int64_t t = a.row0 + r;
    const T* z = static_cast<const T*>(a.logits) + r * a.logits_ld;  // (vocab)
    auto key_at = [&](int64_t j, float v) {
      return order_key(a.scale.apply(a.bias ? v + a.bias[j] : v));
    };

    // Pass 1: top digit histogram, and the row's lse when full-vocabulary probabilities are asked.
    for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    MaxSum acc{-INFINITY, 0.f};
    const bool want_lse = !a.renormalize;
    for_each_in_row(z, V, [&](int64_t j, float v) {
      const float s = a.scale.apply(a.bias ? v + a.bias[j] : v);
      atomicAdd(&hist[order_key(s) >> kStages[0].shift], 1);
      if (want_lse) {
        if (s > acc.max) {
          acc.sum = acc.sum * expf(acc.max - s) + 1.f;
          acc.max = s;
        } else {
          acc.sum += expf(s - acc.max);
        }
      }
    });
    __syncthreads();
    float lse = 0.f;
    if (want_lse) {
      acc = block_reduce_maxsum(acc, maxsum_scratch);
      lse = acc.max + logf(acc.sum);
    }

    // Narrow the bin of the k-th key until the candidates fit shared memory, or the key is exact.
    uint32_t prefix = 0;
    int shift = 32;
    int64_t k_rem = a.k, above = 0;
    bool collected = false;
    for (int stage = 0; stage < 3 && !collected; ++stage) {
      const Stage st = kStages[stage];
      if (stage > 0) {
        for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        const uint32_t mask = (1u << st.bits) - 1u;
        for_each_in_row(z, V, [&](int64_t j, float v) {
          const uint32_t key = key_at(j, v);
          if ((key >> shift) == prefix) atomicAdd(&hist[(key >> st.shift) & mask], 1);
        });
        __syncthreads();
      }
      if (warp == 0) find_digit(hist, 1 << st.bits, k_rem, &digit_shared, &above_shared);
      __syncthreads();
      const int digit = digit_shared;
      prefix = (shift == 32 ? 0u : prefix << st.bits) | static_cast<uint32_t>(digit);
      shift = st.shift;
      above += above_shared;
      k_rem -= above_shared;
      const int64_t n_candidates = above + hist[digit];
      __syncthreads();  // hist and the shared digit are reused below
      if (!large && n_candidates <= kCapacity) {
        if (threadIdx.x == 0) count_shared = 0;
        __syncthreads();
        for_each_in_row(z, V, [&](int64_t j, float v) {
          const uint32_t key = key_at(j, v);
          if ((key >> shift) >= prefix) candidates[atomicAdd(&count_shared, 1)] = composite(key, j);
        });
        __syncthreads();
        int n = 1;
        while (n < n_candidates) n <<= 1;
        for (int i = static_cast<int>(n_candidates) + threadIdx.x; i < n; i += blockDim.x) candidates[i] = 0;
        __syncthreads();
        bitonic_sort_desc(candidates, n);
        write_output(a, t, candidates, lse, sum_scratch);
        collected = true;
      }
    }
    if (collected) {
      __syncthreads();
      continue;
    }

    // Exact threshold T = prefix: every key above it, then the lowest-id keys equal to it.
    const uint32_t threshold = prefix;
    uint64_t* dest = large ? a.sorted_scratch + r * a.k : candidates;
    if (threadIdx.x == 0) count_shared = 0;
    __syncthreads();
    for_each_in_row(z, V, [&](int64_t j, float v) {
      const uint32_t key = key_at(j, v);
      if (key > threshold) dest[atomicAdd(&count_shared, 1)] = composite(key, j);
    });
    __syncthreads();
    const int64_t need = a.k - above;
    int64_t taken = 0;
    for (int64_t base = 0; base < V && taken < need; base += blockDim.x) {
      const int64_t j = base + threadIdx.x;
      const bool tie = j < V && key_at(j, to_float(z[j])) == threshold;
      const unsigned ballot = __ballot_sync(0xffffffffu, tie);
      if (lane == 0) warp_counts[warp] = __popc(ballot);
      __syncthreads();
      int64_t offset = taken;
      for (int w = 0; w < warp; ++w) offset += warp_counts[w];
      int64_t tile_total = 0;
      for (int w = 0; w < warps; ++w) tile_total += warp_counts[w];
      const int64_t rank = offset + __popc(ballot & ((1u << lane) - 1u));
      if (tie && rank < need) dest[above + rank] = composite(threshold, j);
      taken += tile_total;
      __syncthreads();
    }
    if (!large) {
      int n = 1;
      while (n < a.k) n <<= 1;
      for (int i = static_cast<int>(a.k) + threadIdx.x; i < n; i += blockDim.x) candidates[i] = 0;
      __syncthreads();
      bitonic_sort_desc(candidates, n);
      write_output(a, t, candidates, lse, sum_scratch);
    } else if (threadIdx.x == 0) {
      a.lse_scratch[r] = lse;
    }
    __syncthreads();
  }
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

size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

size_t cub_temp_bytes(int64_t rows, int64_t k) {
  size_t temp = 0;
  cub::DeviceSegmentedSort::SortKeysDescending(nullptr, temp, static_cast<const uint64_t*>(nullptr),
                                               static_cast<uint64_t*>(nullptr), rows * k, rows,
                                               static_cast<const int64_t*>(nullptr),
                                               static_cast<const int64_t*>(nullptr) + 1);
  return temp;
}

template <typename T>
lmloss_status launch_typed(const TopkRowsArgs& a, cudaStream_t stream) {
  static const cudaError_t attribute = cudaFuncSetAttribute(
      topk_rows_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, kCapacity * sizeof(uint64_t));
  if (attribute != cudaSuccess)
    return core::fail(LMLOSS_ERROR_BACKEND, std::string("topk shared memory: ") + cudaGetErrorString(attribute));
  topk_rows_kernel<T><<<row_grid(a.rows), kTopkThreads, kCapacity * sizeof(uint64_t), stream>>>(a);
  LMLOSS_CUDA_LAUNCHED("topk_rows_kernel");
  return LMLOSS_SUCCESS;
}

}  // namespace

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
  LMLOSS_CUDA_TRY(cub::DeviceSegmentedSort::SortKeysDescending(
      temp, temp_bytes, static_cast<const uint64_t*>(a.sorted_scratch), keys_out, a.rows * a.k, a.rows,
      static_cast<const int64_t*>(offsets), static_cast<const int64_t*>(offsets) + 1, stream));
  topk_finish_kernel<<<row_grid(a.rows), kTopkThreads, 0, stream>>>(a, keys_out);
  LMLOSS_CUDA_LAUNCHED("topk_finish_kernel");
  return LMLOSS_SUCCESS;
}

}  // namespace lmloss::cuda
