// The last token chunk's dW product stored into a 16-bit dW over its f32 sum, in place (see
// ../weight_grad_store.cuh), built with CUTLASS for sm_90a: its cooperative 128 x 256 kernel in
// 2 x 1 clusters, which reads C in f32 and stores D in bf16. Measured on an H100 against the
// cuBLASLt product into the f32 sum and the rounding pass (bench/probe_dw_store.cu): 4.87 against
// 5.57 ms at llama3-8b's last chunk (K 2816), 3.84 against 4.75 at gemma2-2b's (K 1792), bitwise
// the same at scale 1. Its six launches cost ~0.2-0.5 ms over one; four or three, with more
// scratch, were within that spread.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "core/context.hpp"
#include "cuda/common.cuh"
#include "cuda/row_stats_product.cuh"
#include "cuda/weight_grad_store.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace lmloss::cuda {
namespace {

using namespace cute;

// D (vocab rows, hidden) = alpha * A B + C: A(v, k) = G[k * grad_ld + v], B(k, h) =
// X[k * x_ld + h], C f32 and D bf16 row-major.
struct StoreGemm {
  using Element = cutlass::bfloat16_t;
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Layout = cutlass::layout::RowMajor;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, float, Layout, 4, Element, Layout, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, 8, Element,
      cutlass::layout::RowMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // dW rows [first, first + count) from C's rows at c (row stride c_ld) into D's at d.
  static typename Device::Arguments arguments(const WeightGradStoreArgs& a, int64_t first, int64_t count,
                                              const float* c, int64_t c_ld, void* d) {
    typename Device::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {int(count), int(a.hidden), int(a.tokens), 1},
        {static_cast<const Element*>(a.grad) + first, {Int<1>{}, a.grad_ld, int64_t(0)},
         static_cast<const Element*>(a.x), {Int<1>{}, a.x_ld, int64_t(0)}},
        {{}, c, {c_ld, Int<1>{}, int64_t(0)}, static_cast<Element*>(d), {a.hidden, Int<1>{}, int64_t(0)}}};
    args.epilogue.thread.alpha_ptr = a.alpha;
    args.epilogue.thread.beta = 1.f;
    args.epilogue.thread.beta_ptr = a.beta;  // read in place of beta when set
    args.hw_info.device_id = a.device;
    return args;
  }
};

// Rows [0, R) go to scratch first: R = split / 16 (a multiple of 8) leaves four doubling launches
// up to split; a split under 256 rows goes to scratch whole.
int64_t first_rows(int64_t split) { return split >= 256 ? split / 16 / 8 * 8 : split; }

}  // namespace

bool weight_grad_store_supported(const WeightGradStoreArgs& a) {
  // TMA moves 16-byte-aligned rows, and CUTLASS takes each launch's rows (G's contiguous extent)
  // in whole 16 bytes: the split, R and the tail's rows multiples of 8.
  if (a.hidden % 8 || a.grad_ld % 8 || a.x_ld % 8 || a.tail_ld % 4 || a.split % 8 || (a.vocab - a.split) % 8)
    return false;
  if (!aligned16(a.grad) || !aligned16(a.x) || !aligned16(a.rows) || (a.split < a.vocab && !aligned16(a.tail)))
    return false;
  if (a.tokens <= 0 || std::max({a.vocab, a.hidden, a.tokens}) > INT32_MAX) return false;
  return sm90_kernels_run(a.device);
}

size_t weight_grad_store_workspace(const WeightGradStoreArgs& a) {
  const size_t scratch = align256(size_t(first_rows(a.split)) * size_t(a.hidden) * sizeof(cutlass::bfloat16_t));
  return scratch + align256(StoreGemm::Device::get_workspace_size(
                        StoreGemm::arguments(a, 0, a.vocab, a.tail, a.tail_ld, a.rows)));
}

lmloss_status run_weight_grad_store(const WeightGradStoreArgs& a, void* workspace, cudaStream_t stream) {
  const int64_t first = first_rows(a.split);
  char* scratch = static_cast<char*>(workspace);
  void* gemm_ws = scratch + align256(size_t(first) * size_t(a.hidden) * sizeof(cutlass::bfloat16_t));
  auto* sum = static_cast<float*>(a.rows);
  auto* rows16 = static_cast<cutlass::bfloat16_t*>(a.rows);
  auto launch = [&](int64_t begin, int64_t count, const float* c, int64_t c_ld, void* d) -> lmloss_status {
    const auto args = StoreGemm::arguments(a, begin, count, c, c_ld, d);
    StoreGemm::Device gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st == cutlass::Status::kSuccess) st = gemm.initialize(args, gemm_ws, stream);
    if (st == cutlass::Status::kSuccess) st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess)
      return core::fail(LMLOSS_ERROR_BACKEND, std::string("dW store: ") + cutlass::cutlassGetStatusString(st));
    return LMLOSS_SUCCESS;
  };
  if (first > 0) LMLOSS_CHECK(launch(0, first, sum, a.hidden, scratch));
  for (int64_t begin = first; begin < a.split;) {
    const int64_t end = std::min(2 * begin, a.split);
    LMLOSS_CHECK(launch(begin, end - begin, sum + begin * a.hidden, a.hidden, rows16 + begin * a.hidden));
    begin = end;
  }
  if (a.split < a.vocab)
    LMLOSS_CHECK(launch(a.split, a.vocab - a.split, a.tail, a.tail_ld, rows16 + a.split * a.hidden));
  if (first > 0)
    LMLOSS_CUDA_TRY(cudaMemcpyAsync(a.rows, scratch, size_t(first) * size_t(a.hidden) * sizeof(cutlass::bfloat16_t),
                                    cudaMemcpyDeviceToDevice, stream));
  return LMLOSS_SUCCESS;
}

}  // namespace lmloss::cuda
