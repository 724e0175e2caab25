// Probe (not part of the library): a bf16 dW's sum over token chunks kept as its bf16 value (in
// dW's own bytes) and an 8-bit rest, in place of the f32 sum (see docs/performance.md, "a kept sum
// of bf16 and an 8-bit rest"). The dW product of each chunk, dW[V x H] += G^T X (G: K x V bf16
// rows, X: K x H bf16), with CUTLASS sm90 epilogues that read and write the pair:
//   first: S = alpha P, stored as (bf16(S), rest(S))               today: cuBLASLt f32, beta 0
//   add:   S = alpha P + beta (hi + rest unit(hi)), stored the same  today: cuBLASLt f32, beta 1
//   final: dW = bf16(alpha P + beta (hi + rest unit(hi)))           today: CUTLASS, f32 C -> bf16
// The rest is the integer r, |r| <= 127, with hi + r unit(hi) nearest S, unit(hi) = ulp(hi) / 254
// (ulp: hi's bf16 spacing 2^(e - 8) for hi = m 2^e, m in [0.5, 1), floored at 2^-100).
// Checks each against the f32 sum of the same products; times each against today's product.
//
// Build: the CMake target probe_dw_rest of a CUDA build for 90a. Run: build-cuda/tools/probe_dw_rest
// V H K rounds (llama3-8b's chunk: 128256 4096 2816 5).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <type_traits>
#include <vector>

#include "probe_common.cuh"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

// ---- the pair's arithmetic, the same on host and device ----

// ulp(hi) and 1 / ulp(hi) as floats: hi's exponent field E puts it in [2^(E-127), 2^(E-126)), so
// ulp = 2^(E - 134), floored at 2^-100 (zero and values that small have no rest to speak of).
CUTLASS_HOST_DEVICE int rest_exponent(float hi) {
  uint32_t bits;
  memcpy(&bits, &hi, 4);
  const int e = int((bits >> 23) & 0xff) - 7;
  return e < 27 ? 27 : e;
}
CUTLASS_HOST_DEVICE float from_bits(uint32_t bits) {
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
CUTLASS_HOST_DEVICE float rest_ulp(float hi) { return from_bits(uint32_t(rest_exponent(hi)) << 23); }
CUTLASS_HOST_DEVICE float rest_inverse_ulp(float hi) { return from_bits(uint32_t(254 - rest_exponent(hi)) << 23); }

// hi + rest unit(hi), one rounding (fma).
CUTLASS_HOST_DEVICE float joined(float hi, float rest) { return fmaf(rest, rest_ulp(hi) * (1.f / 254.f), hi); }

CUTLASS_HOST_DEVICE float bf16_nearest(float s) {
  return float(cutlass::NumericConverter<cutlass::bfloat16_t, float, cutlass::FloatRoundStyle::round_to_nearest>{}(s));
}

// The rest of s beside bf16(s), as an integral float in [-127, 127] (s - hi is exact in f32).
CUTLASS_HOST_DEVICE float rest_of(float s) {
  const float hi = bf16_nearest(s);
  const float r = rintf((s - hi) * rest_inverse_ulp(hi) * 254.f);
  return fminf(fmaxf(r, -127.f), 127.f);
}

// ---- epilogue nodes ----

// alpha P + beta joined(hi, rest)
template <class T>
struct KeptSumAdd {
  CUTLASS_HOST_DEVICE T operator()(T alpha, T acc, T beta, T hi, T rest) const {
    return fmaf(alpha, acc, beta * joined(hi, rest));
  }
};
template <class T, int N>
struct KeptSumAdd<cutlass::Array<T, N>> {
  using Values = cutlass::Array<T, N>;
  CUTLASS_HOST_DEVICE Values operator()(Values const& alpha, Values const& acc, Values const& beta, Values const& hi,
                                        Values const& rest) const {
    Values out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = KeptSumAdd<T>{}(alpha[i], acc[i], beta[i], hi[i], rest[i]);
    return out;
  }
};
template <class T>
struct RestOf {
  CUTLASS_HOST_DEVICE T operator()(T s) const { return rest_of(s); }
};
template <class T, int N>
struct RestOf<cutlass::Array<T, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& s) const {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = rest_of(s[i]);
    return out;
  }
};

namespace fusion = cutlass::epilogue::fusion;
namespace epi_detail = cutlass::epilogue::collective::detail;
constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

template <class Tile_, class Cluster_, class EpiTile_, class MainSchedule_, class Schedule_>
struct Config {
  using Element = cutlass::bfloat16_t;
  using Tile = Tile_;
  using Cluster = Cluster_;
  using EpiTile = EpiTile_;  // the epilogue's subtile (EpilogueTileAuto's pick but for CooperativeWide)
  using MainSchedule = MainSchedule_;
  using Schedule = Schedule_;
  using Layout = cutlass::layout::RowMajor;
  using StrideRest = Stride<int64_t, _1, int64_t>;
  using RestAtom = decltype(epi_detail::sm90_get_epilogue_smem_swizzle_layout_atom<StrideRest, int8_t, EpiTile>());
  using RestS2R = decltype(epi_detail::sm90_get_smem_load_op_for_source<StrideRest, int8_t, EpiTile>());
  using RestR2S = decltype(epi_detail::sm90_get_smem_store_op_for_accumulator<StrideRest, int8_t, EpiTile>());
  template <class ElementC>
  using Policy = decltype(epi_detail::sm90_get_tma_dispatch_policy<Tile, EpiTile, ElementC, Element, Schedule>());

  using Scalar = fusion::Sm90ScalarBroadcast<float>;
  using Acc = fusion::Sm90AccFetch;
  // S = alpha P + beta joined(C, rest)
  using Joined = fusion::Sm90EVT<fusion::Sm90Compute<KeptSumAdd, float, float, kRound>, Scalar, Acc, Scalar,
                                 fusion::Sm90SrcFetch<Element>,
                                 fusion::Sm90AuxLoad<Policy<Element>::StagesC, EpiTile, int8_t, StrideRest, RestAtom,
                                                     RestS2R>>;
  // S = alpha P
  using Scaled = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>, Scalar, Acc>;
  // rest(S) stored; S itself goes on to D, rounded to bf16 by the collective
  template <class ElementC>
  using RestOut = fusion::Sm90EVT<fusion::Sm90AuxStore<Policy<ElementC>::StagesD, EpiTile, int8_t, kRound, StrideRest,
                                                       RestAtom, RestR2S>,
                                  fusion::Sm90EVT<fusion::Sm90Compute<RestOf, float, float, kRound>, Acc>>;
  // The add with the bf16 value read as a second auxiliary tensor, not as C: a C as wide as D shares
  // D's shared memory, and each subtile's C then waits for the stores before it.
  using HiAtom = decltype(epi_detail::sm90_get_epilogue_smem_swizzle_layout_atom<StrideRest, Element, EpiTile>());
  using HiS2R = decltype(epi_detail::sm90_get_smem_load_op_for_source<StrideRest, Element, EpiTile>());
  using JoinedAux = fusion::Sm90EVT<
      fusion::Sm90Compute<KeptSumAdd, float, float, kRound>, Scalar, Acc, Scalar,
      fusion::Sm90AuxLoad<Policy<void>::StagesC, EpiTile, Element, StrideRest, HiAtom, HiS2R>,
      fusion::Sm90AuxLoad<Policy<void>::StagesC, EpiTile, int8_t, StrideRest, RestAtom, RestS2R>>;
  using AddAuxCallbacks = fusion::Sm90SplitTreeVisitor<JoinedAux, Acc, RestOut<void>>;
  using FirstCallbacks = fusion::Sm90SplitTreeVisitor<Scaled, Acc, RestOut<void>>;
  using AddCallbacks = fusion::Sm90SplitTreeVisitor<Joined, Acc, RestOut<Element>>;
  using FinalCallbacks = Joined;
};
using Cooperative = Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Shape<_128, _32>,
                           cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                           cutlass::epilogue::TmaWarpSpecializedCooperative>;
using CooperativeWide = Config<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Shape<_128, _64>,
                               cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                               cutlass::epilogue::TmaWarpSpecializedCooperative>;
using Pingpong = Config<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Shape<_64, _32>,
                        cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;

template <class C, class ElementC, class Callbacks>
struct RestGemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename C::Tile, typename C::Cluster, typename C::EpiTile,
      float, float, ElementC, typename C::Layout, 8, typename C::Element, typename C::Layout, 8, typename C::Schedule,
      Callbacks>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename C::Element, cutlass::layout::ColumnMajor, 8,
      typename C::Element, cutlass::layout::RowMajor, 8, float, typename C::Tile, typename C::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::SharedStorage))>,
      typename C::MainSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  Gemm gemm;
  void* ws = nullptr;
  typename Gemm::Arguments args;
  RestGemm(int V, int H, int K, const void* g, const void* x, typename Callbacks::Arguments thread, const void* c,
           void* d, int sms) {
    typename Kernel::StrideA sa = make_stride(Int<1>{}, int64_t(V), int64_t(0));
    typename Kernel::StrideB sb = make_stride(Int<1>{}, int64_t(H), int64_t(0));
    typename Kernel::StrideC sc = make_stride(int64_t(H), Int<1>{}, int64_t(0));
    typename Kernel::StrideD sd = make_stride(int64_t(H), Int<1>{}, int64_t(0));
    using ElementCArg = typename Epilogue::ElementC;
    args = typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {V, H, K, 1},
        {static_cast<const typename C::Element*>(g), sa, static_cast<const typename C::Element*>(x), sb},
        {thread, static_cast<const ElementCArg*>(c), sc, static_cast<typename C::Element*>(d), sd}};
    args.hw_info.sm_count = sms;
    cutlass_initialize(gemm, args, &ws);
  }
  void run(cudaStream_t s) { cutlass_run(gemm, s); }
};

int main(int argc, char** argv) {
  const int V = argc > 1 ? atoi(argv[1]) : 128256, H = argc > 2 ? atoi(argv[2]) : 4096;
  const int K = argc > 3 ? atoi(argv[3]) : 2816;
  const int reps = argc > 4 ? atoi(argv[4]) : 5;
  if (H % 16) { printf("H must be a multiple of 16 (the rest's rows in whole 16 bytes)\n"); return 1; }
  int sms = 0; CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t vh = size_t(V) * H;
  // Three chunks' X (the same G: the sums differ as much as with three).
  __nv_bfloat16 *g, *x[3], *hi, *dw_rest, *dw_f32;
  int8_t* rest;
  float *sum, *alpha, *beta_one, *beta_up;
  CUDA_OK(cudaMalloc(&g, size_t(K) * V * 2));
  for (int i = 0; i < 3; ++i) CUDA_OK(cudaMalloc(&x[i], size_t(K) * H * 2));
  CUDA_OK(cudaMalloc(&sum, vh * 4)); CUDA_OK(cudaMalloc(&hi, vh * 2)); CUDA_OK(cudaMalloc(&rest, vh));
  CUDA_OK(cudaMalloc(&dw_rest, vh * 2)); CUDA_OK(cudaMalloc(&dw_f32, vh * 2));
  CUDA_OK(cudaMalloc(&alpha, 4)); CUDA_OK(cudaMalloc(&beta_one, 4)); CUDA_OK(cudaMalloc(&beta_up, 4));
  fill_bf16<<<1024, 256>>>(g, size_t(K) * V, 1, 2e-3f);
  for (int i = 0; i < 3; ++i) fill_bf16<<<1024, 256>>>(x[i], size_t(K) * H, 2 + i, 4.f);
  const float one = 1.f, upstream = 0.37f;
  CUDA_OK(cudaMemcpy(alpha, &one, 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(beta_one, &one, 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(beta_up, &upstream, 4, cudaMemcpyHostToDevice));
  cudaStream_t s; CUDA_OK(cudaStreamCreate(&s));
  cublasLtHandle_t lt; LT_OK(cublasLtCreate(&lt));
  LtProduct lt32(lt, V, H, K, CUDA_R_32F);

  std::vector<float> sum_h(vh);
  std::vector<__nv_bfloat16> hi_h(vh), a(vh), b(vh);
  std::vector<int8_t> rest_h(vh);
  // Today's: the f32 sum of two chunks, then the third stored over it, both scaled by 0.37.
  lt32.run(x[0], g, sum, 0.f, s);
  lt32.run(x[1], g, sum, 1.f, s);
  CUDA_OK(cudaMemcpyAsync(sum_h.data(), sum, vh * 4, cudaMemcpyDeviceToHost, s));
  // The library's store of a deferred product: the upstream gradient scales the product and the sum.
  DwStore<Cooperative::Tile, Cooperative::Cluster, Cooperative::MainSchedule, Cooperative::Schedule> f32_store(
      V, H, K, g, x[2], sum, dw_f32, beta_up, true, sms, 0, -1, true);
  f32_store.run(s);
  CUDA_OK(cudaMemcpyAsync(a.data(), dw_f32, vh * 2, cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaStreamSynchronize(s));

  // The pair's kernels in one schedule: first, add and final over the same three chunks. After
  // two, the pair should hold the f32 sum to ~2^-17 (relative, over all of dW; bf16 alone: ~1e-3);
  // near zero, where the chunks cancel, its error is that of the larger terms, not of the value.
  auto pair_kernels = [&](auto config, const char* name, std::vector<std::function<void()>>& runs) {
    using C = decltype(config);
    const typename C::StrideRest rest_stride = make_stride(int64_t(H), Int<1>{}, int64_t(0));
    auto scalar = [](const float* p) { return typename C::Scalar::Arguments{{1.f}, {p}, {}}; };
    // Callbacks' arguments: a tree's children then its node; the split tree's input, aux trees, output.
    auto joined_args = [&](const float* a, const float* b, const int8_t* rest_in) {
      return typename C::Joined::Arguments{scalar(a), {}, scalar(b), {}, {rest_in, int8_t(0), rest_stride}, {}};
    };
    // Where the rest's pointer is null, its load (the rest taken as 0) or its store is skipped.
    auto rest_out_c = [&](int8_t* rest_to) {
      return typename C::template RestOut<typename C::Element>::Arguments{{{}, {}}, {rest_to, rest_stride}};
    };
    auto rest_out = [&](int8_t* rest_to) {
      return typename C::template RestOut<void>::Arguments{{{}, {}}, {rest_to, rest_stride}};
    };
    const typename C::FirstCallbacks::Arguments first_args{{scalar(alpha), {}, {}}, rest_out(rest), {}};
    auto* first = new RestGemm<C, void, typename C::FirstCallbacks>(V, H, K, g, x[0], first_args, nullptr, hi, sms);
    using Add = RestGemm<C, typename C::Element, typename C::AddCallbacks>;
    auto add_with = [&](const int8_t* rest_in, int8_t* rest_to) {
      return new Add(V, H, K, g, x[1], typename C::AddCallbacks::Arguments{joined_args(alpha, beta_one, rest_in),
                                                                           rest_out_c(rest_to), {}}, hi, hi, sms);
    };
    Add* add = add_with(rest, rest);
    auto* last = new RestGemm<C, typename C::Element, typename C::FinalCallbacks>(
        V, H, K, g, x[2], joined_args(beta_up, beta_up, rest), hi, dw_rest, sms);
    first->run(s);
    add->run(s);
    CUDA_OK(cudaMemcpyAsync(hi_h.data(), hi, vh * 2, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaMemcpyAsync(rest_h.data(), rest, vh, cudaMemcpyDeviceToHost, s));
    last->run(s);
    CUDA_OK(cudaMemcpyAsync(b.data(), dw_rest, vh * 2, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaStreamSynchronize(s));
    double kept_err = 0, hi_err = 0, norm = 0, worst = 0, final_err = 0, final_norm = 0;
    size_t differ = 0;
    for (size_t i = 0; i < vh; ++i) {
      const double h = bf(hi_h[i]), kept = joined(float(h), float(rest_h[i])), ref = sum_h[i];
      kept_err += (kept - ref) * (kept - ref);
      hi_err += (h - ref) * (h - ref);
      norm += ref * ref;
      worst = std::max(worst, std::abs(kept - ref));
      const double u = bf(a[i]), w = bf(b[i]);
      differ += u != w;
      final_err += (u - w) * (u - w);
      final_norm += u * u;
    }
    printf("check %s: after two chunks the pair is off the f32 sum by %.2e relative (bf16 alone %.2e), at "
           "worst by %.2e of the rms; the final dW (scale 0.37) differs from the f32 sum's store at %zu of %zu "
           "(%.2e), by %.2e relative\n",
           name, std::sqrt(kept_err / norm), std::sqrt(hi_err / norm), worst / std::sqrt(norm / vh), differ, vh,
           double(differ) / vh, std::sqrt(final_err / final_norm));
    // Diagnostics: the add without reading the rest, without writing it, and with neither.
    Add *add_no_load = add_with(nullptr, rest), *add_no_store = add_with(rest, nullptr);
    Add* add_neither = add_with(nullptr, nullptr);
    runs = {[=] { first->run(s); },        [=] { add->run(s); },          [=] { last->run(s); },
            [=] { add_no_load->run(s); }, [=] { add_no_store->run(s); }, [=] { add_neither->run(s); }};
    if constexpr (std::is_same_v<C, Cooperative>) {
      using Element = typename C::Element;
      const auto* hi_in = reinterpret_cast<const Element*>(hi);
      const typename C::AddAuxCallbacks::Arguments aux_args{
          {scalar(alpha), {}, scalar(beta_one), {hi_in, Element(0), rest_stride}, {rest, int8_t(0), rest_stride}, {}},
          rest_out(rest),
          {}};
      auto* add_aux = new RestGemm<C, void, typename C::AddAuxCallbacks>(V, H, K, g, x[1], aux_args, nullptr, hi, sms);
      // Checked against the add: both from the pair after `first`.
      std::vector<__nv_bfloat16> hi_a(vh), hi_b(vh);
      std::vector<int8_t> rest_a(vh), rest_b(vh);
      for (int form = 0; form < 2; ++form) {
        first->run(s);
        if (form == 0) add->run(s); else add_aux->run(s);
        CUDA_OK(cudaMemcpyAsync((form ? hi_b : hi_a).data(), hi, vh * 2, cudaMemcpyDeviceToHost, s));
        CUDA_OK(cudaMemcpyAsync((form ? rest_b : rest_a).data(), rest, vh, cudaMemcpyDeviceToHost, s));
        CUDA_OK(cudaStreamSynchronize(s));
      }
      size_t differ = 0;
      for (size_t i = 0; i < vh; ++i) differ += bf(hi_a[i]) != bf(hi_b[i]) || rest_a[i] != rest_b[i];
      printf("check %s: the add reading the value as an auxiliary tensor differs from the add at %zu of %zu\n",
             name, differ, vh);
      runs.push_back([=] { add_aux->run(s); });
    }
  };
  std::vector<std::function<void()>> coop, wide, ping;
  pair_kernels(Cooperative{}, "cooperative 128x256", coop);
  pair_kernels(CooperativeWide{}, "cooperative, epilogue 128x64", wide);
  pair_kernels(Pingpong{}, "ping-pong 128x128", ping);

  std::vector<Variant> vs;
  vs.push_back({"today first: lt f32, beta 0", [&] { lt32.run(x[0], g, sum, 0.f, s); }});
  vs.push_back({"pair first, coop: bf16 + rest out", coop[0]});
  vs.push_back({"pair first, coop epi 128x64", wide[0]});
  vs.push_back({"pair first, ping", ping[0]});
  vs.push_back({"today add: lt f32, beta 1", [&] { lt32.run(x[1], g, sum, 1.f, s); }});
  vs.push_back({"pair add, coop: bf16 + rest in, out", coop[1]});
  vs.push_back({"pair add, coop epi 128x64", wide[1]});
  vs.push_back({"pair add, ping", ping[1]});
  vs.push_back({"pair add, coop, value as aux", coop[6]});
  vs.push_back({"  coop add, rest not read", coop[3]});
  vs.push_back({"  coop add, rest not written", coop[4]});
  vs.push_back({"  coop add, neither (bf16 C only)", coop[5]});
  vs.push_back({"  ping add, neither (bf16 C only)", ping[5]});
  vs.push_back({"today final: cutlass f32 C", [&] { f32_store.run(s); }});
  vs.push_back({"pair final, coop: bf16 + rest C", coop[2]});
  vs.push_back({"pair final, coop epi 128x64", wide[2]});
  vs.push_back({"pair final, ping", ping[2]});
  char header[96];
  snprintf(header, sizeof header, "V %d H %d K %d, %d SMs", V, H, K, sms);
  time_variants(vs, reps, s, 2.0 * V * H * K, header);
  return 0;
}
