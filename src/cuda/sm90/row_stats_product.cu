// The forward product with row statistics in its epilogue (see ../row_stats_product.cuh), built
// with CUTLASS for sm_90a: its warp-specialised TMA/WGMMA main loop, persistent tile scheduler
// and device adapter, and an epilogue of our own that reads the f32 accumulators in registers.
//
// Tile 128 x 128 x 64 in CUTLASS's ping-pong schedule: two consumer warpgroups each own a whole
// tile and take turns, so one's epilogue runs under the other's main loop (measured on an H200,
// against the cooperative 128 x 256 kernel where both warpgroups stop for the epilogue: the
// product 12% faster at fixed clocks, at or below cuBLASLt's plain product in the forward).
// Clusters of 2 x 1 or 2 x 2 tiles, by device (device_traits): each W tile is multicast to the
// cluster's two row tiles and, in 2 x 2, each X tile to its two column tiles, so a tile pulls half
// its operands through L2, as many bytes per output as cuBLASLt's 192 x 192 tiles in 2 x 1
// clusters. Which tiles a cluster loads changes no sum: the outputs are bitwise the same.
//
// In a WGMMA accumulator fragment a thread holds four rows (r and r + 8 of its warp's 16 in each
// of the tile's two 64-row halves) and, for each, 32 of the tile's 128 columns; the four threads
// of a quad hold one row's 128 columns together. So a tile row's (max, sum exp) needs two
// shuffles and no shared memory, and exactly one lane writes it: the partials are deterministic.
//
// The shifted logits go out through shared memory: each warp holds 32 whole rows of the tile (16
// in each half), so it stages them alone (conflict-free 4-byte writes into rows padded to 272
// bytes), and each lane sends one row to global memory as a 256-byte bulk copy. The two
// warpgroups' epilogues run one after the other, so they share the stage. Stored straight from
// the registers they were 4-byte writes scattered over 8 rows per instruction (measured on an
// H200: 15% slower at 1000 x 50021 x 1024, outputs bitwise the same). The ragged last column tile
// keeps the direct stores.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/context.hpp"
#include "cuda/common.cuh"
#include "cuda/row_stats_product.cuh"
#include "cuda/topk_keys.cuh"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace lmloss::cuda {
namespace {

using namespace cute;

template <typename Element>
struct RowStatsOut {
  float inv_temperature;
  const void* labels;              // (n_tokens) or null
  lmloss_dtype labels_dtype;
  int64_t row0;
  float4* partial;                 // (rows, partial_ld)
  int64_t partial_ld;
  float* label_s;                  // (rows)
  Element* shifted;                // (rows, shifted_ld) or null
  int64_t shifted_ld;
  const float* exp_shift;          // (rows) or null: shifted in the exponential form
  uint64_t* candidates;            // (rows, candidates_ld): with kKeepGroupBest
  uint64_t* runners_up;            // (rows, candidates_ld): with kKeepGroupBest
  int64_t candidates_ld;
  const float* keep_above;         // (rows): with kKeepAbove
  uint64_t* kept;                  // (rows, kept_ld): with kKeepAbove
  int32_t* kept_count;             // (rows): with kKeepAbove
  int64_t kept_ld;
};

// What a top-k product keeps of the logits (none: the loss's product).
enum TopkKeep { kKeepNone, kKeepGroupBest, kKeepAbove };

// A collective epilogue in the interface of CUTLASS's register-only ones (wrapped for the sm_90
// kernels by Sm90TmaWarpSpecializedAdapter): it stores the tile's statistics and, if asked, its
// shifted logits. A top-k kernel (one of its own, so the loss's keeps its registers) keeps
// instead each row's largest logit of every column group (a thread's 32 columns) and the group's
// runners-up (kKeepGroupBest) or every logit at or above its row's bar (kKeepAbove), and of the
// statistics only max and sum of exponentials, only with kStatistics (a top-k whose
// probabilities are renormalised over the k needs no lse, so its epilogue keeps logits alone:
// every instruction per logit here shows in the product's time).
template <typename Element, TopkKeep kKeep, bool kStatistics>
class RowStatsEpilogue {
  static constexpr bool kTopk = kKeep != kKeepNone;
  static_assert(kTopk || kStatistics, "the loss's epilogue keeps the statistics");

 public:
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<float, 1, float, float>;
  using ElementC = float;
  using ElementD = float;
  using ElementOutput = float;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using StrideC = Stride<int64_t, Int<1>, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  static constexpr int kTileRows = 128;
  static constexpr int kStageColumns = 128;                 // columns staged at a time
  static constexpr int kStageLd = kStageColumns + 8;        // 272-byte rows: 16-byte aligned, no bank conflicts
  struct SharedStorage {
    alignas(128) Element stage[kTileRows * kStageLd];
  };
  using TensorStorage = SharedStorage;
  using Arguments = RowStatsOut<Element>;
  using Params = RowStatsOut<Element>;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE explicit RowStatsEpilogue(Params const& params, SharedStorage const& = SharedStorage())
      : params_(params) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_mnkl, TileShapeMNK tile_mnk, TileCoordMNKL tile_coord,
                                 Tensor<AccEngine, AccLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char* shared) {
    static_assert(rank<0>(AccLayout{}) == 3 && size<0, 0>(AccLayout{}) == 2 && size<0, 1>(AccLayout{}) == 2,
                  "expected a WGMMA accumulator fragment ((2 columns, 2 row halves, N/8), MMA_M, MMA_N)");
    constexpr int kSlots = 2 * size<1>(AccLayout{});  // rows this thread holds
    const int rows = get<0>(problem_mnkl);
    const int vocab = get<1>(problem_mnkl);
    const int m_tile = get<0>(tile_coord);
    const int n_tile = get<1>(tile_coord);
    // A tile wholly past the problem stores nothing: a grid padded to whole clusters (odd counts of
    // row or column tiles) or to swizzle groups would otherwise write partials past a row's last tile.
    if (m_tile * int(size<0>(tile_mnk)) >= rows || n_tile * int(size<1>(tile_mnk)) >= vocab) return;
    Tensor coords = local_tile(make_identity_tensor(make_shape(rows, vocab)), take<0, 2>(tile_mnk),
                               make_coord(m_tile, n_tile));                       // (TILE_M, TILE_N)
    Tensor thread_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(coords);  // like accumulators
    auto const& z = accumulators;  // (like thread_coords) the tile's logits, f32
    auto slot_of = [](int i) { return row_slot<AccLayout>(i); };

    int row_of[kSlots];
    int64_t label_of[kSlots];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(z); ++i) {
      const auto c = idx2crd(i, shape(AccLayout{}));
      if (get<0, 0>(c) == 0 && get<0, 2>(c) == 0 && get<2>(c) == 0) row_of[slot_of(i)] = get<0>(thread_coords(i));
    }
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kSlots; ++k)
      label_of[k] = params_.labels && row_of[k] < rows
                        ? load_id(params_.labels, params_.labels_dtype, params_.row0 + row_of[k]) : -1;
    // The exponential form's shifts, loaded here so that their latency passes under the max pass.
    float shift_of[kSlots];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kSlots; ++k)
      shift_of[k] = !kTopk && params_.exp_shift && row_of[k] < rows ? params_.exp_shift[row_of[k]] : -INFINITY;

    // s = z / T. The epilogue runs between main loops, so every instruction per element shows in
    // the product's time (measured on an H200: applying soft-capping and a bias twice per element
    // made it 80% slower): two lean passes over z, the column test only in the ragged last tile.
    // exp(s - max s) = 2^((z - max z) log2(e) / T), and T > 0 makes max s = (max z) / T exactly.
    const float inv_t = params_.inv_temperature;
    const float to_log2 = inv_t * kLog2e;
    const int tile_cols = int(size<1>(tile_mnk)), tile_col0 = n_tile * tile_cols;
    float row_max[kSlots], row_sum[kSlots], row_sum_s[kSlots];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kSlots; ++k) {
      row_max[k] = -INFINITY;
      row_sum[k] = row_sum_s[k] = 0.f;
    }
    auto statistics = [&](auto ragged) {
      auto in_vocab = [&](int col) { return !decltype(ragged)::value || col < vocab; };
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(z); ++i) {
        const int k = slot_of(i);
        if (!in_vocab(get<1>(thread_coords(i)))) continue;
        row_max[k] = fmaxf(row_max[k], z(i));
      }
      // The label's logit, looked for only where a row's label falls in this tile (one tile of a
      // row's V / 128): tested at every logit, the 64-bit compare and the predicated store cost
      // ~400 instructions a warp per tile (ncu's SASS counts on an H200).
      if constexpr (!kTopk) {  // top-k has no labels
        bool label_here = false;
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kSlots; ++k) label_here |= label_of[k] >= tile_col0 && label_of[k] < tile_col0 + tile_cols;
        if (label_here) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(z); ++i) {
            const int k = slot_of(i);
            if (get<1>(thread_coords(i)) == label_of[k]) params_.label_s[row_of[k]] = z(i) * inv_t;
          }
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kSlots; ++k) {
        row_max[k] = fmaxf(row_max[k], __shfl_xor_sync(0xffffffffu, row_max[k], 1));
        row_max[k] = fmaxf(row_max[k], __shfl_xor_sync(0xffffffffu, row_max[k], 2));
      }
      // The exponential form sums the values it stores (one exponential per logit, not two).
      const bool exp_form = !kTopk && params_.shifted && params_.exp_shift;
      if (!exp_form) {
        float max_log2[kSlots];  // 2^(z log2(e) / T - this) = exp(s - max s): one FMA a logit
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kSlots; ++k) max_log2[k] = row_max[k] * to_log2;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(z); ++i) {
          if (!in_vocab(get<1>(thread_coords(i)))) continue;
          const int k = slot_of(i);
          row_sum[k] += exp2_ftz(fmaf(z(i), to_log2, -max_log2[k]));
          if constexpr (!kTopk) row_sum_s[k] += z(i);  // top-k's lse needs no sum of s
        }
      }
      if constexpr (kTopk) return;  // top-k stores no logits
      if (!params_.shifted) return;
      float offset[kSlots];  // what each row's stored values are relative to (see stored())
      float stored_sum[kSlots];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kSlots; ++k) {
        offset[k] = stored_offset(row_max[k], shift_of[k]);
        stored_sum[k] = 0.f;
      }
      if constexpr (!decltype(ragged)::value) {
        store_shifted_staged(z, thread_coords, offset, stored_sum, rows, m_tile, n_tile, thread_idx, shared);
      } else {
        // Fragment elements i and i + 1 (i even) are columns c and c + 1 of one row.
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(z); i += 2) {
          const int row = get<0>(thread_coords(i));
          const int col = get<1>(thread_coords(i));
          const int k = slot_of(i);
          if (row >= rows || !in_vocab(col)) continue;
          Element* out = params_.shifted + int64_t(row) * params_.shifted_ld + col;
          const float first = stored(z(i), offset[k]);
          stored_sum[k] += first;
          if (in_vocab(col + 1)) {
            const float second = stored(z(i + 1), offset[k]);
            stored_sum[k] += second;
            cutlass::Array<Element, 2> pair;
            pair[0] = Element(first);
            pair[1] = Element(second);
            *reinterpret_cast<cutlass::Array<Element, 2>*>(out) = pair;
          } else {
            *out = Element(first);
          }
        }
      }
      if (exp_form) {  // sum exp(s - max s) = sum exp(s - ref) exp(ref - max s), taken in log2 since
                       // exp(ref - max s) alone may overflow where the stored values underflowed
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kSlots; ++k)
          row_sum[k] = stored_sum[k] > 0.f ? exp2f(log2f(stored_sum[k]) + offset[k] - row_max[k] * to_log2) : 0.f;
      }
    };
    if constexpr (kStatistics) {
      if ((n_tile + 1) * int(size<1>(tile_mnk)) <= vocab) statistics(cute::false_type{});
      else statistics(cute::true_type{});
    }
    if constexpr (kKeep == kKeepGroupBest) {
      if ((n_tile + 1) * int(size<1>(tile_mnk)) <= vocab) store_candidates<false>(z, thread_coords, row_of, rows, vocab, n_tile);
      else store_candidates<true>(z, thread_coords, row_of, rows, vocab, n_tile);
    }
    if constexpr (kKeep == kKeepAbove) {
      if ((n_tile + 1) * int(size<1>(tile_mnk)) <= vocab) store_above<false>(z, thread_coords, row_of, rows, vocab, thread_idx);
      else store_above<true>(z, thread_coords, row_of, rows, vocab, thread_idx);
    }
    if constexpr (kStatistics) {
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kSlots; ++k) {
        row_max[k] *= inv_t;
        row_sum_s[k] *= inv_t;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kSlots; ++k) {
#pragma unroll
        for (int lane_mask = 1; lane_mask <= 2; lane_mask <<= 1) {
          row_sum[k] += __shfl_xor_sync(0xffffffffu, row_sum[k], lane_mask);
          row_sum_s[k] += __shfl_xor_sync(0xffffffffu, row_sum_s[k], lane_mask);
        }
        if ((thread_idx & 3) == 0 && row_of[k] < rows)
          params_.partial[int64_t(row_of[k]) * params_.partial_ld + n_tile] =
              make_float4(row_max[k], row_sum[k], row_sum_s[k], 0.f);
      }
    }
  }

 private:
  // The stored value of logit z: the shifted logit s - max s = (z - max_z) / T, offset = max_z
  // the row's tile max; or in the exponential form exp(s - ref) = 2^(z log2(e) / T - offset),
  // offset = ref log2(e), ref = max(exp_shift[row], max s - kExpFormMargin): no value above e^60.
  CUTLASS_DEVICE float stored_offset(float max_z, float shift) const {
    if (!params_.exp_shift) return max_z;
    return fmaxf(shift, __fmul_rn(max_z, params_.inv_temperature) - kExpFormMargin) * kLog2e;
  }
  // In f32, before the rounding to Element.
  CUTLASS_DEVICE float stored(float z, float offset) const {
    if (params_.exp_shift) return exp2_ftz(fmaf(z, params_.inv_temperature * kLog2e, -offset));
    return (z - offset) * params_.inv_temperature;
  }

  // Each row's largest logit of every column group (the 32 columns of the tile that one thread
  // of the quad holds: 8 j + 2 g + e) as a top-k composite, and the group's runners-up beside it:
  // the second-largest with its place in the group, a bound on the third (topk_keys.cuh). One pass
  // over the accumulators, no shuffles: every thread writes its own group's pair. Compared before
  // the scaling by 1/T > 0, which keeps the order; equal values go to the lower column, as in the
  // top-k order.
  template <bool kRagged, class Z, class Coords, int kSlots>
  CUTLASS_DEVICE void store_candidates(Z const& z, Coords const& thread_coords, const int (&row_of)[kSlots], int rows,
                                       int vocab, int n_tile) const {
    auto slot_of = [](int i) { return row_slot<decltype(z.layout())>(i); };
    float best[kSlots], second[kSlots], third[kSlots];
    int best_col[kSlots], second_col[kSlots];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kSlots; ++k) {
      best[k] = second[k] = third[k] = -INFINITY;
      best_col[k] = second_col[k] = -1;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(z); ++i) {
      const int col = get<1>(thread_coords(i));
      if (kRagged && col >= vocab) continue;
      const int k = slot_of(i);
      // Each value passes down the three by min and max, without branches (written with them, it
      // compiled to about twice the instructions). Equal values: the first seen is the lower
      // column (columns_rise_along_rows).
      const float v = z(i);
      const bool above_best = v > best[k], above_second = v > second[k];
      second_col[k] = above_best ? best_col[k] : above_second ? col : second_col[k];
      best_col[k] = above_best ? col : best_col[k];
      third[k] = fmaxf(third[k], fminf(second[k], v));
      second[k] = fmaxf(second[k], fminf(best[k], v));
      best[k] = fmaxf(best[k], v);
    }
    const float inv_t = params_.inv_temperature;
    const int group = (get<1>(thread_coords(0)) % 8) / 2;
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kSlots; ++k) {
      if (row_of[k] >= rows) continue;
      const int64_t at = int64_t(row_of[k]) * params_.candidates_ld + int64_t(n_tile) * kTopkCandidatesPerTile + group;
      params_.candidates[at] = best_col[k] >= 0 ? composite(order_key(best[k] * inv_t), best_col[k]) : 0;
      const int second_place = group_place(second_col[k]);
      params_.runners_up[at] = second_col[k] >= 0
                                   ? runners_up(order_key(second[k] * inv_t), second_place,
                                                third[k] > -INFINITY ? order_key(third[k] * inv_t) : 0u)
                                   : 0;
    }
  }

  // Every logit at or above its row's bar as a top-k composite, appended to the row's list. The
  // bar is in the accumulators' units (topk.cuh: z >= it exactly where z / T >= the bar on s),
  // so the passes compare without scaling; a pass counts each thread's, the quad (the row's four
  // threads) sums them and takes its room in the list with one atomic, and a second pass writes
  // them. The list is in no order (the selection sorts it), so the outputs stay deterministic.
  // The count goes on past kept_ld, so the selection knows a list overflowed (and redoes its
  // row): a thread whose share would not fit writes none of it. The second pass compares with a
  // bar of its own (NaN, which nothing reaches, where the thread writes nothing), so that the
  // compiler cannot keep the first pass's 128 outcomes as bits of a register, and each row's
  // list pointer is formed once. (Before, with those bits (5 instructions a logit) and each
  // store's address formed anew, the epilogue issued ~3,600 instructions a warp per tile at
  // gemma2-2b top-k 2048, top-k 64's ~1,500, and was the product's critical path: 15.4 ms
  // against 14.3 after, by ncu on an H200.)
  template <bool kRagged, class Z, class Coords, int kSlots>
  CUTLASS_DEVICE void store_above(Z const& z, Coords const& thread_coords, const int (&row_of)[kSlots], int rows,
                                  int vocab, int thread_idx) const {
    auto slot_of = [](int i) { return row_slot<decltype(z.layout())>(i); };
    const float inv_t = params_.inv_temperature;
    const float unreached = __int_as_float(0x7fffffff);  // NaN: no logit is at or above it
    float bar[kSlots];  // unreached beyond the chunk's rows
    int passed[kSlots];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kSlots; ++k) {
      bar[k] = row_of[k] < rows ? params_.keep_above[row_of[k]] : unreached;
      passed[k] = 0;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(z); ++i) {
      if (kRagged && get<1>(thread_coords(i)) >= vocab) continue;
      const int k = slot_of(i);
      passed[k] += z(i) >= bar[k];
    }
    const int quad_lane = thread_idx & 3;
    const int64_t kept_ld = params_.kept_ld;
    float write_bar[kSlots];  // bar[k], or unreached where this thread's share does not fit the list
    uint64_t* out[kSlots];    // this thread's next place in its row's list
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kSlots; ++k) {
      int inclusive = passed[k];
      int up = __shfl_up_sync(0xffffffffu, inclusive, 1, 4);
      if (quad_lane >= 1) inclusive += up;
      up = __shfl_up_sync(0xffffffffu, inclusive, 2, 4);
      if (quad_lane >= 2) inclusive += up;
      const int total = __shfl_sync(0xffffffffu, inclusive, 3, 4);
      int base = 0;
      if (quad_lane == 0 && total > 0) base = atomicAdd(&params_.kept_count[row_of[k]], total);
      const int64_t at = __shfl_sync(0xffffffffu, base, 0, 4) + inclusive - passed[k];
      const bool fits = passed[k] > 0 && at + passed[k] <= kept_ld;
      write_bar[k] = fits ? bar[k] : unreached;
      asm volatile("" : "+f"(write_bar[k]));  // opaque to the compiler: no reuse of the first pass
      out[k] = params_.kept + (fits ? int64_t(row_of[k]) * kept_ld + at : 0);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(z); ++i) {
      const int col = get<1>(thread_coords(i));
      if (kRagged && col >= vocab) continue;
      const int k = slot_of(i);
      if (z(i) >= write_bar[k]) *out[k]++ = composite(order_key(z(i) * inv_t), col);
    }
  }

  // 2^x by the multifunction unit alone, results below 2^-126 flushed to zero: exp2f keeps them
  // as subnormals at three more instructions a call (a compare and two scalings, on an H200's
  // SASS), which the epilogue pays per logit. A softmax term that small is lost beside the row's
  // largest (1) anyway, and a stored one was a subnormal bf16 gradient.
  CUTLASS_DEVICE static float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  }

  // Which of the thread's rows accumulator element i belongs to.
  template <class AccLayout>
  CUTLASS_DEVICE static constexpr int row_slot(int i) {
    const auto c = idx2crd(i, shape(AccLayout{}));
    return get<0, 1>(c) + 2 * get<1>(c);
  }

  // The stored values of a full column tile, through shared memory and bulk copies (see the top).
  template <class Z, class Coords, int kSlots>
  CUTLASS_DEVICE void store_shifted_staged(Z const& z, Coords const& thread_coords, const float (&row_offset)[kSlots],
                                           float (&stored_sum)[kSlots],
                                           int rows, int m_tile, int n_tile, int thread_idx, char* shared) const {
    auto slot_of = [](int i) { return row_slot<decltype(z.layout())>(i); };
    Element* stage = reinterpret_cast<SharedStorage*>(shared)->stage;
    const int row0 = m_tile * kTileRows;
    const int col0 = n_tile * int(kRowStatsTileColumns);
    const int warp = thread_idx / 32, lane = thread_idx % 32;
    // This thread's first column; the others are fixed offsets from it.
    const int first_col = get<1>(thread_coords(0));
    CUTLASS_PRAGMA_UNROLL
    for (int part = 0; part < int(kRowStatsTileColumns) / kStageColumns; ++part) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(z); i += 2) {
        const int offset = get<1>(thread_coords(i)) - first_col;
        if (offset / kStageColumns != part) continue;
        const int k = slot_of(i);
        cutlass::Array<Element, 2> pair;
        const float first = stored(z(i), row_offset[k]), second = stored(z(i + 1), row_offset[k]);
        stored_sum[k] += first;
        stored_sum[k] += second;
        pair[0] = Element(first);
        pair[1] = Element(second);
        const int r = get<0>(thread_coords(i)) - row0;
        const int c = first_col - col0 + offset - part * kStageColumns;
        *reinterpret_cast<cutlass::Array<Element, 2>*>(&stage[r * kStageLd + c]) = pair;
      }
      cute::tma_store_fence();  // the writes above, visible to the bulk copies
      __syncwarp();
      // The warp's rows: kMmaM blocks of 16, 64 apart (one per 64-row WGMMA atom), within its
      // warpgroup's rows (warpgroups split a tile's rows in the cooperative schedule).
      constexpr int kMmaM = size<1>(typename Z::layout_type{});
      if (lane < 16 * kMmaM) {
        const int r = (warp / 4) * 64 * kMmaM + (lane / 16) * 64 + (warp % 4) * 16 + lane % 16;
        if (row0 + r < rows) {
          Element* out = params_.shifted + int64_t(row0 + r) * params_.shifted_ld + col0 + part * kStageColumns;
          cute::SM90_BULK_COPY_S2G::copy(&stage[r * kStageLd], out, kStageColumns * int(sizeof(Element)));
        }
        cute::tma_store_arrive();
        cute::tma_store_wait<0>();  // the stage read out before anyone writes it again
      }
      __syncwarp();
    }
  }

  Params params_;
};

// Whether each thread of TiledMma meets the columns of each of its rows of the (kTileM, kTileN)
// C tile in rising order of its accumulator index (the same for every thread: their coordinates
// differ by a fixed offset). store_candidates keeps the first of equal values on that ground.
template <class TiledMma, int kTileM, int kTileN>
constexpr bool columns_rise_along_rows() {
  const auto coords =
      TiledMma{}.get_thread_slice(0).partition_C(make_identity_tensor(Shape<Int<kTileM>, Int<kTileN>>{}));
  int last_col[kTileM] = {};
  for (int r = 0; r < kTileM; ++r) last_col[r] = -1;
  for (int i = 0; i < int(size(coords)); ++i) {
    const int row = get<0>(coords(i)), col = get<1>(coords(i));
    if (col <= last_col[row]) return false;
    last_col[row] = col;
  }
  return true;
}

// How many of the kernel's clusters the device holds at once, for the persistent scheduler's grid;
// 0 if unknown, where CUTLASS falls back to its own estimate. That estimate assumes GPCs of 18
// SMs: for clusters of four on a 132-SM card it launches 116 CTAs, where the H100 and H200 measured
// hold 120. CUTLASS's own query leaves out the kernel's shared memory, and so counts more than fit.
template <typename Kernel>
int query_max_active_clusters() {
  const void* kernel = reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
  const int smem = int(Kernel::SharedStorageSize);
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = size<0>(typename Kernel::ClusterShape{});
  cluster.val.clusterDim.y = size<1>(typename Kernel::ClusterShape{});
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(cluster.val.clusterDim.x, cluster.val.clusterDim.y, 1);
  config.blockDim = dim3(Kernel::MaxThreadsPerBlock, 1, 1);
  config.dynamicSmemBytes = size_t(smem);
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess ||
      cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return clusters;
}

// The device's room for the kernel's clusters, queried once per device and kernel: every call
// plans twice (checking, then running). The SM count is left to CUTLASS, as before. A failed query
// is not remembered (as in device_traits): CUTLASS estimates the room for that call, and the next
// asks again.
constexpr int kDevices = 64;  // the devices whose properties are remembered; others are not
template <typename Kernel>
cutlass::KernelHardwareInfo hardware_info(int device) {
  static std::atomic<int> known[kDevices];  // the count; 0 not yet known
  cutlass::KernelHardwareInfo info;
  info.device_id = device;
  if (device < 0 || device >= kDevices) return info;
  int clusters = known[device].load(std::memory_order_relaxed);
  if (clusters == 0) {
    clusters = query_max_active_clusters<Kernel>();  // 0 where the query failed
    if (clusters > 0) known[device].store(clusters, std::memory_order_relaxed);
  }
  info.max_active_clusters = clusters;
  return info;
}

// kClusterColumns: 2 for clusters of 2 x 2 tiles, 1 for 2 x 1 (see device_traits).
template <typename Element, TopkKeep kKeep, bool kStatistics, int kClusterColumns>
struct RowStatsGemm {
  using TileShape = Shape<_128, Int<int(kRowStatsTileColumns)>, _64>;
  using ClusterShape = Shape<_2, Int<kClusterColumns>, _1>;
  using Epilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<RowStatsEpilogue<Element, kKeep, kStatistics>>;
  // A = X (rows, hidden) row-major; B = W (vocab, hidden): K-major, CUTLASS's column-major B.
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::TensorStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(size<1>(TileShape{}) == kRowStatsTileColumns, "one partial per column tile");
  static_assert(size<0>(TileShape{}) * size<0>(ClusterShape{}) == kRowStatsClusterRows, "a cluster's rows");
  static_assert(columns_rise_along_rows<typename Mainloop::TiledMma, size<0>(TileShape{}), size<1>(TileShape{})>(),
                "store_candidates takes the first of equal values for the lowest column");
  static_assert(size<0>(TileShape{}) == RowStatsEpilogue<Element, kKeep, kStatistics>::kTileRows, "the staging buffer's rows");

  static typename Device::Arguments arguments(const RowStatsProductArgs& a) {
    const RowStatsOut<Element> out{a.inv_temperature,
                                   a.labels,
                                   a.labels_dtype,
                                   a.row0,
                                   a.partial,
                                   a.partial_ld,
                                   a.label_s,
                                   static_cast<Element*>(a.shifted),
                                   a.shifted_ld,
                                   a.exp_shift,
                                   a.candidates,
                                   a.runners_up,
                                   a.candidates_ld,
                                   a.keep_above,
                                   a.kept,
                                   a.kept_count,
                                   a.kept_ld};
    return {cutlass::gemm::GemmUniversalMode::kGemm,
            {int(a.rows), int(a.vocab), int(a.hidden_size), 1},
            {static_cast<const Element*>(a.hidden), {a.hidden_ld, Int<1>{}, int64_t(0)},
             static_cast<const Element*>(a.weight), {a.weight_ld, Int<1>{}, int64_t(0)}},
            out,
            hardware_info<Kernel>(a.device)};
  }

  static size_t workspace(const RowStatsProductArgs& a) { return Device::get_workspace_size(arguments(a)); }

  static lmloss_status run(const RowStatsProductArgs& a, void* workspace, cudaStream_t stream) {
    const auto args = arguments(a);
    Device gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st == cutlass::Status::kSuccess) st = gemm.initialize(args, workspace, stream);
    if (st == cutlass::Status::kSuccess) st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess)
      return core::fail(LMLOSS_ERROR_BACKEND,
                        std::string("row statistics product: ") + cutlass::cutlassGetStatusString(st));
    return LMLOSS_SUCCESS;
  }
};

// Clusters of 2 x 2 tiles halve the operand bytes a tile pulls through L2 against 2 x 1, but a GPC
// holds fewer clusters of four: 30 (120 of 132 SMs) against 66 of two on the H100 and H200 measured.
// So 2 x 2 pays where the 2 x 1 product is bound by L2 bandwidth, as on the H100 (ncu: 87% of L2
// peak, 66% with 2 x 2; 0.5-1.1 ms off every mode), and not where the die's whole 60 MiB of L2 is
// enabled, as on the H200 (2 x 2 there 0.7-1.6 ms slower in every mode). The L2's size tells them
// apart. LMLOSS_PRODUCT_CLUSTERS=2x1 or 2x2 in the environment overrides the choice (read once).
constexpr int kFullL2Bytes = 60 << 20;

struct DeviceTraits {
  bool sm90 = false;           // sm_90a code runs on it
  bool wide_clusters = false;  // the product runs in 2 x 2 clusters
};

int clusters_from_environment() {  // 0 unset, 1 for 2 x 1, 2 for 2 x 2
  static const int choice = [] {
    const char* v = std::getenv("LMLOSS_PRODUCT_CLUSTERS");
    if (v == nullptr || *v == 0) return 0;
    if (std::strcmp(v, "2x1") == 0) return 1;
    if (std::strcmp(v, "2x2") == 0) return 2;
    std::fprintf(stderr, "lmloss: LMLOSS_PRODUCT_CLUSTERS=%s ignored: 2x1 or 2x2\n", v);
    return 0;
  }();
  return choice;
}

// Read once per device: every call plans twice (checking, then running).
DeviceTraits device_traits(int device) {
  static std::atomic<int8_t> known[kDevices];  // 0 unknown, else 1 | sm90 << 1 | wide << 2
  if (device < 0 || device >= kDevices) return {};
  int8_t k = known[device].load(std::memory_order_relaxed);
  if (k == 0) {
    int major = 0, minor = 0, l2_bytes = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
                    cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device) == cudaSuccess;
    if (!ok) {
      cudaGetLastError();
      return {};  // not remembered: a later call may find the device
    }
    const int forced = clusters_from_environment();
    const bool wide = forced ? forced == 2 : l2_bytes < kFullL2Bytes;
    k = int8_t(1 | (major == 9 && minor == 0) << 1 | wide << 2);
    known[device].store(k, std::memory_order_relaxed);
  }
  return {(k & 2) != 0, (k & 4) != 0};
}

// The kernel for the args' dtype, outputs and device: f(RowStatsGemm<...>{}).
template <typename Element, int kClusterColumns, typename F>
auto with_outputs(const RowStatsProductArgs& args, F&& f) {
  if (args.keep_above)
    return args.partial ? f(RowStatsGemm<Element, kKeepAbove, true, kClusterColumns>{})
                        : f(RowStatsGemm<Element, kKeepAbove, false, kClusterColumns>{});
  if (!args.candidates) return f(RowStatsGemm<Element, kKeepNone, true, kClusterColumns>{});
  return args.partial ? f(RowStatsGemm<Element, kKeepGroupBest, true, kClusterColumns>{})
                      : f(RowStatsGemm<Element, kKeepGroupBest, false, kClusterColumns>{});
}

// f(Element{}, std::integral_constant<int, kClusterColumns>{}) for the args' dtype and the
// device's clusters: the one place that chooses them, for running and for sizing.
template <typename F>
auto with_family(const RowStatsProductArgs& args, F&& f) {
  auto with_clusters = [&](auto element) {
    return device_traits(args.device).wide_clusters ? f(element, std::integral_constant<int, 2>{})
                                                     : f(element, std::integral_constant<int, 1>{});
  };
  return args.dtype == LMLOSS_F16 ? with_clusters(cutlass::half_t{}) : with_clusters(cutlass::bfloat16_t{});
}
template <typename F>
auto with_gemm(const RowStatsProductArgs& args, F&& f) {
  return with_family(args, [&](auto element, auto clusters) {
    return with_outputs<decltype(element), decltype(clusters)::value>(args, f);
  });
}

// The plans size the workspace before they choose what the product keeps (statistics, candidates
// or a bar's list), so it is the most any of the family's kernels (with_outputs') takes.
template <typename Element, int kClusterColumns>
size_t any_kernel_workspace(const RowStatsProductArgs& a) {
  return std::max({RowStatsGemm<Element, kKeepNone, true, kClusterColumns>::workspace(a),
                   RowStatsGemm<Element, kKeepGroupBest, true, kClusterColumns>::workspace(a),
                   RowStatsGemm<Element, kKeepGroupBest, false, kClusterColumns>::workspace(a),
                   RowStatsGemm<Element, kKeepAbove, true, kClusterColumns>::workspace(a),
                   RowStatsGemm<Element, kKeepAbove, false, kClusterColumns>::workspace(a)});
}

}  // namespace

bool row_stats_product_supported(int device, lmloss_dtype dtype, const void* hidden, int64_t hidden_ld,
                                 const void* weight, int64_t weight_ld, int64_t hidden_size) {
  if (dtype != LMLOSS_BF16 && dtype != LMLOSS_F16) return false;
  // The tensor-memory copies move 16-byte rows from 16-byte-aligned addresses.
  if (hidden_size % 8 || hidden_ld % 8 || weight_ld % 8 || !aligned16(hidden) || !aligned16(weight)) return false;
  return sm90_kernels_run(device);
}

bool sm90_kernels_run(int device) { return device_traits(device).sm90; }

size_t row_stats_product_workspace(const RowStatsProductArgs& args) {
  return align256(with_family(args, [&](auto element, auto clusters) {
    return any_kernel_workspace<decltype(element), decltype(clusters)::value>(args);
  }));
}

lmloss_status run_row_stats_product(const RowStatsProductArgs& args, void* workspace, cudaStream_t stream) {
  if (args.dtype != LMLOSS_BF16 && args.dtype != LMLOSS_F16)
    return core::fail(LMLOSS_ERROR_UNSUPPORTED, "row statistics product: bf16 or f16 only");
  return with_gemm(args, [&](auto gemm) { return decltype(gemm)::run(args, workspace, stream); });
}

}  // namespace lmloss::cuda
