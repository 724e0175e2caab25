// The CUDA backend: planning (chunk rows from the workspace budget), workspace, and the
// pipelines that chain the products and row kernels of one call on the caller's stream.
//
// Linear head, per chunk of `rows` tokens (logits never exist beyond the chunk):
//   Z   (rows, vocab) f32  = X_chunk W^T                      cuBLASLt
//   row kernel: loss, lse, and dZ written over Z (narrowed in place to 16-bit inputs' dtype),
//               or, where dW is wanted and that gives fewer chunks, into a dense G (rows, vocab)
//               of the input dtype that several smaller Z chunks fill in turn
//               (plan_separate_grad); f16 gradients are stored times S (see CallScalars)
//   dX_chunk (rows, hidden) = G W / S                          cuBLASLt
//   dW (vocab, hidden)     += G^T X_chunk / S                  cuBLASLt, beta 1 after the first chunk
//                              (16-bit: in f32 on request, rounded once: core::weight_sum_rows_in_place)
//   db (vocab)             += column sums of G / S, rows in order
// A forward (without a teacher) or fused call of a 16-bit linear head without bias or
// soft-capping, on an sm_90 device, takes each chunk's statistics in the product's epilogue
// instead (row_stats_product.cuh): no logits chunk for a forward (whose chunks are at most
// kForwardProductRows, for L2's sake, as are top-k's and the product's launches over a fused
// call's chunks); for a fused call the product stores the shifted logits in the inputs' dtype,
// the row kernel reads s at the teacher ids from them and writes the gradient over them; with
// bf16 and no label smoothing, in the exponential form (loss_rows.cuh), where most rows need no
// gradient pass:
//   shift (rows) = s at each row's label, a dot product per row            exp_shift_kernel
//   E (rows, vocab) bf16 = exp(S - shift), partials                        the product's epilogue
//   row kernel: loss, lse, the sparse entries of E corrected, f (rows)     (far rows: G over E)
//               and c (rows), dl/dz at the label less its softmax part
//   dX_chunk = f * (E W) token_scale + c W[label], through f32       (with dW: on a second
//               stream beside dW's product, joined before the next chunk)
//   dW += E^T (f * X_chunk) token_scale, then += c X_chunk at the labels   (tokens ordered by
//               label once per call, so each label's rows are summed in order: deterministic)
//   a bf16 dW summed in f32: the last chunk's product stored as bf16 over the sum, in place,
//               its terms at the labels added first (weight_grad_store.cuh; no rounding pass)
// A frozen head (dX only) in the exponential form that would take kSlicedMinChunks or more token
// chunks takes slices of the vocabulary instead, each at full height (run_sliced_dx).
// Teacher top-k through such a head (k up to
// kTopkFromProductMaxK) has the product keep each tile's largest logits and selects from those;
// for larger k, every logit above a bar each row takes from a sample of its logits (topk.cuh).
// Nothing here waits for the device: the loss, lse and gradients stay where the caller pointed.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>

#include "core/backend.hpp"
#include "core/context.hpp"
#include "core/dtype.hpp"
#include "cuda/common.cuh"
#include "cuda/cublaslt_library.hpp"
#include "cuda/loss_rows.cuh"
#include "cuda/matmul.cuh"
#include "cuda/row_stats_product.cuh"
#include "cuda/topk.cuh"
#include "cuda/weight_grad_store.cuh"

namespace lmloss::cuda {
namespace {

constexpr size_t kMatmulWorkspace = size_t(32) << 20;
constexpr size_t kSampleMatmulWorkspace = size_t(4) << 20;
using core::row_stride;  // vectors here are contiguous: check_vector refuses strided ones

// Per-context state: the cuBLASLt handle and plans, and the device's error flag.
class CudaState : public core::BackendState {
 public:
  ~CudaState() override {
    if (!error_flag && !side_stream) return;
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    if (error_flag) cudaFree(error_flag);
    if (side_stream) {
      cudaEventDestroy(fork_event);
      cudaEventDestroy(join_event);
      cudaStreamDestroy(side_stream);
    }
    cudaSetDevice(previous);
  }
  // A second stream for work that runs beside the call's own (see SideStream), with the events
  // that fork onto it and join it back; made with the state, on its device.
  lmloss_status side(cudaStream_t* out) {
    if (!side_stream) {
      LMLOSS_CUDA_TRY(cudaEventCreateWithFlags(&fork_event, cudaEventDisableTiming));
      LMLOSS_CUDA_TRY(cudaEventCreateWithFlags(&join_event, cudaEventDisableTiming));
      LMLOSS_CUDA_TRY(cudaStreamCreateWithFlags(&side_stream, cudaStreamNonBlocking));
    }
    *out = side_stream;
    return LMLOSS_SUCCESS;
  }
  int device = -1;
  MatmulCache matmul;
  int* error_flag = nullptr;  // set by kernels that meet an id out of range
  cudaStream_t side_stream = nullptr;
  cudaEvent_t fork_event = nullptr, join_event = nullptr;
};

// Work enqueued on the state's side stream after everything already on `stream`, and joined back
// into `stream` when this goes out of scope, on every path out (an early error return included):
// the workspace is returned on `stream`, and the caller's next work must wait for the side's.
class SideStream {
 public:
  SideStream(CudaState& state, cudaStream_t stream) : state_(state), stream_(stream) {}
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() {
    if (forked_) join();
  }
  lmloss_status fork(cudaStream_t* side) {
    LMLOSS_CHECK(state_.side(side));
    LMLOSS_CUDA_TRY(cudaEventRecord(state_.fork_event, stream_));
    LMLOSS_CUDA_TRY(cudaStreamWaitEvent(*side, state_.fork_event, 0));
    forked_ = true;
    return LMLOSS_SUCCESS;
  }
  lmloss_status join() {
    forked_ = false;
    LMLOSS_CUDA_TRY(cudaEventRecord(state_.join_event, state_.side_stream));
    LMLOSS_CUDA_TRY(cudaStreamWaitEvent(stream_, state_.join_event, 0));
    return LMLOSS_SUCCESS;
  }

 private:
  CudaState& state_;
  cudaStream_t stream_;
  bool forked_ = false;
};

// Makes `device` current for the scope of a call and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
    device_ = device;
  }
  ~DeviceGuard() {
    if (previous_ != device_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0, device_ = 0;
};

// The context's state on `device`, made by its first CUDA call. Making it allocates and sets device
// memory and creates handles and a stream, none of which a CUDA graph can capture: a first call
// under capture (on the context's stream) is refused, saying so. Later calls enqueue only stream-ordered work (kernels,
// products, the workspace's stream-ordered allocation, the side stream forked and joined by
// events), so a caller may capture them.
lmloss_status get_state(lmloss_context& context, int device, CudaState** out) {
  if (!context.cuda_state) {
    const auto stream = static_cast<cudaStream_t>(context.stream);
    LMLOSS_CHECK(refuse_under_capture(stream,
                                      "context: its first CUDA call makes its handles and cannot be captured "
                                      "into a CUDA graph; make one call on the context before capturing"));
    auto state = std::make_unique<CudaState>();
    state->device = device;
    // Zeroed on the context's stream (which may not wait for the legacy default stream), then
    // waited for once: the context may later run on another stream, which would not wait for them.
    LMLOSS_CUDA_TRY(cudaMalloc(&state->error_flag, sizeof(int)));
    LMLOSS_CUDA_TRY(cudaMemsetAsync(state->error_flag, 0, sizeof(int), stream));
    if (const lmloss_status st = state->matmul.init(stream); st != LMLOSS_SUCCESS) return st;
    LMLOSS_CUDA_TRY(cudaStreamSynchronize(stream));
    cudaStream_t side = nullptr;  // made now, so that no later call creates a stream
    LMLOSS_CHECK(state->side(&side));
    // Keep up to one budget of freed workspace in the stream-ordered pool between calls, so a
    // training loop does not map and unmap it on every step.
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
      uint64_t threshold = context.workspace_budget;
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
    }
    context.cuda_state = std::move(state);
  }
  auto* state = dynamic_cast<CudaState*>(context.cuda_state.get());
  if (!state) return core::fail(LMLOSS_ERROR_INTERNAL, "context: foreign backend state");
  if (state->device != device)
    return core::fail(LMLOSS_ERROR_UNSUPPORTED,
                      "context: already used on CUDA device " + std::to_string(state->device) +
                          "; use one context per device");
  *out = state;
  return LMLOSS_SUCCESS;
}

// One call's workspace: a single block from the caller's allocator or the stream-ordered pool,
// returned on the same stream once the call has enqueued its work (stream order keeps it alive
// until that work is done).
class Workspace {
 public:
  Workspace(lmloss_context& context, int device, cudaStream_t stream)
      : context_(context), device_(device), stream_(stream) {}
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  ~Workspace() {
    if (!base_) return;
    if (context_.has_allocator)
      context_.allocator.free(context_.allocator.user, base_, bytes_, device_, stream_);
    else
      cudaFreeAsync(base_, stream_);
    core::note_workspace_released(context_, bytes_);
  }
  lmloss_status acquire(size_t bytes) {
    if (bytes == 0) return LMLOSS_SUCCESS;
    if (context_.has_allocator) {
      base_ = context_.allocator.alloc(context_.allocator.user, bytes, device_, stream_);
      if (!base_)
        return core::fail(LMLOSS_ERROR_OUT_OF_MEMORY,
                          "workspace: the allocator returned NULL for " + std::to_string(bytes) + " bytes");
    } else if (cudaMallocAsync(&base_, bytes, stream_) != cudaSuccess) {
      cudaGetLastError();
      base_ = nullptr;
      return core::fail(LMLOSS_ERROR_OUT_OF_MEMORY,
                        "workspace: cudaMallocAsync of " + std::to_string(bytes) + " bytes failed");
    }
    bytes_ = bytes;
    core::note_workspace_acquired(context_, bytes_);
    return LMLOSS_SUCCESS;
  }
  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(static_cast<char*>(base_) + offset);
  }

 private:
  lmloss_context& context_;
  int device_;
  cudaStream_t stream_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

// A 16-bit dW (row stride ld) = round(sum * scale), rounded once from the f32 sum's rows [0, split)
// over its own bytes (dense there: ld = hidden) and the rest in `tail`: the rows in place first,
// as the tail's go over their bytes.
lmloss_status round_weight_sum(void* rows, lmloss_dtype dtype, int64_t ld, int64_t split, int64_t vocab, int64_t hidden,
                               const void* tail, int64_t tail_ld, const float* scale, cudaStream_t stream) {
  LMLOSS_CHECK(launch_regroup_rows(rows, dtype, split, hidden, ld, true, scale, stream));
  char* tail_rows16 = static_cast<char*>(rows) + split * ld * int64_t(core::dtype_size(dtype));
  return launch_scale_rows(tail, LMLOSS_F32, tail_ld, scale, nullptr, vocab - split, hidden, tail_rows16, ld, dtype,
                           stream);
}

// ---- planning --------------------------------------------------------------------------------
// A call's workspace is a list of pieces, each `fixed + per_row * rows` bytes (the top-k sort's
// scratch is its own function of rows), laid out in order with their alignment: the large
// chunk buffers first on 256 bytes (what cuBLASLt's fastest kernels want), the small ones on 16.
// The chunk height is the most rows whose layout fits the budget, found exactly.

struct Piece {
  size_t fixed = 0, per_row = 0, align = 16;
  int64_t topk_k = 0;  // > 0: the top-k device sort's scratch for k
  size_t bytes(int64_t rows) const {
    return topk_k > 0 ? topk_scratch_bytes(rows, topk_k) : fixed + per_row * size_t(rows);
  }
};

template <int N>
struct Layout {
  Piece pieces[N];
  size_t offset(int i, int64_t rows) const {
    size_t at = 0;
    for (int j = 0; j < i; ++j)
      if (const size_t b = pieces[j].bytes(rows)) at = round_to(at, pieces[j].align) + b;
    return round_to(at, pieces[i].align);
  }
  size_t total(int64_t rows) const { return offset(N - 1, rows) + pieces[N - 1].bytes(rows); }
  static size_t round_to(size_t n, size_t a) { return (n + a - 1) / a * a; }
};

// The most rows (at most n) whose layout fits `budget`, made a multiple of 128 (the products'
// tile height) when that leaves 256 or more; 0 when not even one row fits.
template <int N>
int64_t fit_rows(const Layout<N>& layout, size_t budget, int64_t n, int64_t row_limit) {
  int64_t lo = 0, hi = std::min(n, row_limit);
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (layout.total(mid) <= budget) lo = mid;
    else hi = mid - 1;
  }
  // Evening the chunks out (1664 rows instead of 1920 + a remainder) measured slower on an
  // H200 (2026-12-02): the products' algorithm for the odd height costs more than the short
  // last chunk.
  if (lo < n && lo >= 256) lo = lo / 128 * 128;
  return lo;
}

size_t matmul_workspace(size_t budget) {
  return std::min(kMatmulWorkspace, (budget / 16) & ~size_t(255));
}

bool wants_any_grad(const core::LossCall& call) {
  const lmloss_grads& g = call.grads;
  return call.wants_grads() &&
         (g.grad_logits.data || g.grad_hidden.data || g.grad_weight.data || g.grad_bias.data);
}

// Whether the call forms gradients (a forward, or a fused call that wants none, only the loss).
bool grads_computed(const core::LossCall& call) {
  return call.mode != core::Mode::forward && wants_any_grad(call);
}

// The product's shape is 32-bit: chunks of at most 2^31 - 1 rows, and vocab and hidden below that.
constexpr int64_t kProductDimLimit = std::numeric_limits<int32_t>::max();

// Whether a call through a head may take the statistics product (row_stats_product.cuh).
template <typename Call>
bool head_suits_row_stats_product(const Call& call) {
  return call.linear && !call.head.bias.data && !(call.options.softcap > 0) && call.vocab <= kProductDimLimit &&
         call.hidden <= kProductDimLimit &&
         row_stats_product_supported(call.device_index, call.input_dtype, call.head.hidden.data,
                                     row_stride(call.head.hidden), call.head.weight.data,
                                     row_stride(call.head.weight), call.hidden);
}

// The statistics product of the chunk of `rows` tokens from row0 (pointers to outputs unset).
template <typename Call>
RowStatsProductArgs row_stats_args(const Call& call, int64_t rows, int64_t row0 = 0) {
  RowStatsProductArgs a;
  a.device = call.device_index;
  a.dtype = call.input_dtype;
  a.hidden_ld = row_stride(call.head.hidden);
  a.hidden = static_cast<const char*>(call.head.hidden.data) + row0 * a.hidden_ld * int64_t(core::dtype_size(a.dtype));
  a.weight = call.head.weight.data;
  a.weight_ld = row_stride(call.head.weight);
  a.rows = rows;
  a.vocab = call.vocab;
  a.hidden_size = call.hidden;
  a.inv_temperature = float(1.0 / call.options.temperature);
  if constexpr (std::is_same_v<Call, core::LossCall>) {
    a.labels = call.targets.labels.data;
    a.labels_dtype = call.targets.labels.dtype;
  }
  a.row0 = row0;
  a.partial_ld = row_stats_tiles(call.vocab);
  return a;
}

// The f32 logits of a chunk of `rows` tokens, Z = X_chunk W^T: column-major (vocab, rows) =
// op(W) (vocab, hidden) * X^T (hidden, rows). Shared by the losses and top-k through the head.
template <typename Call>
MatmulShape logits_product(const Call& call, int64_t rows, int64_t logits_ld, size_t workspace_bytes) {
  MatmulShape s;
  s.m = call.vocab;
  s.n = rows;
  s.k = call.hidden;
  s.trans_a = true;
  s.lda = row_stride(call.head.weight);
  s.ldb = row_stride(call.head.hidden);
  s.ldd = logits_ld;
  s.ab_type = call.input_dtype;
  s.d_type = LMLOSS_F32;
  s.workspace_bytes = workspace_bytes;
  return s;
}

enum LossPiece {
  kLogitsChunk, kGradChunk, kPartials, kMatmulWs, kSideMatmulWs, kProductWs, kSparse, kLabelS, kExpShift,
  kRowScale, kLabelGrad, kLabelOrder, kLargeList, kEntryKeys, kScalars, kTokenLoss, kBiasF32, kBiasGrad, kRestSlice,
  kLossPieces
};

// A kept sum of bf16 values and 8-bit rests (core/weight_sum_rest.hpp) takes each chunk's dW
// product a slice of this many vocabulary rows at a time, in f32, then folds it into the pair.
constexpr int64_t kRestSliceRows = 1024;

// The vocabulary-sliced dX of a frozen head (run_sliced_dx): dX only, in the exponential form,
// with labels and no teacher. Instead of token chunks, the statistics product runs at full height
// over one slice of the vocabulary at a time and dX accumulates E_slice W_slice in f32, so that
// the dX product runs at full height too: a 1664-row chunk of gemma2-2b's dX is 117 output tiles
// on an H200's 132 SMs, so five chunks took five waves' time where one full-height product
// takes four (measured: gemma2-2b's dX only 30.7-30.9 -> 28.8-29.4 ms). The rows' statistics are
// merged slice by slice (launch_fold_slice), their scales applied once at the end, and the rare
// tiles a row could not store relative to its shift added exactly from the head
// (launch_add_flagged_tiles). Taken where token chunks would be at least kSlicedMinChunks: at
// llama3-8b's three the slices measured level with the chunks.
enum SlicedPiece {
  kSlicedStored, kSlicedPartials, kSlicedFolded, kSlicedFlags, kSlicedStaging, kSlicedMatmulWs, kSlicedProductWs,
  kSlicedShift, kSlicedRowScale, kSlicedLabelGrad, kSlicedRowCoef, kSlicedRowLse, kSlicedSparse, kSlicedScalars,
  kSlicedTokenLoss, kSlicedPieces
};
// A kept pair's dW product as the call's operands give it, for `tokens` rows: the gradient and the
// X rows are the chunk's, set per product (here any 256-byte-aligned address, as the workspace's,
// with a row stride of 8: the plan reads only alignments); X is the caller's or, in the
// exponential form, its scaled copy in the workspace (aligned, dense).
RestProductArgs rest_product_args(const core::LossCall& call, int64_t tokens) {
  RestProductArgs a;
  a.device = call.device_index;
  a.vocab = call.vocab;
  a.hidden = call.hidden;
  a.tokens = tokens;
  a.grad = reinterpret_cast<const void*>(uintptr_t(256));
  a.grad_ld = 8;
  a.x = call.head.hidden.data;
  a.x_ld = row_stride(call.head.hidden);
  a.values = call.grads.grad_weight.data;
  a.values_ld = row_stride(call.grads.grad_weight);
  a.rests = static_cast<int8_t*>(call.options.grad_weight_sum_tail.data);
  a.rests_ld = row_stride(call.options.grad_weight_sum_tail);
  return a;
}

// Slices are whole 32-tile words of the flags (FoldSliceArgs): the layout counts in such steps.
constexpr int64_t kSliceStep = 32 * kRowStatsTileColumns;
constexpr int64_t kSlicedMinChunks = 4;
// Slices of at least this many steps (16384 columns): each slice's dX product reads and writes the
// f32 dX of every token (8 N H bytes) beside its 2 N H width flops, and the staging grows with N,
// so a long call (llama3-8b at N 32768 would get 4096-column slices in 1 GiB) keeps its chunks.
constexpr int64_t kSlicedMinSteps = 4;

struct SlicedPlan {
  Layout<kSlicedPieces> layout;  // "rows" are steps of kSliceStep columns of a slice
  int64_t steps = 0;             // a slice's columns / kSliceStep (the last slice may be shorter)
  int64_t slices = 0;
  int64_t flags_ld = 0;          // 32-bit words of a row's flags: one bit a column tile
  size_t matmul_ws = 0;
  int64_t columns() const { return steps * kSliceStep; }
};

struct LossPlan {
  Layout<kLossPieces> layout;
  int64_t chunk_rows = 0;         // rows of a chunk: the backward products' height (the tallest)
  int64_t chunk_unit = 0;         // > 0: chunk heights are multiples of it, spread evenly
  int64_t logits_rows = 0;        // linear: rows of the logits chunk (a chunk's forward products)
  int64_t logits_ld = 0;          // linear: row stride of the logits chunk (a multiple of 8)
  bool separate_grad = false;     // linear: gradient in its own dense chunk, not over the logits
  int64_t grad_ld = 0;            // linear: row stride of the gradient chunk, in its elements
  lmloss_dtype grad_dtype = LMLOSS_F32;
  size_t matmul_ws = 0;
  bool row_stats_product = false; // linear: statistics from the product; the logits chunk, if
                                  // any, holds its shifted logits in the inputs' dtype
  bool exp_form = false;          // those in the exponential form (loss_rows.cuh)
  bool dx_beside_dw = false;      // exp_form with dX and dW: a chunk's dX on the side stream
  bool rest_product = false;      // a kept pair's dW products in one kernel each (weight_grad_store.cuh)
  std::optional<SlicedPlan> sliced;  // dX by slices of the vocabulary instead of token chunks
};

// Whether a fused step on the statistics product's path stores its logits in the exponential form,
// so that most rows need no gradient pass: bf16 (f16's range is too narrow for exp(s - shift))
// and no label smoothing (its uniform term is not a scale of the row).
bool takes_exp_form(const core::LossCall& call) {
  return call.input_dtype == LMLOSS_BF16 && call.options.label_smoothing == 0;
}

// Where the exponential form's scaled X starts in the staging after the f32 dX: cuBLASLt's
// fastest kernels want their operands on 256 bytes.
constexpr size_t kStagingAlign = 256;

// A row's column-tile partials of the statistics product (max, sum exp, sum s; see
// row_stats_product.cuh).
size_t partials_row_bytes(int64_t vocab) { return sizeof(float4) * size_t(row_stats_tiles(vocab)); }

int64_t chunk_count(int64_t n, int64_t rows) { return rows > 0 ? (n + rows - 1) / rows : 0; }

// Chunk `index` of a plan's n tokens: its first row and height. With a chunk unit the heights
// are whole units, the first chunks one unit taller where they do not divide evenly (and the
// last cut at n); else every chunk is chunk_rows tall but the last.
struct ChunkSpan {
  int64_t row0, rows;
};
template <class Plan>
int64_t plan_chunk_count(const Plan& p, int64_t n) {
  if (p.chunk_unit == 0) return chunk_count(n, p.chunk_rows);
  return chunk_count(chunk_count(n, p.chunk_unit), p.chunk_rows / p.chunk_unit);
}
template <class Plan>
ChunkSpan chunk_span(const Plan& p, int64_t n, int64_t index) {
  if (p.chunk_unit == 0) {
    const int64_t row0 = index * p.chunk_rows;
    return {row0, std::min(p.chunk_rows, n - row0)};
  }
  const int64_t units = chunk_count(n, p.chunk_unit), chunks = plan_chunk_count(p, n);
  const int64_t base = units / chunks, taller = units % chunks;
  const int64_t row0 = (index * base + std::min(index, taller)) * p.chunk_unit;
  return {row0, std::min((base + (index < taller ? 1 : 0)) * p.chunk_unit, n - row0)};
}

// A statistics product's n tokens in as few chunks of at most the fitted p.chunk_rows as fit,
// their heights whole rows of the product's clusters spread evenly (chunk_span); p.chunk_rows
// becomes the tallest. Shorter chunks, or one chunk, stay as fitted.
template <class Plan>
void spread_in_cluster_rows(Plan& p, int64_t n) {
  const int64_t unit = kRowStatsClusterRows;
  if (p.chunk_rows < unit || p.chunk_rows >= n) return;
  const int64_t units = chunk_count(n, unit);
  p.chunk_unit = unit;
  p.chunk_rows = chunk_count(units, chunk_count(units, p.chunk_rows / unit)) * unit;
}

// Chunks of at most `rows` evened out over n tokens (a multiple of 128 rows): a short last
// chunk's backward products run far below their rate. Heights under 256 are left as they are.
int64_t evened_chunk_rows(int64_t n, int64_t rows) {
  const int64_t chunks = chunk_count(n, rows);
  const int64_t even = chunks > 0 ? (n + chunks - 1) / chunks : 0;
  return even >= 256 ? std::min(rows, (even + 127) / 128 * 128) : rows;
}

// The device's multiprocessors, read once per device (0 where it cannot be read).
int multiprocessor_count(int device) {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];  // 0: not read yet
  if (device < 0 || device >= kDevices) return 0;
  if (const int k = known[device].load(std::memory_order_relaxed)) return k;
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  known[device].store(count, std::memory_order_relaxed);
  return count;
}

// The output tiles of cuBLASLt's kernel for a chunk's dX product (rows x hidden, bf16 in, f32
// out) on an H200 at llama3-8b's head: 256 x 128 (ncu).
constexpr int64_t kDxTileRows = 256, kDxTileColumns = 128;
// A chunk's dX product of at most this many waves of tiles: at llama3-8b an H200 ran 2048 rows
// (two waves) at 800 TFLOP/s and 3072 rows (three, as full) at 728 (run 40).
constexpr int64_t kDxMaxWaves = 2;

// The height of the chunks of a frozen head's step, whose dX product runs with nothing beside
// it: whole units of the statistics product's clusters, at most max_rows, whose dX product fills
// its last wave of tiles best, the tallest of those within half a percent; 0 where none fits.
// llama3-8b at 1 GiB: 2048 rows (two waves of 128 + 128 tiles on 132 SMs) instead of 2816 + 2816 +
// 2560 (2.67, 2.67 and 2.42 waves), 26.1 -> 25.3 ms a step (run 40).
int64_t whole_wave_chunk_rows(int64_t max_rows, int64_t hidden, int sms) {
  if (sms <= 0) return 0;
  const int64_t column_tiles = chunk_count(hidden, kDxTileColumns);
  int64_t best_rows = 0;
  double best_fill = 0;
  for (int64_t rows = kRowStatsClusterRows; rows <= max_rows; rows += kRowStatsClusterRows) {
    const int64_t tiles = chunk_count(rows, kDxTileRows) * column_tiles;
    const int64_t waves = chunk_count(tiles, sms);
    if (waves > kDxMaxWaves) break;
    const double fill = double(tiles) / double(waves * sms);
    if (fill >= best_fill - 0.005) {
      best_rows = rows;
      best_fill = std::max(best_fill, fill);
    }
  }
  return best_rows;
}

// The most rows of one launch of the statistics product, so that their rows of X stay in L2
// while W streams past: a forward's and top-k's chunks are no taller, and a fused call's taller
// chunks take their product in several launches (product_launch_rows). At llama3-8b's 8192 rows
// (64 MiB of X, more than the H200's L2) the one product ran its L2 at 96% of peak with 47% hits,
// read 37-46 GB from DRAM and slowed its clock to 1.26 GHz (ncu, run 40). On a rested H200 (run
// 41) a forward took 1.25x cuBLASLt's product at 8192 rows, 1.13x at 3072 and 1.05x at 2048, 1536
// or 1024; top-k at 2048 rows was the fastest of those (k 64: 1.30x -> 1.14x). A cap by X's bytes
// was no better (run 42): at H 8192, 1024 rows took the rested forward from 1.08x to 1.06x but
// top-k 0.3 ms slower hot; at H 2304, 3584 rows took it from 1.04x to 1.06x.
constexpr int64_t kForwardProductRows = 2048;

// The height of each launch of a chunk's statistics product but the last: the chunk spread
// evenly over launches of at most kForwardProductRows, in whole cluster rows (3328 rows: 1792 +
// 1536). At llama3-8b N 32768 (chunks of 3328 rows) the step's products took 45.1 ms by ncu
// instead of 49.5 in one launch a chunk; the step itself ran as before, the card at its power
// limit (run 45).
int64_t product_launch_rows(int64_t rows) {
  if (rows <= kForwardProductRows) return rows;
  const int64_t units = chunk_count(rows, kRowStatsClusterRows);
  return chunk_count(units, chunk_count(rows, kForwardProductRows)) * kRowStatsClusterRows;
}

// The other layout for 16-bit gradients: a dense gradient chunk of 2 bytes per logit, filled by
// several smaller f32 logits chunks in turn. The backward products then run over more rows at once
// for the same budget, and each chunk beyond the first re-reads and re-writes the f32 dW (V H 4
// bytes each way): fewer chunks is what pays, so the layout is returned only when it needs fewer
// chunks than `in_place`. Chunks are evened out (no short last chunk: a dW product of few rows runs
// far below its rate), then the logits chunk takes what budget is left.
std::optional<LossPlan> plan_separate_grad(const lmloss_context& context, const core::LossCall& call,
                                           const LossPlan& in_place) {
  LossPlan p = in_place;
  p.separate_grad = true;
  p.grad_ld = p.logits_ld;
  Piece* pc = p.layout.pieces;
  const size_t logits_row = sizeof(float) * size_t(p.logits_ld);
  pc[kGradChunk] = {0, 2 * size_t(p.logits_ld), 256};
  const size_t budget = context.workspace_budget;
  const int64_t n = call.n_tokens;
  // Logits chunks of 512 rows keep the forward product near its rate (each one reads all of W:
  // below ~256 rows it is memory-bound on an H200); smaller budgets try 256 and 128 rows, where
  // the dW traffic saved still outweighs the slower forward (measured 2026-12-02: 8-row chunks
  // made the step 5x slower).
  const int64_t in_place_chunks = chunk_count(n, in_place.chunk_rows);
  for (int64_t logits_rows = 512; logits_rows >= 128; logits_rows /= 2) {
    pc[kLogitsChunk] = {logits_rows * logits_row, 0, 256};
    const int64_t rows = fit_rows(p.layout, budget, n, n);
    if (rows < logits_rows) continue;
    const int64_t chunks = chunk_count(n, rows);
    if (chunks >= in_place_chunks) continue;
    p.chunk_rows = evened_chunk_rows(n, rows);
    p.logits_rows = logits_rows;
    for (int64_t grown = p.chunk_rows / 128 * 128; grown > logits_rows; grown -= 128) {
      pc[kLogitsChunk].fixed = grown * logits_row;
      if (p.layout.total(p.chunk_rows) <= budget) {
        p.logits_rows = grown;
        break;
      }
    }
    p.logits_rows = std::min(p.logits_rows, p.chunk_rows);
    pc[kLogitsChunk].fixed = p.logits_rows * logits_row;
    return p;
  }
  return std::nullopt;
}

// The vocabulary-sliced dX's plan (see SlicedPlan): the widest slices that fit the budget, evened
// out; none where fewer than kSlicedMinSteps steps of columns fit or one slice would hold the
// whole vocabulary.
std::optional<SlicedPlan> plan_sliced_dx(const lmloss_context& context, const core::LossCall& call) {
  SlicedPlan p;
  const size_t n = size_t(call.n_tokens), hidden = size_t(call.hidden);
  const int64_t total_tiles = row_stats_tiles(call.vocab);
  const int64_t max_slices = (call.vocab + kSliceStep - 1) / kSliceStep;
  p.flags_ld = (total_tiles + 31) / 32;
  p.matmul_ws = matmul_workspace(context.workspace_budget);
  Piece* pc = p.layout.pieces;
  pc[kSlicedStored] = {0, n * kSliceStep * 2, 256};
  pc[kSlicedPartials] = {0, n * sizeof(float4) * (kSliceStep / kRowStatsTileColumns), 256};
  pc[kSlicedFolded] = {n * sizeof(float4) * size_t(max_slices), 0, 256};
  pc[kSlicedFlags] = {n * sizeof(uint32_t) * size_t(p.flags_ld), 0, 256};
  pc[kSlicedStaging] = {n * sizeof(float) * hidden, 0, 256};
  pc[kSlicedMatmulWs] = {p.matmul_ws, 0, 256};
  pc[kSlicedProductWs] = {row_stats_product_workspace(row_stats_args(call, call.n_tokens)), 0, 256};
  for (int i : {kSlicedShift, kSlicedRowScale, kSlicedLabelGrad, kSlicedRowCoef, kSlicedRowLse, kSlicedSparse})
    pc[i] = {n * sizeof(float), 0, 16};
  pc[kSlicedScalars] = {sizeof(CallScalars), 0, 16};
  if (call.wants_loss() && call.loss.data && call.options.reduction != LMLOSS_REDUCTION_NONE)
    pc[kSlicedTokenLoss] = {n * sizeof(float), 0, 16};
  int64_t steps = 0;
  while (steps < max_slices && p.layout.total(steps + 1) <= context.workspace_budget) ++steps;
  if (steps < kSlicedMinSteps || steps >= max_slices) return std::nullopt;
  p.slices = (max_slices + steps - 1) / steps;
  p.steps = (max_slices + p.slices - 1) / p.slices;
  return p;
}

LossPlan plan_loss(const lmloss_context& context, const core::LossCall& call) {
  LossPlan p;
  const bool grads = wants_any_grad(call);
  const bool reduced_loss = call.wants_loss() && call.loss.data && call.options.reduction != LMLOSS_REDUCTION_NONE;
  Piece* pc = p.layout.pieces;
  pc[kScalars].fixed = sizeof(CallScalars);
  if (reduced_loss) pc[kTokenLoss].fixed = sizeof(float) * call.n_tokens;
  // s at the sparse entries, and their sorted keys where the rows' gradient takes them in order.
  pc[kSparse].per_row = sizeof(float) * size_t(call.top_k + 1);
  if (orders_entries(call.top_k, call.vocab) && grads_computed(call))
    pc[kEntryKeys] = {0, sizeof(uint64_t) * size_t(call.top_k + 1), 16};
  if (call.linear) {
    p.logits_ld = (call.vocab + 7) / 8 * 8;
    // The gradient goes over the chunk's own f32 logits, narrowed to the input dtype in place
    // (row stride 2 * logits_ld of 16-bit values), so a chunk row costs 4 bytes per logit.
    p.grad_dtype = call.input_dtype;
    p.grad_ld = call.input_dtype == LMLOSS_F32 ? p.logits_ld : 2 * p.logits_ld;
    pc[kLogitsChunk] = {0, sizeof(float) * size_t(p.logits_ld), 256};
    p.matmul_ws = matmul_workspace(context.workspace_budget);
    pc[kMatmulWs] = {p.matmul_ws, 0, 256};
    if (call.head.bias.data) pc[kBiasF32].fixed = sizeof(float) * call.vocab;
    if (grads && call.grads.grad_bias.data) pc[kBiasGrad].fixed = sizeof(float) * call.vocab;
    if (grads && call.grads.grad_weight.data && core::weight_sum_keeps_rests(call.options.grad_weight_sum_tail)) {
      // The products into the pair in one kernel each where it runs (its scratch, planned for
      // the tallest product), else a slice of rows at a time through f32.
      const RestProductArgs product = rest_product_args(call, call.n_tokens);
      p.rest_product = call.input_dtype == LMLOSS_BF16 && rest_product_supported(product);
      pc[kRestSlice] = {p.rest_product ? rest_product_workspace(product)
                                       : sizeof(float) * size_t(std::min(call.vocab, kRestSliceRows)) * size_t(call.hidden),
                        0, 256};
    }
  }
  int64_t row_limit = call.n_tokens;
  const bool grads_formed = grads_computed(call);
  // Statistics from the product: a fused step (a backward reads its logits with a saved lse), or
  // a forward without a teacher (whose s values come from the shifted logits a fused step stores).
  const bool product_work = grads_formed ? call.mode != core::Mode::backward : !call.has_teacher();
  if (product_work && head_suits_row_stats_product(call)) {
    // Per row: the column tiles' partials and s at the label; the shifted logits (2 bytes each,
    // the gradient later written over them) only if gradients are formed.
    p.row_stats_product = true;
    if (grads_formed) {
      p.grad_ld = p.logits_ld;
      pc[kLogitsChunk] = {0, core::dtype_size(call.input_dtype) * size_t(p.logits_ld), 256};
    } else {
      pc[kLogitsChunk] = {};
      pc[kMatmulWs] = {};
      p.matmul_ws = 0;
    }
    pc[kPartials] = {0, partials_row_bytes(call.vocab), 256};
    pc[kLabelS] = {0, sizeof(float), 16};
    // The exponential form's dW takes the tokens ordered by label (0 bytes: not to be had).
    const bool exp_form = grads_formed && takes_exp_form(call);
    const bool orders_labels = exp_form && call.targets.labels.data && call.grads.grad_weight.data;
    const size_t order_bytes = orders_labels ? label_order_bytes(call.n_tokens) : 0;
    if (exp_form && (!orders_labels || order_bytes > 0)) {
      // The rows' shifts and scales; after the row kernel the partials' space holds the chunk's
      // f32 dX before its rows are scaled, then its rows of X scaled for dW.
      p.exp_form = true;
      pc[kExpShift] = pc[kRowScale] = pc[kLabelGrad] = {0, sizeof(float), 16};
      if (orders_labels) pc[kLabelOrder] = {order_bytes, 0, 256};
      // dW's large entries (LossRowsArgs::large_cols) of every token, sorted once after the last
      // chunk (a sort a chunk took 38 us at llama3-8b, five launches: run 62), where their sort's
      // scratch can be had.
      if (call.grads.grad_weight.data) pc[kLargeList] = {large_entries_bytes(call.n_tokens), 0, 256};
      // With dX and dW both wanted, a chunk's dX runs beside its dW (run_loss), so the staging
      // holds the f32 dX and the scaled X at once, and the side's product has scratch of its own
      // as large as the main one's (half each measured 0.3-0.8 ms slower at gemma2-2b, run 36).
      p.dx_beside_dw = call.grads.grad_hidden.data && call.grads.grad_weight.data;
      const size_t staging_row = sizeof(float) * size_t(call.hidden) +
                                 (p.dx_beside_dw ? core::dtype_size(call.input_dtype) * size_t(call.hidden) : 0);
      pc[kPartials].per_row = std::max(pc[kPartials].per_row, staging_row);
      if (p.dx_beside_dw) {
        pc[kPartials].fixed = kStagingAlign;
        pc[kSideMatmulWs] = pc[kMatmulWs];
      }
    }
    row_limit = std::min(call.n_tokens, grads_formed ? kProductDimLimit : kForwardProductRows);
    pc[kProductWs] = {row_stats_product_workspace(row_stats_args(call, row_limit)), 0, 256};
  }
  p.chunk_rows = p.logits_rows = fit_rows(p.layout, context.workspace_budget, call.n_tokens, row_limit);
  if (p.exp_form && p.chunk_rows == 0 && pc[kLargeList].fixed > 0) {
    // The large entries take 388 bytes a token: a long call in a small budget goes without them
    // (its dW as the products round it) before it goes without the exponential form.
    pc[kLargeList] = {};
    p.chunk_rows = p.logits_rows = fit_rows(p.layout, context.workspace_budget, call.n_tokens, row_limit);
  }
  if (p.exp_form && p.chunk_rows == 0) {
    // A budget too small for the exponential form's pieces (the label order takes 16 bytes a
    // token, the f32 dX 4 x hidden a row) may still hold the gradient pass's.
    p.exp_form = p.dx_beside_dw = false;
    pc[kExpShift] = pc[kRowScale] = pc[kLabelGrad] = pc[kLabelOrder] = pc[kLargeList] = pc[kSideMatmulWs] = {};
    pc[kPartials] = {0, partials_row_bytes(call.vocab), 256};
    p.chunk_rows = p.logits_rows = fit_rows(p.layout, context.workspace_budget, call.n_tokens, row_limit);
  }
  const lmloss_grads& g = call.grads;
  int64_t fitted_chunks = chunk_count(call.n_tokens, p.chunk_rows);
  if (p.row_stats_product && p.chunk_rows >= kRowStatsClusterRows && p.chunk_rows < call.n_tokens) {
    // Chunks in whole rows of the product's clusters. A frozen head's dX products run with
    // nothing beside them, so its chunks are as tall as fills their last wave best; the others'
    // are spread evenly: at gemma2-2b's 1 GiB, 1792 + 1792 + 3 x 1536 rows instead of 4 x 1664 +
    // 1536, whose products each ran as long as one of 2048 rows (an H200, by ncu: 3.08 ms against
    // 3.14, and 2.38 for 1536). Shorter chunks, or one chunk, stay as fitted.
    const int64_t unit = kRowStatsClusterRows;
    fitted_chunks = chunk_count(chunk_count(call.n_tokens, unit), p.chunk_rows / unit);
    const bool frozen_head = grads_formed && !g.grad_weight.data;
    const int64_t wave_rows =
        frozen_head ? whole_wave_chunk_rows(p.chunk_rows, call.hidden, multiprocessor_count(call.device_index)) : 0;
    if (wave_rows > 0) {
      p.chunk_rows = wave_rows;
    } else {
      spread_in_cluster_rows(p, call.n_tokens);
    }
    p.logits_rows = p.chunk_rows;
  }
  if (p.exp_form && g.grad_hidden.data && !g.grad_weight.data && !g.grad_bias.data && !g.grad_logits.data &&
      call.targets.labels.data && !call.has_teacher() && call.n_tokens <= kProductDimLimit &&
      fitted_chunks >= kSlicedMinChunks)
    p.sliced = plan_sliced_dx(context, call);
  if (call.linear && grads && call.grads.grad_weight.data && call.input_dtype != LMLOSS_F32 && !p.row_stats_product)
    if (std::optional<LossPlan> split = plan_separate_grad(context, call, p)) return *split;
  return p;
}

// A fused step's last dW product left to lmloss_round_grad_weight_deferred (see
// lmloss_loss_deferred_bytes), in the caller's buffer: the product's alpha (f32, in kDeferredHeader
// bytes), then the chunk's gradient G (rows, vocab) and its rows of X (rows, hidden), bf16 and
// dense. G's part is the step's
// logits workspace for every chunk. The chunk deferred is the first, the tallest, run last: the
// buffer is its height, which the rounding reads back from the buffer's size.
constexpr size_t kDeferredHeader = 256;

struct DeferredProduct {
  int64_t rows = 0, vocab = 0, hidden = 0;
  size_t bytes() const { return rows > 0 ? kDeferredHeader + 2 * size_t(rows) * size_t(vocab + hidden) : 0; }
  float* alpha(void* base) const { return static_cast<float*>(base); }
  char* grad(void* base) const { return static_cast<char*>(base) + kDeferredHeader; }
  char* x(void* base) const { return grad(base) + 2 * rows * vocab; }
};

// The store of a deferred product over the kept sum it belongs to (its alpha and beta yet to set).
WeightGradStoreArgs deferred_store_args(int device, const DeferredProduct& d, void* base, void* grad_weight,
                                        int64_t split, const lmloss_tensor& tail) {
  WeightGradStoreArgs s;
  s.device = device;
  s.vocab = d.vocab;
  s.hidden = d.hidden;
  s.tokens = d.rows;
  s.grad = d.grad(base);
  s.grad_ld = d.vocab;
  s.x = d.x(base);
  s.x_ld = d.hidden;
  s.rows = grad_weight;
  s.split = split;
  s.tail = static_cast<const float*>(tail.data);
  s.tail_ld = row_stride(tail);
  return s;
}

// The same for a kept pair of bf16 values and rests: the product stored over the pair.
RestProductArgs deferred_rest_args(int device, const DeferredProduct& d, void* base, const lmloss_tensor& grad_weight,
                                   const lmloss_tensor& rests) {
  RestProductArgs a;
  a.device = device;
  a.vocab = d.vocab;
  a.hidden = d.hidden;
  a.tokens = d.rows;
  a.grad = d.grad(base);
  a.grad_ld = d.vocab;
  a.x = d.x(base);
  a.x_ld = d.hidden;
  a.kind = RestProduct::store;
  a.values = grad_weight.data;
  a.values_ld = row_stride(grad_weight);
  a.rests = static_cast<int8_t*>(rests.data);
  a.rests_ld = row_stride(rests);
  return a;
}

// What a fused step defers: its first chunk, with a caller's kept sum of a bf16 dW (f32, or values
// and rests) on the statistics product's path over more than one chunk, where the store runs;
// else nothing.
DeferredProduct deferred_product(const core::LossCall& call, const LossPlan& plan) {
  const lmloss_grads& g = call.grads;
  const lmloss_tensor& tail = call.options.grad_weight_sum_tail;
  const bool kept_bf16_sum = call.mode == core::Mode::forward_backward && call.linear && g.grad_weight.data &&
                             tail.data && call.input_dtype == LMLOSS_BF16 && g.grad_weight.dtype == LMLOSS_BF16;
  if (!kept_bf16_sum || !plan.row_stats_product || plan.separate_grad || plan.sliced ||
      plan.logits_ld != call.vocab || call.hidden % 8 != 0 || plan_chunk_count(plan, call.n_tokens) < 2)
    return {};
  const DeferredProduct d{plan.chunk_rows, call.vocab, call.hidden};
  // Any address of the buffer's alignment: the probe reads only alignments, and the buffer's parts
  // are aligned by its layout (vocab and hidden multiples of 8).
  void* const aligned = reinterpret_cast<void*>(uintptr_t(kDeferredHeader));
  if (core::weight_sum_keeps_rests(tail))
    return plan.rest_product && rest_product_supported(deferred_rest_args(call.device_index, d, aligned,
                                                                          g.grad_weight, tail))
               ? d
               : DeferredProduct{};
  const WeightGradStoreArgs probe =
      deferred_store_args(call.device_index, d, aligned, g.grad_weight.data, call.weight_sum_split, tail);
  return weight_grad_store_supported(probe) ? d : DeferredProduct{};
}

// The head as the top-k selections recompute single logits from it.
TopkHead topk_head(const core::TopkCall& call) {
  TopkHead h;
  h.dtype = call.input_dtype;
  h.hidden = call.head.hidden.data;
  h.hidden_ld = row_stride(call.head.hidden);
  h.weight = call.head.weight.data;
  h.weight_ld = row_stride(call.head.weight);
  h.hidden_size = call.hidden;
  return h;
}

enum TopkPiece {
  kTopkLogits, kTopkMatmulWs, kTopkSort, kTopkScalars, kTopkLse, kTopkBias,
  kTopkCandidates, kTopkRunnersUp, kTopkPartials, kTopkProductWs,
  kTopkKept, kTopkSample, kTopkRedo, kTopkBar, kTopkKeptCount, kTopkPieces
};

struct TopkPlan {
  Layout<kTopkPieces> layout;
  int64_t chunk_rows = 0;
  int64_t chunk_unit = 0;     // > 0: chunk heights are multiples of it, spread evenly
  int64_t logits_ld = 0;
  size_t matmul_ws = 0;
  bool from_product = false;  // the statistics product keeps each tile's largest; no logits
  bool above_bar = false;     // the statistics product keeps what passes a sampled bar; no logits
  TopkBarPlan bar;
};

TopkPlan plan_topk(const lmloss_context& context, const core::TopkCall& call) {
  TopkPlan p;
  const int64_t k = call.options.k;
  Piece* pc = p.layout.pieces;
  if (topk_from_candidates_supported(call.vocab, k) && head_suits_row_stats_product(call)) {
    p.from_product = true;
    const size_t tiles = size_t(row_stats_tiles(call.vocab));
    pc[kTopkCandidates] = {0, sizeof(uint64_t) * kTopkCandidatesPerTile * tiles, 256};
    pc[kTopkRunnersUp] = {0, sizeof(uint64_t) * kTopkCandidatesPerTile * tiles, 256};
    if (!call.options.renormalize) pc[kTopkPartials] = {0, sizeof(float4) * tiles, 256};  // for the lse
    const int64_t row_limit = std::min(call.n_tokens, kForwardProductRows);
    pc[kTopkProductWs] = {row_stats_product_workspace(row_stats_args(call, row_limit)), 0, 256};
    p.chunk_rows = fit_rows(p.layout, context.workspace_budget, call.n_tokens, row_limit);
    spread_in_cluster_rows(p, call.n_tokens);  // as a forward's (plan_loss)
    return p;
  }
  if (head_suits_row_stats_product(call) && topk_bar_plan(call.vocab, k, &p.bar)) {
    p.above_bar = true;
    pc[kTopkSample] = {0, sizeof(float) * size_t(kTopkSampleColumns), 256};
    pc[kTopkBar] = {0, sizeof(float), 16};
    pc[kTopkKeptCount] = {0, sizeof(int32_t), 16};
    pc[kTopkKept] = {0, sizeof(uint64_t) * size_t(p.bar.kept_ld), 256};
    if (!call.options.renormalize) pc[kTopkPartials] = {0, sizeof(float4) * size_t(row_stats_tiles(call.vocab)), 256};
    pc[kTopkRedo] = {topk_redo_bytes(call.vocab), 0, 256};
    // The sample's product is small: cuBLASLt splits nothing along it.
    p.matmul_ws = std::min(matmul_workspace(context.workspace_budget), kSampleMatmulWorkspace);
    pc[kTopkMatmulWs] = {p.matmul_ws, 0, 256};
    pc[kTopkScalars].fixed = sizeof(CallScalars);
    const int64_t row_limit = std::min(call.n_tokens, kForwardProductRows);
    pc[kTopkProductWs] = {row_stats_product_workspace(row_stats_args(call, row_limit)), 0, 256};
    p.chunk_rows = fit_rows(p.layout, context.workspace_budget, call.n_tokens, row_limit);
    spread_in_cluster_rows(p, call.n_tokens);  // as a forward's (plan_loss)
    return p;
  }
  if (k > topk_shared_capacity()) {  // the device-memory sort, and each row's lse kept across it
    pc[kTopkSort] = {0, 0, 256, k};
    pc[kTopkLse].per_row = sizeof(float);
  }
  if (call.linear) {
    p.logits_ld = (call.vocab + 7) / 8 * 8;
    pc[kTopkLogits] = {0, sizeof(float) * size_t(p.logits_ld), 256};
    p.matmul_ws = matmul_workspace(context.workspace_budget);
    pc[kTopkMatmulWs] = {p.matmul_ws, 0, 256};
    pc[kTopkScalars].fixed = sizeof(CallScalars);
    if (call.head.bias.data) pc[kTopkBias].fixed = sizeof(float) * call.vocab;
  }
  // The device sort counts its keys in 32 bits.
  const int64_t limit = k > topk_shared_capacity() ? std::max<int64_t>(1, ((int64_t(1) << 31) - 1) / k) : call.n_tokens;
  p.chunk_rows = fit_rows(p.layout, context.workspace_budget, call.n_tokens, limit);
  return p;
}

lmloss_status budget_error(const lmloss_context& context, size_t one_row) {
  return core::fail(LMLOSS_ERROR_INVALID_ARGUMENT,
                    "context workspace budget: " + std::to_string(context.workspace_budget) +
                        " bytes do not hold one row of the problem (" + std::to_string(one_row) +
                        " bytes); raise it with lmloss_context_set_workspace_budget");
}

lmloss_status check_vector(const lmloss_tensor& t, const char* name) {
  if (t.data && t.ndim == 1 && t.stride > 1)
    return core::fail(LMLOSS_ERROR_UNSUPPORTED,
                      std::string(name) + ": the CUDA backend needs a contiguous vector (stride 0 or 1)");
  return LMLOSS_SUCCESS;
}

// ---- the loss pipelines ----------------------------------------------------------------------

struct LossRun {
  lmloss_context& context;
  const core::LossCall& call;
  CudaState& state;
  cudaStream_t stream;
};

LossRowsArgs row_args_common(const core::LossCall& call) {
  const auto& o = call.options;
  LossRowsArgs a;
  a.vocab = call.vocab;
  a.labels = call.targets.labels.data;
  a.labels_dtype = call.targets.labels.dtype;
  a.ignore_index = o.ignore_index;
  a.mask = static_cast<const uint8_t*>(call.targets.token_mask.data);
  if (call.has_teacher()) {
    a.teacher_ids = call.targets.teacher_ids.data;
    a.teacher_ids_dtype = call.targets.teacher_ids.dtype;
    a.teacher_ids_ld = row_stride(call.targets.teacher_ids);
    a.teacher_probs = static_cast<const float*>(call.targets.teacher_probs.data);
    a.teacher_probs_ld = row_stride(call.targets.teacher_probs);
    a.top_k = call.top_k;
  }
  a.reduction = o.reduction;
  a.scale = core::LogitScale<float>::make(o.softcap, o.temperature);
  a.weights = core::LossWeights<float>::make(o.ce_weight, o.kd_weight, o.label_smoothing, o.z_loss, call.vocab);
  return a;
}

// The call's scalars (see PrepareArgs), written to `scalars` on the device.
PrepareArgs prepare_args(const core::LossCall& call, CallScalars* scalars, bool f16_products) {
  const auto& o = call.options;
  PrepareArgs prep;
  prep.n_tokens = call.n_tokens;
  prep.labels = call.targets.labels.data;
  prep.labels_dtype = call.targets.labels.dtype;
  prep.ignore_index = o.ignore_index;
  prep.mask = static_cast<const uint8_t*>(call.targets.token_mask.data);
  prep.grad_loss = call.wants_grads() ? static_cast<const float*>(call.grad_loss.data) : nullptr;
  prep.reduction = o.reduction;
  prep.normalizer = o.normalizer;
  prep.scale_gradient = f16_products;
  prep.max_row_factor = static_cast<float>(std::fabs(o.ce_weight) + std::fabs(o.kd_weight) + 1.0);
  prep.scalars = scalars;
  return prep;
}

// The exponential form's shifts of `rows` tokens from row0 (see ExpShiftArgs).
ExpShiftArgs exp_shift_args(const core::LossCall& call, int64_t row0, int64_t rows, float* shift) {
  ExpShiftArgs e;
  e.hidden_ld = row_stride(call.head.hidden);
  e.hidden = static_cast<const char*>(call.head.hidden.data) + row0 * e.hidden_ld * int64_t(core::dtype_size(call.input_dtype));
  e.weight = call.head.weight.data;
  e.weight_ld = row_stride(call.head.weight);
  e.rows = rows;
  e.vocab = call.vocab;
  e.hidden_size = call.hidden;
  e.row0 = row0;
  e.inv_temperature = float(1.0 / call.options.temperature);
  e.labels = call.targets.labels.data;
  e.labels_dtype = call.targets.labels.dtype;
  e.ignore_index = call.options.ignore_index;
  e.mask = static_cast<const uint8_t*>(call.targets.token_mask.data);
  if (call.has_teacher()) {
    e.teacher_ids = call.targets.teacher_ids.data;
    e.teacher_ids_dtype = call.targets.teacher_ids.dtype;
    e.teacher_ids_ld = row_stride(call.targets.teacher_ids);
  }
  e.shift = shift;
  return e;
}

lmloss_status run_sliced_dx(LossRun& r, const SlicedPlan& plan);

lmloss_status run_loss(LossRun& r, const LossPlan& plan) {
  const core::LossCall& call = r.call;
  const auto& o = call.options;
  const bool grads = wants_any_grad(call);
  const bool loss_wanted = call.wants_loss() && call.loss.data;
  const bool reduced_loss = loss_wanted && o.reduction != LMLOSS_REDUCTION_NONE;
  const bool f16_products = call.linear && grads && call.input_dtype == LMLOSS_F16;
  if (call.mode == core::Mode::backward && !grads) return LMLOSS_SUCCESS;
  if (plan.sliced) return run_sliced_dx(r, *plan.sliced);

  const int64_t R = plan.chunk_rows;
  // A deferred product's buffer (its size checked against the plan already) holds the logits.
  void* const deferred_base = call.options.grad_weight_deferred.data;
  const DeferredProduct deferred = deferred_base ? deferred_product(call, plan) : DeferredProduct{};
  auto layout = plan.layout;
  if (deferred_base) layout.pieces[kLogitsChunk] = {};
  Workspace ws(r.context, r.state.device, r.stream);
  LMLOSS_CHECK(ws.acquire(layout.total(R)));
  const Piece* pc = layout.pieces;
  auto piece = [&](int i) -> void* { return pc[i].bytes(R) ? ws.at<void>(layout.offset(i, R)) : nullptr; };
  auto* scalars = static_cast<CallScalars*>(piece(kScalars));
  float* token_loss = reduced_loss ? static_cast<float*>(piece(kTokenLoss))
                                   : (loss_wanted ? static_cast<float*>(call.loss.data) : nullptr);
  float* bias = static_cast<float*>(piece(kBiasF32));
  float* bias_grad = static_cast<float*>(piece(kBiasGrad));
  void* matmul_ws = piece(kMatmulWs);
  void* side_matmul_ws = piece(kSideMatmulWs);
  const size_t matmul_ws_bytes = plan.matmul_ws;
  float* sparse = static_cast<float*>(piece(kSparse));
  float* logits_chunk =
      static_cast<float*>(deferred_base ? static_cast<void*>(deferred.grad(deferred_base)) : piece(kLogitsChunk));
  void* grad_chunk = piece(kGradChunk);
  auto* partials = static_cast<float4*>(piece(kPartials));
  auto* label_s = static_cast<float*>(piece(kLabelS));
  auto* exp_shift = static_cast<float*>(piece(kExpShift));
  auto* row_scale = static_cast<float*>(piece(kRowScale));
  auto* label_grad = static_cast<float*>(piece(kLabelGrad));
  void* label_order = piece(kLabelOrder);
  void* large_list = piece(kLargeList);
  const LargeEntries large =
      large_list ? large_entries_at(large_list, pc[kLargeList].bytes(R), call.n_tokens) : LargeEntries{};
  // The exponential form's dX in f32 and its scaled X (see plan_loss): after one another in the
  // same bytes, or side by side when dX runs beside dW.
  void* staging = partials;
  void* staging_x = plan.dx_beside_dw
                        ? static_cast<char*>(staging) + Layout<1>::round_to(sizeof(float) * size_t(R * call.hidden),
                                                                            kStagingAlign)
                        : staging;

  const PrepareArgs prep = prepare_args(call, scalars, f16_products);
  LMLOSS_CHECK(launch_prepare(prep, r.stream));
  if (bias) LMLOSS_CHECK(launch_to_f32(call.head.bias.data, call.head.bias.dtype, call.vocab, bias, r.stream));
  if (label_order)
    LMLOSS_CHECK(launch_label_order(call.targets.labels.data, call.targets.labels.dtype, call.n_tokens, call.vocab,
                                    label_order, pc[kLabelOrder].fixed, r.stream));
  if (large.cols) LMLOSS_CHECK(launch_clear_large_entries(large, call.n_tokens, r.stream));

  LossRowsArgs a = row_args_common(call);
  a.work = plan.row_stats_product             ? (grads_computed(call) ? RowWork::stats_and_grad_from_partials
                                                                       : RowWork::stats_from_partials)
           : !grads_computed(call)             ? RowWork::stats
           : call.mode == core::Mode::backward ? RowWork::grad_from_lse
                                               : RowWork::stats_and_grad;
  if (plan.row_stats_product) {  // every chunk lands in the same pieces
    a.partial = partials;
    a.partial_ld = row_stats_tiles(call.vocab);
    a.partial_tiles = a.partial_ld;
    a.label_s = label_s;
    a.logits_dtype = LMLOSS_F32;  // a forward reads no logits
    if (forms_gradient(a.work)) {  // the shifted logits, the gradient written over them
      a.logits = a.grad = logits_chunk;
      a.logits_ld = a.grad_ld = plan.logits_ld;
      a.logits_dtype = a.grad_dtype = call.input_dtype;
    }
    if (plan.exp_form) {
      a.exp_shift = exp_shift;
      a.row_scale = row_scale;
      a.label_grad = label_grad;
      a.hidden = call.head.hidden.data;
      a.hidden_ld = row_stride(call.head.hidden);
      a.weight = call.head.weight.data;
      a.weight_ld = row_stride(call.head.weight);
      a.hidden_size = call.hidden;
      a.head_dtype = call.input_dtype;
      a.large_cols = large.cols;
      a.large_coefs = large.coefs;
      a.large_stored = large.stored;
      a.large_slots = large.slots;
      a.large_row_scale = large.row_scale;
    }
  }
  a.token_loss = loss_wanted ? token_loss : nullptr;
  a.lse_out = call.mode != core::Mode::backward ? static_cast<float*>(call.lse.data) : nullptr;
  a.lse_in = call.mode == core::Mode::backward ? static_cast<const float*>(call.lse.data) : nullptr;
  a.grad_loss = static_cast<const float*>(prep.grad_loss);
  a.scalars = scalars;
  a.error_flag = r.state.error_flag;
  a.sparse_s = sparse;
  a.entry_keys = static_cast<uint64_t*>(piece(kEntryKeys));
  a.bias = bias;

  const lmloss_grads& g = call.grads;
  const bool accumulate_w = (o.flags & LMLOSS_ACCUMULATE_GRAD_WEIGHT) != 0;
  const bool accumulate_b = (o.flags & LMLOSS_ACCUMULATE_GRAD_BIAS) != 0;
  const char* x = static_cast<const char*>(call.head.hidden.data);
  const int64_t x_ld = call.linear ? row_stride(call.head.hidden) : 0;
  const int64_t in_size = int64_t(core::dtype_size(call.input_dtype));

  // dW's rows as the products and the label term add to them. With LMLOSS_SUM_GRAD_WEIGHT_IN_F32,
  // a 16-bit dW summed in f32 over its own bytes (see launch_regroup_rows) and a dense f32 tail of
  // workspace, (vocab - rows) x hidden x 4 bytes taken for the call beyond the budget (as an f32 dW
  // of the caller's would be; core::weight_sum_rows_in_place), widened first when the call adds to
  // it and rounded once at the end, as on the CPU; or the caller's kept sum, in place and in the
  // caller's tail, left unrounded.
  const lmloss_tensor& kept_tail = o.grad_weight_sum_tail;
  const bool kept_dw = call.linear && grads && g.grad_weight.data && kept_tail.data;
  const bool wide_dw = kept_dw || (call.linear && grads && g.grad_weight.data && g.grad_weight.dtype != LMLOSS_F32 &&
                                   (o.flags & LMLOSS_SUM_GRAD_WEIGHT_IN_F32));
  WeightGradRows dw;
  dw.rows = g.grad_weight.data;
  dw.ld = row_stride(g.grad_weight);
  dw.split = call.vocab;
  dw.dtype = g.grad_weight.dtype;
  Workspace dw_tail(r.context, r.state.device, r.stream);
  const int64_t chunks = plan_chunk_count(plan, call.n_tokens);
  // The last chunk's dW product stored straight into the bf16 dW over the library's own sum, in
  // place of its product into the sum and the rounding pass (weight_grad_store.cuh): on sm_90a,
  // for the statistics product's gradient, when that chunk adds to a sum.
  WeightGradStoreArgs store;
  void* store_ws = nullptr;
  bool store_dw = wide_dw && !kept_dw && plan.row_stats_product && !plan.separate_grad && forms_gradient(a.work) &&
                  call.input_dtype == LMLOSS_BF16 && g.grad_weight.dtype == LMLOSS_BF16 &&
                  row_stride(g.grad_weight) == call.hidden && (chunks > 1 || accumulate_w);
  const bool rest_dw = kept_dw && core::weight_sum_keeps_rests(kept_tail);
  if (rest_dw) {  // the pair: bf16 values in grad_weight, rests in the tail, every row
    dw.rests = static_cast<int8_t*>(kept_tail.data);
    dw.rests_ld = row_stride(kept_tail);
  } else if (kept_dw) {
    dw.split = call.weight_sum_split;
    dw.tail = kept_tail.data;
    dw.tail_ld = row_stride(kept_tail);
    dw.dtype = LMLOSS_F32;
    // One f32 matrix: one product a chunk, as into an f32 dW (two part products took 0.6 ms more a
    // step at llama3-8b, run 46).
    if (core::weight_sum_is_one_matrix(g.grad_weight, kept_tail, dw.split, call.hidden)) {
      dw.split = call.vocab;
      dw.tail = nullptr;
    }
  } else if (wide_dw) {
    dw.split = core::weight_sum_rows_in_place(g.grad_weight, call.vocab, call.hidden);
    dw.tail_ld = call.hidden;
    dw.dtype = LMLOSS_F32;
    const size_t tail_bytes = align256(sizeof(float) * size_t(call.vocab - dw.split) * size_t(call.hidden));
    if (store_dw) {
      const auto [last_row0, last_rows] = chunk_span(plan, call.n_tokens, chunks - 1);
      store.device = r.state.device;
      store.vocab = call.vocab;
      store.hidden = call.hidden;
      store.tokens = last_rows;
      store.grad = logits_chunk;
      store.grad_ld = plan.grad_ld;
      store.x = plan.exp_form ? staging_x : x + last_row0 * x_ld * in_size;
      store.x_ld = plan.exp_form ? call.hidden : x_ld;
      store.alpha = plan.exp_form ? &scalars->token_scale : &scalars->inv_grad_scale;
      store.rows = dw.rows;
      store.split = dw.split;
      store.tail_ld = dw.tail_ld;
      store_dw = weight_grad_store_supported(store);  // the tail yet to come, aligned as all workspace
    }
    const size_t store_bytes = store_dw ? weight_grad_store_workspace(store) : 0;
    LMLOSS_CHECK(dw_tail.acquire(tail_bytes + store_bytes));
    dw.tail = dw_tail.at<void>(0);
    if (store_dw) {
      store.tail = static_cast<const float*>(dw.tail);
      store_ws = dw_tail.at<void>(tail_bytes);
    }
    if (accumulate_w) {  // the caller's 16-bit rows from split on into the tail, then the rest widened in place
      const char* tail_rows16 = static_cast<char*>(dw.rows) + dw.split * dw.ld * int64_t(core::dtype_size(g.grad_weight.dtype));
      LMLOSS_CHECK(launch_scale_rows(tail_rows16, g.grad_weight.dtype, dw.ld, nullptr, nullptr, call.vocab - dw.split,
                                     call.hidden, dw.tail, dw.tail_ld, LMLOSS_F32, r.stream));
      LMLOSS_CHECK(launch_regroup_rows(dw.rows, g.grad_weight.dtype, dw.split, call.hidden, dw.ld, false, nullptr,
                                       r.stream));
    }
  }

  // An f32 sum in two equal parts as wide as each other (a vocabulary of a multiple of 16, its tail
  // apart from the rows in place) takes each chunk's product as one strided batch over both, D's
  // batch stride the distance from the rows to the tail: one launch, one partial last wave. At
  // llama3-8b N 8192 on an H200 the fused step took ~0.4 ms less than with two products a chunk
  // (run 48). Only with the tail above the rows: cuBLASLt read out of bounds given a negative
  // batch stride (run 48's probe), so a tail below them still takes two products.
  int64_t dw_parts_stride = 0;
  if (dw.tail && 2 * dw.split == call.vocab && dw.tail_ld == dw.ld) {
    const int64_t bytes = int64_t(reinterpret_cast<uintptr_t>(dw.tail)) - int64_t(reinterpret_cast<uintptr_t>(dw.rows));
    if (bytes > 0 && bytes % int64_t(sizeof(float)) == 0) dw_parts_stride = bytes / int64_t(sizeof(float));
  }

  // The large entries' exact terms in place of the products' (see LargeEntries): after the last
  // chunk's row kernel, before the sum is rounded.
  auto add_large_entries = [&]() -> lmloss_status {
    LargeEntriesTerms terms;
    terms.tokens = call.n_tokens;
    terms.vocab = call.vocab;
    terms.cols = call.hidden;
    terms.x = x;
    terms.x_ld = x_ld;
    terms.scalars = scalars;
    return launch_add_large_entries(large, terms, dw, r.stream);
  };
  for (int64_t step = 0; step < chunks; ++step) {
    const int64_t chunk = deferred_base ? (step + 1) % chunks : step;  // a deferred chunk 0 runs last
    const bool defers = deferred_base && chunk == 0;
    const auto [row0, rows] = chunk_span(plan, call.n_tokens, chunk);
    a.row0 = row0;
    a.rows = rows;
    if (!call.linear) {
      const int64_t ld = row_stride(call.head.logits);
      a.logits = static_cast<const char*>(call.head.logits.data) + row0 * ld * in_size;
      a.logits_ld = ld;
      a.logits_dtype = call.input_dtype;
      if (a.work != RowWork::stats) {
        const int64_t gld = row_stride(g.grad_logits);
        a.grad = static_cast<char*>(g.grad_logits.data) + row0 * gld * in_size;
        a.grad_ld = gld;
        a.grad_dtype = call.input_dtype;
      }
      LMLOSS_CHECK(launch_loss_rows(a, r.stream));
      continue;
    }

    const void* x_chunk = x + row0 * x_ld * in_size;
    char* grad = static_cast<char*>(plan.separate_grad ? grad_chunk : logits_chunk);
    if (plan.row_stats_product) {
      if (plan.exp_form) LMLOSS_CHECK(launch_exp_shift(exp_shift_args(call, row0, rows, exp_shift), r.stream));
      const int64_t launch_rows = product_launch_rows(rows);
      for (int64_t sub0 = 0; sub0 < rows; sub0 += launch_rows) {
        RowStatsProductArgs product = row_stats_args(call, std::min(launch_rows, rows - sub0), row0 + sub0);
        product.partial = partials + sub0 * product.partial_ld;
        product.label_s = label_s + sub0;
        if (forms_gradient(a.work)) {
          product.shifted = reinterpret_cast<char*>(logits_chunk) + sub0 * plan.logits_ld * in_size;
          product.shifted_ld = plan.logits_ld;
        }
        if (plan.exp_form) product.exp_shift = exp_shift + sub0;
        LMLOSS_CHECK(run_row_stats_product(product, piece(kProductWs), r.stream));
      }
      LMLOSS_CHECK(launch_loss_rows(a, r.stream));
      if (!forms_gradient(a.work)) continue;
    } else {
      // The chunk's logits, a logits chunk at a time (the whole chunk unless the gradient has its
      // own buffer), each followed by its row kernel.
      const size_t grad_size = core::dtype_size(plan.grad_dtype);
      a.logits = logits_chunk;
      a.logits_ld = plan.logits_ld;
      a.logits_dtype = LMLOSS_F32;
      if (a.work != RowWork::stats) {
        a.grad_ld = plan.grad_ld;
        a.grad_dtype = plan.grad_dtype;
      }
      for (int64_t sub0 = 0; sub0 < rows; sub0 += plan.logits_rows) {
        const int64_t sub_rows = std::min(plan.logits_rows, rows - sub0);
        const MatmulShape fwd = logits_product(call, sub_rows, plan.logits_ld, matmul_ws_bytes);
        LMLOSS_CHECK(r.state.matmul.run(fwd, call.head.weight.data, x + (row0 + sub0) * x_ld * in_size,
                                        logits_chunk, &scalars->one, &scalars->zero, matmul_ws, r.stream,
                                        r.context.tune_products));
        a.row0 = row0 + sub0;
        a.rows = sub_rows;
        if (a.work != RowWork::stats) a.grad = grad + sub0 * plan.grad_ld * grad_size;
        LMLOSS_CHECK(launch_loss_rows(a, r.stream));
      }
      if (a.work == RowWork::stats) continue;
    }

    const lmloss_dtype gtype = a.grad_dtype;
    LabelRows label_rows;  // the exponential form's one-hot term
    if (plan.exp_form && call.targets.labels.data) {
      label_rows.coef = label_grad;
      label_rows.labels = call.targets.labels.data;
      label_rows.labels_dtype = call.targets.labels.dtype;
      label_rows.row0 = row0;
      label_rows.vocab = call.vocab;
    }
    // With dX and dW in the exponential form, the chunk's dX product and its rows' scaling run on
    // the side stream beside its dW, whose tiles take the SMs that dX leaves idle (a chunk of
    // gemma2-2b's dX is 117 output tiles on 132 SMs); joined before the next chunk's product
    // writes over E and the staging.
    SideStream side(r.state, r.stream);
    cudaStream_t dx_stream = r.stream;
    void* dx_matmul_ws = matmul_ws;
    if (plan.dx_beside_dw) {
      LMLOSS_CHECK(side.fork(&dx_stream));
      dx_matmul_ws = side_matmul_ws;
    }
    if (g.grad_hidden.data) {
      // dX_chunk: column-major (hidden, rows) = W^T (hidden, vocab) * G^T (vocab, rows).
      MatmulShape s;
      s.m = call.hidden;
      s.n = rows;
      s.k = call.vocab;
      s.lda = row_stride(call.head.weight);
      s.ldb = plan.grad_ld;
      s.ldd = row_stride(g.grad_hidden);
      s.ab_type = gtype;
      s.d_type = g.grad_hidden.dtype;
      s.workspace_bytes = matmul_ws_bytes;
      char* d = static_cast<char*>(g.grad_hidden.data) + row0 * s.ldd * int64_t(core::dtype_size(s.d_type));
      if (plan.exp_form) {  // the product in f32, then each row times its scale
        const int64_t d_ld = s.ldd;
        s.ldd = call.hidden;
        s.d_type = LMLOSS_F32;
        LMLOSS_CHECK(r.state.matmul.run(s, call.head.weight.data, grad, staging, &scalars->token_scale,
                                        &scalars->zero, dx_matmul_ws, dx_stream, r.context.tune_products));
        LMLOSS_CHECK(launch_scale_rows(staging, LMLOSS_F32, call.hidden, nullptr, row_scale, rows, call.hidden, d,
                                       d_ld, g.grad_hidden.dtype, dx_stream, label_rows, call.head.weight.data,
                                       row_stride(call.head.weight)));
      } else {
        LMLOSS_CHECK(r.state.matmul.run(s, call.head.weight.data, grad, d, &scalars->inv_grad_scale,
                                        &scalars->zero, matmul_ws, r.stream, r.context.tune_products));
      }
    }
    if (g.grad_weight.data) {
      // dW: column-major (hidden, vocab) = X_chunk^T (hidden, rows) * G (rows, vocab).
      MatmulShape s;
      s.m = call.hidden;
      s.n = dw.split;
      s.k = rows;
      s.trans_b = true;
      s.lda = x_ld;
      s.ldb = plan.grad_ld;
      s.ldd = dw.ld;
      s.ab_type = gtype;
      s.d_type = dw.dtype;
      s.workspace_bytes = matmul_ws_bytes;
      // 128 x 160 tiles where offered: the fastest of the heuristic's 8 candidates for 16-bit
      // chunks into an f32 dW on an H200 (cuBLASLt 13.1), with beta 0 and 1 alike, at llama3-8b
      // and gemma2-2b chunk heights; the heuristic's first took 0.1-0.8 ms more per chunk
      // (docs/performance.md, run 28).
      if (gtype != LMLOSS_F32 && s.d_type == LMLOSS_F32) s.preferred_tile = CUBLASLT_MATMUL_TILE_128x160;
      const bool add = step > 0 || accumulate_w;
      const void* x_rows = x_chunk;
      const float* alpha = &scalars->inv_grad_scale;
      if (plan.exp_form) {  // each row of X times its scale
        if (!defers)
          LMLOSS_CHECK(launch_scale_rows(x_chunk, call.input_dtype, x_ld, nullptr, row_scale, rows, call.hidden,
                                         staging_x, call.hidden, call.input_dtype, r.stream));
        x_rows = staging_x;
        s.lda = call.hidden;
        alpha = &scalars->token_scale;
      }
      auto add_label_rows = [&](int64_t chunk_rows) {
        return launch_add_label_rows(label_order, call.n_tokens, label_rows, chunk_rows, x_chunk, x_ld, call.hidden,
                                     dw, r.stream);
      };
      if (defers) {  // the product's X rows (scaled as for it) and alpha beside its G, the label terms into the sum
        if (rows != deferred.rows) return core::fail(LMLOSS_ERROR_INTERNAL, "deferred dW product: not the tallest chunk");
        LMLOSS_CHECK(launch_scale_rows(x_chunk, call.input_dtype, x_ld, nullptr, plan.exp_form ? row_scale : nullptr,
                                       rows, call.hidden, deferred.x(deferred_base), call.hidden, call.input_dtype,
                                       r.stream));
        LMLOSS_CUDA_TRY(cudaMemcpyAsync(deferred.alpha(deferred_base), alpha, sizeof(float),
                                        cudaMemcpyDeviceToDevice, r.stream));
        if (label_rows.coef) LMLOSS_CHECK(add_label_rows(rows));
      } else if (store_dw && chunk == chunks - 1) {  // the sum's other terms first: the store leaves no f32 sum
        if (label_rows.coef) LMLOSS_CHECK(add_label_rows(rows));
        if (large.cols) LMLOSS_CHECK(add_large_entries());
        LMLOSS_CHECK(run_weight_grad_store(store, store_ws, r.stream));
      } else {
        const float* beta = add ? &scalars->one : &scalars->zero;
        if (rest_dw && plan.rest_product) {  // one kernel, reading and writing the pair
          RestProductArgs product = rest_product_args(call, rows);
          product.grad = grad;
          product.grad_ld = plan.grad_ld;
          product.x = x_rows;
          product.x_ld = s.lda;
          product.alpha = alpha;
          product.kind = add ? RestProduct::add : RestProduct::first;
          if (!rest_product_supported(product) || rest_product_workspace(product) > pc[kRestSlice].bytes(R))
            return core::fail(LMLOSS_ERROR_INTERNAL, "dW product into rests: not as planned");
          LMLOSS_CHECK(run_rest_product(product, piece(kRestSlice), r.stream));
          s.n = 0;
        } else if (rest_dw) {  // a slice of vocabulary rows at a time, into f32 and folded into the pair
          float* slice = static_cast<float*>(piece(kRestSlice));
          s.ldd = call.hidden;
          s.d_type = LMLOSS_F32;
          if (gtype != LMLOSS_F32) s.preferred_tile = CUBLASLT_MATMUL_TILE_128x160;
          for (int64_t v0 = 0; v0 < call.vocab; v0 += kRestSliceRows) {
            s.n = std::min(kRestSliceRows, call.vocab - v0);
            LMLOSS_CHECK(r.state.matmul.run(s, x_rows, grad + v0 * int64_t(core::dtype_size(gtype)), slice, alpha,
                                            &scalars->zero, matmul_ws, r.stream, r.context.tune_products));
            LMLOSS_CHECK(launch_fold_rests(slice, s.n, call.hidden, add,
                                           static_cast<char*>(dw.rows) + v0 * dw.ld * int64_t(sizeof(uint16_t)),
                                           dw.ld, dw.rests + v0 * dw.rests_ld, dw.rests_ld, r.stream));
          }
          s.n = 0;  // nothing more below
        }
        if (dw_parts_stride > 0) {  // both parts at once: the gradient's columns from split on into the tail
          s.batch = 2;
          s.batch_stride_b = dw.split;
          s.batch_stride_d = dw_parts_stride;
        }
        if (s.n > 0)
          LMLOSS_CHECK(r.state.matmul.run(s, x_rows, grad, dw.rows, alpha, beta, matmul_ws, r.stream,
                                          r.context.tune_products));
        if (dw.split < call.vocab && dw_parts_stride == 0) {  // the tail: the gradient's columns from split on
          s.n = call.vocab - dw.split;
          s.ldd = dw.tail_ld;
          LMLOSS_CHECK(r.state.matmul.run(s, x_rows, grad + dw.split * int64_t(core::dtype_size(gtype)), dw.tail,
                                          alpha, beta, matmul_ws, r.stream, r.context.tune_products));
        }
        if (label_rows.coef) LMLOSS_CHECK(add_label_rows(rows));
      }
    }
    if (bias_grad)
      LMLOSS_CHECK(launch_column_sum(grad, plan.grad_ld, gtype, rows, call.vocab, step > 0, scalars,
                                     bias_grad, r.stream));
    if (plan.dx_beside_dw) LMLOSS_CHECK(side.join());
  }

  if (large.cols && !store_dw) LMLOSS_CHECK(add_large_entries());
  if (wide_dw && !kept_dw && !store_dw)
    LMLOSS_CHECK(round_weight_sum(dw.rows, g.grad_weight.dtype, dw.ld, dw.split, call.vocab, call.hidden, dw.tail,
                                  dw.tail_ld, nullptr, r.stream));
  if (reduced_loss) LMLOSS_CHECK(launch_reduce_loss(token_loss, call.n_tokens, scalars,
                                                    static_cast<float*>(call.loss.data), r.stream));
  if (bias_grad)
    LMLOSS_CHECK(launch_store_vector(bias_grad, call.vocab, accumulate_b, g.grad_bias.data,
                                     g.grad_bias.dtype, r.stream));
  return LMLOSS_SUCCESS;
}

lmloss_status run_sliced_dx(LossRun& r, const SlicedPlan& plan) {
  const core::LossCall& call = r.call;
  const int64_t n = call.n_tokens, vocab = call.vocab, hidden = call.hidden;
  const int64_t steps = plan.steps;
  Workspace ws(r.context, r.state.device, r.stream);
  LMLOSS_CHECK(ws.acquire(plan.layout.total(steps)));
  auto piece = [&](int i) -> void* {
    return plan.layout.pieces[i].bytes(steps) ? ws.at<void>(plan.layout.offset(i, steps)) : nullptr;
  };
  void* stored = piece(kSlicedStored);
  auto* partials = static_cast<float4*>(piece(kSlicedPartials));
  auto* folded = static_cast<float4*>(piece(kSlicedFolded));
  auto* flags = static_cast<uint32_t*>(piece(kSlicedFlags));
  auto* staging = static_cast<float*>(piece(kSlicedStaging));
  void* matmul_ws = piece(kSlicedMatmulWs);
  auto* shift = static_cast<float*>(piece(kSlicedShift));
  auto* row_scale = static_cast<float*>(piece(kSlicedRowScale));
  auto* label_grad = static_cast<float*>(piece(kSlicedLabelGrad));
  auto* scalars = static_cast<CallScalars*>(piece(kSlicedScalars));
  auto* token_loss = static_cast<float*>(piece(kSlicedTokenLoss));
  const bool loss_wanted = call.wants_loss() && call.loss.data;
  if (!token_loss && loss_wanted) token_loss = static_cast<float*>(call.loss.data);  // reduction none

  LMLOSS_CHECK(launch_prepare(prepare_args(call, scalars, false), r.stream));
  LMLOSS_CHECK(launch_exp_shift(exp_shift_args(call, 0, n, shift), r.stream));
  const int64_t columns = plan.columns();
  const int64_t w_ld = row_stride(call.head.weight);
  const char* w = static_cast<const char*>(call.head.weight.data);
  for (int64_t slice = 0; slice < plan.slices; ++slice) {
    const int64_t v0 = slice * columns, width = std::min(columns, vocab - v0);
    RowStatsProductArgs product = row_stats_args(call, n);
    product.weight = w + v0 * w_ld * 2;
    product.vocab = width;
    product.labels = nullptr;  // s at the label is the shift (exp_shift_kernel's dot product)
    product.partial = partials;
    product.partial_ld = columns / kRowStatsTileColumns;
    product.shifted = stored;
    product.shifted_ld = columns;
    product.exp_shift = shift;
    LMLOSS_CHECK(run_row_stats_product(product, piece(kSlicedProductWs), r.stream));
    FoldSliceArgs f;
    f.partial = partials;
    f.partial_ld = product.partial_ld;
    f.tiles = row_stats_tiles(width);
    f.rows = n;
    f.shift = shift;
    f.stored = stored;
    f.stored_ld = columns;
    f.columns = width;
    f.folded = folded;
    f.folded_ld = plan.slices;
    f.slice = slice;
    f.flags = flags;
    f.flags_ld = plan.flags_ld;
    f.first_word = v0 / kSliceStep;
    LMLOSS_CHECK(launch_fold_slice(f, r.stream));
    // dX (f32): column-major (hidden, n) += W_slice^T (hidden, width) * E^T (width, n).
    MatmulShape s;
    s.m = hidden;
    s.n = n;
    s.k = width;
    s.lda = w_ld;
    s.ldb = columns;
    s.ldd = hidden;
    s.ab_type = LMLOSS_BF16;
    s.d_type = LMLOSS_F32;
    s.workspace_bytes = plan.matmul_ws;
    LMLOSS_CHECK(r.state.matmul.run(s, w + v0 * w_ld * 2, stored, staging, &scalars->token_scale,
                                    slice > 0 ? &scalars->one : &scalars->zero, matmul_ws, r.stream,
                                    r.context.tune_products));
  }

  LossRowsArgs a = row_args_common(call);
  a.work = RowWork::stats_and_grad_from_partials;
  a.scales_only = true;
  a.logits_dtype = a.grad_dtype = LMLOSS_BF16;  // the exponential form's kernel; nothing read or written
  a.partial = folded;
  a.partial_ld = a.partial_tiles = plan.slices;
  a.label_s = shift;
  a.exp_shift = shift;
  a.row_scale = row_scale;
  a.label_grad = label_grad;
  a.row_coef = static_cast<float*>(piece(kSlicedRowCoef));
  a.row_lse = static_cast<float*>(piece(kSlicedRowLse));
  a.token_loss = loss_wanted ? token_loss : nullptr;
  a.lse_out = static_cast<float*>(call.lse.data);
  a.grad_loss = static_cast<const float*>(call.grad_loss.data);
  a.scalars = scalars;
  a.error_flag = r.state.error_flag;
  a.sparse_s = static_cast<float*>(piece(kSlicedSparse));
  a.rows = n;
  LMLOSS_CHECK(launch_loss_rows(a, r.stream));

  // dX = row_scale * staging + the flagged tiles' terms, all in f32; then + the label's one-hot
  // term, rounded once into dX's dtype.
  LMLOSS_CHECK(launch_scale_rows(staging, LMLOSS_F32, hidden, nullptr, row_scale, n, hidden, staging, hidden,
                                 LMLOSS_F32, r.stream));
  FlaggedTilesArgs fx;
  fx.hidden = call.head.hidden.data;
  fx.hidden_ld = row_stride(call.head.hidden);
  fx.weight = call.head.weight.data;
  fx.weight_ld = w_ld;
  fx.rows = n;
  fx.vocab = vocab;
  fx.hidden_size = hidden;
  fx.inv_temperature = float(1.0 / call.options.temperature);
  fx.flags = flags;
  fx.flags_ld = plan.flags_ld;
  fx.row_coef = a.row_coef;
  fx.row_lse = a.row_lse;
  fx.dx = staging;
  LMLOSS_CHECK(launch_add_flagged_tiles(fx, r.stream));
  LabelRows label_rows;
  label_rows.coef = label_grad;
  label_rows.labels = call.targets.labels.data;
  label_rows.labels_dtype = call.targets.labels.dtype;
  label_rows.vocab = vocab;
  const lmloss_tensor& dx = call.grads.grad_hidden;
  LMLOSS_CHECK(launch_scale_rows(staging, LMLOSS_F32, hidden, nullptr, nullptr, n, hidden, dx.data, row_stride(dx),
                                 dx.dtype, r.stream, label_rows, w, w_ld));
  if (piece(kSlicedTokenLoss))
    LMLOSS_CHECK(launch_reduce_loss(token_loss, n, scalars, static_cast<float*>(call.loss.data), r.stream));
  return LMLOSS_SUCCESS;
}

// ---- the backend -----------------------------------------------------------------------------

class CudaBackend final : public core::Backend {
 public:
  bool available() const override {
    static const bool found = [] {
      int count = 0;
      const cudaError_t st = cudaGetDeviceCount(&count);
      if (st != cudaSuccess) {
        cudaGetLastError();
        return false;
      }
      // A device, and the cuBLASLt library (loaded at run time, see cublaslt_library.hpp).
      return count > 0 && cublaslt() != nullptr;
    }();
    return found;
  }

  lmloss_status check(lmloss_context& context, const core::LossCall& call) override {
    if (call.input_dtype == LMLOSS_F64)
      return core::fail(LMLOSS_ERROR_UNSUPPORTED,
                        "head: f64 tensors are CPU only; use f32, bf16 or f16 on CUDA");
    LMLOSS_CHECK(check_vector(call.targets.labels, "targets.labels"));
    LMLOSS_CHECK(check_vector(call.targets.token_mask, "targets.token_mask"));
    LMLOSS_CHECK(check_vector(call.loss, "loss"));
    LMLOSS_CHECK(check_vector(call.lse, "lse"));
    LMLOSS_CHECK(check_vector(call.grad_loss, "grad_loss"));
    LMLOSS_CHECK(check_vector(call.head.bias, "head.bias"));
    LMLOSS_CHECK(check_vector(call.grads.grad_bias, "grads.grad_bias"));
    if (call.mode == core::Mode::backward && wants_any_grad(call) && !call.lse.data)
      return core::fail(LMLOSS_ERROR_INVALID_ARGUMENT, "lse: the backward needs the forward's lse");
    const LossPlan plan = plan_loss(context, call);
    if (plan.chunk_rows == 0) return budget_error(context, plan.layout.total(1));
    return LMLOSS_SUCCESS;
  }

  lmloss_status check(lmloss_context& context, const core::TopkCall& call) override {
    if (call.input_dtype == LMLOSS_F64)
      return core::fail(LMLOSS_ERROR_UNSUPPORTED,
                        "head: f64 tensors are CPU only; use f32, bf16 or f16 on CUDA");
    if (call.vocab >= (int64_t(1) << 31) - 1)
      return core::fail(LMLOSS_ERROR_UNSUPPORTED, "head: top-k on CUDA needs vocab < 2^31");
    LMLOSS_CHECK(check_vector(call.head.bias, "head.bias"));
    LMLOSS_CHECK(check_vector(call.tail, "tail"));
    const TopkPlan plan = plan_topk(context, call);
    if (plan.chunk_rows == 0) return budget_error(context, plan.layout.total(1));
    return LMLOSS_SUCCESS;
  }

  lmloss_status run(lmloss_context& context, const core::LossCall& call) override {
    DeviceGuard guard(call.device_index);
    CudaState* state = nullptr;
    LMLOSS_CHECK(get_state(context, call.device_index, &state));
    const LossPlan plan = plan_loss(context, call);
    if (plan.chunk_rows == 0) return budget_error(context, plan.layout.total(1));
    LossRun r{context, call, *state, static_cast<cudaStream_t>(context.stream)};
    return run_loss(r, plan);
  }

  lmloss_status run(lmloss_context& context, const core::TopkCall& call) override {
    DeviceGuard guard(call.device_index);
    CudaState* state = nullptr;
    LMLOSS_CHECK(get_state(context, call.device_index, &state));
    const TopkPlan plan = plan_topk(context, call);
    const int64_t k = call.options.k;
    if (plan.chunk_rows == 0) return budget_error(context, plan.layout.total(1));
    const auto stream = static_cast<cudaStream_t>(context.stream);
    const int64_t R = plan.chunk_rows;
    const int64_t chunks = plan_chunk_count(plan, call.n_tokens);

    Workspace ws(context, state->device, stream);
    LMLOSS_CHECK(ws.acquire(plan.layout.total(R)));
    auto piece = [&](int i) -> void* {
      return plan.layout.pieces[i].bytes(R) ? ws.at<void>(plan.layout.offset(i, R)) : nullptr;
    };
    auto* scalars = static_cast<CallScalars*>(piece(kTopkScalars));
    float* bias = static_cast<float*>(piece(kTopkBias));
    void* matmul_ws = piece(kTopkMatmulWs);
    const size_t matmul_ws_bytes = plan.matmul_ws;
    float* logits_chunk = static_cast<float*>(piece(kTopkLogits));
    void* scratch = piece(kTopkSort);
    float* row_lse = static_cast<float*>(piece(kTopkLse));

    if (scalars) {
      PrepareArgs prep;  // only the product constants are used
      prep.scalars = scalars;
      LMLOSS_CHECK(launch_prepare(prep, stream));
    }
    if (bias) LMLOSS_CHECK(launch_to_f32(call.head.bias.data, call.head.bias.dtype, call.vocab, bias, stream));

    TopkRowsArgs a;
    a.bias = bias;
    a.vocab = call.vocab;
    a.k = k;
    a.ids = static_cast<int32_t*>(call.ids.data);
    a.ids_ld = row_stride(call.ids);
    a.probs = static_cast<float*>(call.probs.data);
    a.probs_ld = row_stride(call.probs);
    a.tail = static_cast<float*>(call.tail.data);
    a.renormalize = call.options.renormalize != 0;
    a.scale = core::LogitScale<float>::make(call.options.softcap, call.options.temperature);
    a.lse_scratch = row_lse;
    if (plan.from_product) {
      TopkCandidatesArgs c;
      c.candidates = static_cast<const uint64_t*>(piece(kTopkCandidates));
      c.runners_up = static_cast<const uint64_t*>(piece(kTopkRunnersUp));
      c.tiles = row_stats_tiles(call.vocab);
      c.candidates_ld = c.tiles * kTopkCandidatesPerTile;
      // Probabilities renormalised over the k need no lse: the product then keeps no statistics.
      float4* partials = call.options.renormalize ? nullptr : static_cast<float4*>(piece(kTopkPartials));
      c.partial = partials;
      c.partial_ld = c.tiles;
      c.head = topk_head(call);
      c.inv_temperature = float(1.0 / call.options.temperature);
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        const auto [row0, rows] = chunk_span(plan, call.n_tokens, chunk);
        RowStatsProductArgs product = row_stats_args(call, rows, row0);
        product.partial = partials;
        product.candidates = static_cast<uint64_t*>(piece(kTopkCandidates));
        product.runners_up = static_cast<uint64_t*>(piece(kTopkRunnersUp));
        product.candidates_ld = c.candidates_ld;
        LMLOSS_CHECK(run_row_stats_product(product, piece(kTopkProductWs), stream));
        c.select = a;
        c.select.row0 = row0;
        c.select.rows = rows;
        LMLOSS_CHECK(launch_topk_from_candidates(c, stream));
      }
      return LMLOSS_SUCCESS;
    }
    const int64_t in_size = int64_t(core::dtype_size(call.input_dtype));
    const char* x = static_cast<const char*>(call.head.hidden.data);
    const int64_t x_ld = call.linear ? row_stride(call.head.hidden) : 0;
    if (plan.above_bar) {
      const TopkBarPlan& bar_plan = plan.bar;
      auto* sample = static_cast<float*>(piece(kTopkSample));
      auto* bar = static_cast<float*>(piece(kTopkBar));
      auto* kept = static_cast<uint64_t*>(piece(kTopkKept));
      auto* kept_count = static_cast<int32_t*>(piece(kTopkKeptCount));
      float4* partials = call.options.renormalize ? nullptr : static_cast<float4*>(piece(kTopkPartials));
      const char* sample_weight = static_cast<const char*>(call.head.weight.data) +
                                  bar_plan.offset * row_stride(call.head.weight) * in_size;
      TopkKeptArgs c;
      c.select = a;
      c.kept = kept;
      c.kept_count = kept_count;
      c.kept_ld = bar_plan.kept_ld;
      c.partial = partials;
      c.partial_ld = row_stats_tiles(call.vocab);
      c.tiles = c.partial_ld;
      c.head = topk_head(call);
      c.redo_logits = static_cast<float*>(piece(kTopkRedo));
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        const auto [row0, rows] = chunk_span(plan, call.n_tokens, chunk);
        // The sample's logits: the logits product over W's rows offset + step i alone.
        MatmulShape sampled = logits_product(call, rows, kTopkSampleColumns, matmul_ws_bytes);
        sampled.m = kTopkSampleColumns;
        sampled.lda *= bar_plan.step;
        LMLOSS_CHECK(state->matmul.run(sampled, sample_weight, x + row0 * x_ld * in_size, sample, &scalars->one,
                                       &scalars->zero, matmul_ws, stream, context.tune_products));
        TopkBarArgs b;
        b.sample = sample;
        b.rows = rows;
        b.rank = bar_plan.rank;
        b.inv_temperature = float(1.0 / call.options.temperature);
        b.bar = bar;
        b.kept_count = kept_count;
        LMLOSS_CHECK(launch_topk_bar(b, stream));
        RowStatsProductArgs product = row_stats_args(call, rows, row0);
        product.partial = partials;
        product.keep_above = bar;
        product.kept = kept;
        product.kept_count = kept_count;
        product.kept_ld = bar_plan.kept_ld;
        LMLOSS_CHECK(run_row_stats_product(product, piece(kTopkProductWs), stream));
        c.select.row0 = row0;
        c.select.rows = rows;
        LMLOSS_CHECK(launch_topk_from_kept(c, stream));
      }
      return LMLOSS_SUCCESS;
    }
    for (int64_t row0 = 0; row0 < call.n_tokens; row0 += R) {
      const int64_t rows = std::min(R, call.n_tokens - row0);
      a.row0 = row0;
      a.rows = rows;
      if (call.linear) {
        const MatmulShape fwd = logits_product(call, rows, plan.logits_ld, matmul_ws_bytes);
        LMLOSS_CHECK(state->matmul.run(fwd, call.head.weight.data, x + row0 * x_ld * in_size, logits_chunk,
                                       &scalars->one, &scalars->zero, matmul_ws, stream, context.tune_products));
        a.logits = logits_chunk;
        a.logits_ld = plan.logits_ld;
        a.logits_dtype = LMLOSS_F32;
      } else {
        const int64_t ld = row_stride(call.head.logits);
        a.logits = static_cast<const char*>(call.head.logits.data) + row0 * ld * in_size;
        a.logits_ld = ld;
        a.logits_dtype = call.input_dtype;
      }
      LMLOSS_CHECK(launch_topk_rows(a, scratch, stream));
    }
    return LMLOSS_SUCCESS;
  }

  lmloss_status run(lmloss_context& context, const core::ScaleCall& call) override {
    if (call.grad.dtype == LMLOSS_F64 || call.out.dtype == LMLOSS_F64)
      return core::fail(LMLOSS_ERROR_UNSUPPORTED, "grad, out: f64 tensors are CPU only; use f32 on CUDA");
    DeviceGuard guard(call.device_index);
    return launch_scale_rows(call.grad.data, call.grad.dtype, row_stride(call.grad), static_cast<const float*>(call.scale.data),
                             nullptr, call.rows, call.cols, call.out.data, row_stride(call.out), call.out.dtype,
                             static_cast<cudaStream_t>(context.stream));
  }

  lmloss_status deferred_bytes(lmloss_context& context, const core::LossCall& call, size_t& bytes) override {
    bytes = 0;
    if (call.input_dtype == LMLOSS_F64) return LMLOSS_SUCCESS;  // refused by check()
    bytes = deferred_product(call, plan_loss(context, call)).bytes();
    return LMLOSS_SUCCESS;
  }

  lmloss_status run(lmloss_context& context, const core::WeightSumCall& call) override {
    DeviceGuard guard(call.device_index);
    if (core::weight_sum_keeps_rests(call.tail)) {
      if (call.deferred.data) return store_deferred(context, call);
      return launch_round_rests(call.grad_weight.data, row_stride(call.grad_weight),
                                static_cast<const int8_t*>(call.tail.data), row_stride(call.tail), call.vocab,
                                call.hidden, static_cast<const float*>(call.scale.data),
                                static_cast<cudaStream_t>(context.stream));
    }
    if (call.deferred.data) return store_deferred(context, call);
    return round_weight_sum(call.grad_weight.data, call.grad_weight.dtype, row_stride(call.grad_weight), call.split,
                            call.vocab, call.hidden,
                            call.tail.data, row_stride(call.tail), static_cast<const float*>(call.scale.data),
                            static_cast<cudaStream_t>(context.stream));
  }

  // lmloss_round_grad_weight_deferred: the product stored over the kept sum, scaled.
  lmloss_status store_deferred(lmloss_context& context, const core::WeightSumCall& call) {
    const size_t bytes = size_t(call.deferred.shape[0]), row_bytes = 2 * size_t(call.vocab + call.hidden);
    const DeferredProduct d{bytes > kDeferredHeader ? int64_t((bytes - kDeferredHeader) / row_bytes) : 0, call.vocab,
                            call.hidden};
    if (d.rows == 0 || d.bytes() != bytes)
      return core::fail(LMLOSS_ERROR_INVALID_ARGUMENT, "deferred: " + std::to_string(bytes) +
                                                           " bytes are not a deferred product of this grad_weight");
    void* base = call.deferred.data;
    const auto stream = static_cast<cudaStream_t>(context.stream);
    // The store with the step's alpha and the sum's scale, times the upstream gradient, beside its scratch.
    const auto run_scaled = [&](auto store, size_t store_bytes, auto run) {
      Workspace ws(context, call.device_index, stream);
      LMLOSS_CHECK(ws.acquire(store_bytes + 2 * sizeof(float)));
      float* alpha_beta = ws.at<float>(store_bytes);
      LMLOSS_CHECK(
          launch_deferred_scalars(d.alpha(base), static_cast<const float*>(call.scale.data), alpha_beta, stream));
      store.alpha = alpha_beta;
      store.beta = alpha_beta + 1;
      return run(store, ws.at<void>(0), stream);
    };
    const auto unsupported = [] {
      return core::fail(LMLOSS_ERROR_UNSUPPORTED, "deferred: this grad_weight's sum cannot take a deferred product "
                                                  "here (lmloss_loss_deferred_bytes gave 0 for its step)");
    };
    if (core::weight_sum_keeps_rests(call.tail)) {
      const RestProductArgs store = deferred_rest_args(call.device_index, d, base, call.grad_weight, call.tail);
      if (!rest_product_supported(store)) return unsupported();
      return run_scaled(store, align256(rest_product_workspace(store)), run_rest_product);
    }
    const WeightGradStoreArgs store =
        deferred_store_args(call.device_index, d, base, call.grad_weight.data, call.split, call.tail);
    if (call.grad_weight.dtype != LMLOSS_BF16 || !weight_grad_store_supported(store)) return unsupported();
    return run_scaled(store, align256(weight_grad_store_workspace(store)), run_weight_grad_store);
  }

  lmloss_status zero(lmloss_context& context, const lmloss_tensor& t) override {
    DeviceGuard guard(t.device_index);
    const size_t size = core::dtype_size(t.dtype), width = size_t(core::row_length(t)) * size;
    const size_t pitch = t.ndim == 2 ? size_t(row_stride(t)) * size : width;
    LMLOSS_CUDA_TRY(cudaMemset2DAsync(t.data, pitch, 0, width, size_t(core::row_count(t)),
                                      static_cast<cudaStream_t>(context.stream)));
    return LMLOSS_SUCCESS;
  }

  lmloss_status synchronize(lmloss_context& context) override {
    auto* state = dynamic_cast<CudaState*>(context.cuda_state.get());
    if (!state) return LMLOSS_SUCCESS;
    DeviceGuard guard(state->device);
    const auto stream = static_cast<cudaStream_t>(context.stream);
    LMLOSS_CUDA_TRY(cudaStreamSynchronize(stream));
    int flag = 0;
    LMLOSS_CUDA_TRY(cudaMemcpy(&flag, state->error_flag, sizeof(int), cudaMemcpyDeviceToHost));
    if (flag == 0) return LMLOSS_SUCCESS;
    // Cleared before returning, so that the next call sees the flag clear on any stream.
    LMLOSS_CUDA_TRY(cudaMemsetAsync(state->error_flag, 0, sizeof(int), stream));
    LMLOSS_CUDA_TRY(cudaStreamSynchronize(stream));
    return core::fail(LMLOSS_ERROR_ID_OUT_OF_RANGE,
                      "targets: a label or teacher id was out of range on the device; those tokens' "
                      "loss is NaN and their gradient zero");
  }
};

}  // namespace
}  // namespace lmloss::cuda

namespace lmloss::core {
Backend* cuda_backend() {
  static cuda::CudaBackend backend;
  return &backend;
}
}  // namespace lmloss::core
