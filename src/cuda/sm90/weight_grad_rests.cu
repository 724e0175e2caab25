// A chunk's dW product into a kept sum of bf16 values and 8-bit rests, in one kernel (see
// ../weight_grad_store.cuh), built with CUTLASS for sm_90a: its cooperative 128 x 256 kernel in
// 2 x 1 clusters, whose epilogue visitor tree computes s = alpha P (+ beta join(C, rest) when
// adding or storing), stores rest(s) as an auxiliary tensor (not when storing) and s to D,
// rounded to bf16; C and D are the values themselves and the rests are loaded and stored in
// place, each tile reading and writing only its own elements. Measured on an H100
// (bench/probe_dw_rest.cu, run 75, llama3-8b's chunk K 2816): the first chunk's 4.62 ms against
// cuBLASLt's f32 product 4.45, an added chunk's 5.42 against 4.78 with beta 1, the store 5.11
// against 4.97 for the store over an f32 sum.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "core/context.hpp"
#include "core/weight_sum_rest.hpp"
#include "cuda/common.cuh"
#include "cuda/row_stats_product.cuh"
#include "cuda/weight_grad_store.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace lmloss::cuda {
namespace {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;
namespace epi_detail = cutlass::epilogue::collective::detail;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// alpha P + beta join(hi, rest), elementwise (the rest arrives as a float of its int8).
template <class T>
struct JoinedSum {
  CUTLASS_HOST_DEVICE T operator()(T alpha, T acc, T beta, T hi, T rest) const {
    return fmaf(alpha, acc, beta * core::rest_join(hi, int8_t(rest)));
  }
};
template <class T, int N>
struct JoinedSum<cutlass::Array<T, N>> {
  using Values = cutlass::Array<T, N>;
  CUTLASS_HOST_DEVICE Values operator()(Values const& alpha, Values const& acc, Values const& beta, Values const& hi,
                                        Values const& rest) const {
    Values out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = JoinedSum<T>{}(alpha[i], acc[i], beta[i], hi[i], rest[i]);
    return out;
  }
};

// rest(s) beside bf16(s), as a float the auxiliary store converts to int8 exactly.
template <class T>
struct RestOf {
  CUTLASS_HOST_DEVICE T operator()(T s) const { return T(core::rest_split(s).rest); }
};
template <class T, int N>
struct RestOf<cutlass::Array<T, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& s) const {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = T(core::rest_split(s[i]).rest);
    return out;
  }
};

// D (vocab rows, hidden) = the pair's values: A(v, k) = G[k * grad_ld + v], B(k, h) = X[k * x_ld
// + h], C and D bf16 row-major, the rests int8 row-major.
struct RestGemm {
  using Element = cutlass::bfloat16_t;
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using EpiTile = Shape<_128, _32>;
  using Layout = cutlass::layout::RowMajor;
  using Schedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using StrideRest = Stride<int64_t, _1, int64_t>;
  using RestAtom = decltype(epi_detail::sm90_get_epilogue_smem_swizzle_layout_atom<StrideRest, int8_t, EpiTile>());
  using RestS2R = decltype(epi_detail::sm90_get_smem_load_op_for_source<StrideRest, int8_t, EpiTile>());
  using RestR2S = decltype(epi_detail::sm90_get_smem_store_op_for_accumulator<StrideRest, int8_t, EpiTile>());
  template <class ElementC>
  using Policy = decltype(epi_detail::sm90_get_tma_dispatch_policy<Tile, EpiTile, ElementC, Element, Schedule>());

  using Scalar = fusion::Sm90ScalarBroadcast<float>;
  using Acc = fusion::Sm90AccFetch;
  // s = alpha P + beta join(C, rest)
  using Joined = fusion::Sm90EVT<fusion::Sm90Compute<JoinedSum, float, float, kRound>, Scalar, Acc, Scalar,
                                 fusion::Sm90SrcFetch<Element>,
                                 fusion::Sm90AuxLoad<Policy<Element>::StagesC, EpiTile, int8_t, StrideRest, RestAtom,
                                                     RestS2R>>;
  // s = alpha P
  using Scaled = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, Scalar, Acc>;
  // rest(s) stored; s goes on to D, rounded to bf16 by the collective
  template <class ElementC>
  using RestOut = fusion::Sm90EVT<fusion::Sm90AuxStore<Policy<ElementC>::StagesD, EpiTile, int8_t, kRound, StrideRest,
                                                       RestAtom, RestR2S>,
                                  fusion::Sm90EVT<fusion::Sm90Compute<RestOf, float, float, kRound>, Acc>>;
  using FirstCallbacks = fusion::Sm90SplitTreeVisitor<Scaled, Acc, RestOut<void>>;
  using AddCallbacks = fusion::Sm90SplitTreeVisitor<Joined, Acc, RestOut<Element>>;

  template <class ElementC, class Callbacks>
  struct Kernel {
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, EpiTile, float, float, ElementC, Layout, 8,
        Element, Layout, 8, Schedule, Callbacks>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::ColumnMajor, 8, Element,
        cutlass::layout::RowMajor, 8, float, Tile, Cluster,
        cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::SharedStorage))>,
        cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
    using Universal = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
    using Device = cutlass::gemm::device::GemmUniversalAdapter<Universal>;
  };
  using First = Kernel<void, FirstCallbacks>;
  using Add = Kernel<Element, AddCallbacks>;
  using Store = Kernel<Element, Joined>;

  template <class K, class Thread>
  static typename K::Device::Arguments arguments(const RestProductArgs& a, const Thread& thread) {
    using ElementCArg = typename K::Epilogue::ElementC;
    typename K::Device::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {int(a.vocab), int(a.hidden), int(a.tokens), 1},
        {static_cast<const Element*>(a.grad), {Int<1>{}, a.grad_ld, int64_t(0)}, static_cast<const Element*>(a.x),
         {Int<1>{}, a.x_ld, int64_t(0)}},
        {thread, static_cast<const ElementCArg*>(a.kind != RestProduct::first ? a.values : nullptr),
         {a.values_ld, Int<1>{}, int64_t(0)},
         static_cast<Element*>(a.values), {a.values_ld, Int<1>{}, int64_t(0)}}};
    args.hw_info.device_id = a.device;
    return args;
  }

  static auto scalar(const float* p) { return typename Scalar::Arguments{{1.f}, {p}, {}}; }
  static StrideRest rest_stride(const RestProductArgs& a) { return make_stride(a.rests_ld, Int<1>{}, int64_t(0)); }

  static typename First::Device::Arguments first(const RestProductArgs& a) {
    const typename FirstCallbacks::Arguments thread{
        {scalar(a.alpha), {}, {}}, {{{}, {}}, {a.rests, rest_stride(a)}}, {}};
    return arguments<First>(a, thread);
  }
  // alpha P + beta join(C, rest), beta 1 unless given
  static typename Joined::Arguments joined(const RestProductArgs& a) {
    return {scalar(a.alpha), {}, scalar(a.beta), {}, {a.rests, int8_t(0), rest_stride(a)}, {}};
  }
  static typename Add::Device::Arguments add(const RestProductArgs& a) {
    const typename AddCallbacks::Arguments thread{joined(a), {{{}, {}}, {a.rests, rest_stride(a)}}, {}};
    return arguments<Add>(a, thread);
  }
  static typename Store::Device::Arguments store(const RestProductArgs& a) { return arguments<Store>(a, joined(a)); }
};

template <class K, class Args>
lmloss_status run_kernel(const Args& args, void* workspace, cudaStream_t stream) {
  typename K::Device gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st == cutlass::Status::kSuccess) st = gemm.initialize(args, workspace, stream);
  if (st == cutlass::Status::kSuccess) st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess)
    return core::fail(LMLOSS_ERROR_BACKEND, std::string("dW product into rests: ") + cutlass::cutlassGetStatusString(st));
  return LMLOSS_SUCCESS;
}

}  // namespace

bool rest_product_supported(const RestProductArgs& a) {
  // TMA moves 16-byte-aligned rows: the rests' row stride a multiple of 16 bytes, the others' of 8
  // bf16 values (and the width, as each row is read in whole 16 bytes).
  if (a.hidden % 16 || a.rests_ld % 16 || a.values_ld % 8 || a.grad_ld % 8 || a.x_ld % 8 || a.vocab % 8) return false;
  if (!aligned16(a.grad) || !aligned16(a.x) || !aligned16(a.values) || !aligned16(a.rests)) return false;
  if (a.tokens <= 0 || std::max({a.vocab, a.hidden, a.tokens}) > INT32_MAX) return false;
  return sm90_kernels_run(a.device);
}

size_t rest_product_workspace(const RestProductArgs& a) {
  if (!rest_product_supported(a)) return 0;
  return align256(std::max({RestGemm::First::Device::get_workspace_size(RestGemm::first(a)),
                            RestGemm::Add::Device::get_workspace_size(RestGemm::add(a)),
                            RestGemm::Store::Device::get_workspace_size(RestGemm::store(a))}));
}

lmloss_status run_rest_product(const RestProductArgs& a, void* workspace, cudaStream_t stream) {
  switch (a.kind) {
    case RestProduct::first: return run_kernel<RestGemm::First>(RestGemm::first(a), workspace, stream);
    case RestProduct::add: return run_kernel<RestGemm::Add>(RestGemm::add(a), workspace, stream);
    case RestProduct::store: return run_kernel<RestGemm::Store>(RestGemm::store(a), workspace, stream);
  }
  return core::fail(LMLOSS_ERROR_INTERNAL, "dW product into rests: no such kind");
}

}  // namespace lmloss::cuda
