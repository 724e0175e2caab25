// Probe (not part of the library): the last token chunk's dW product, dW[V x H] = C + G^T X (G: K x V
// bf16 rows, X: K x H bf16), with the f32 sum C of the earlier chunks. (a) as the library runs it:
// cuBLASLt adds into C in f32, then a pass rounds C * scale into the bf16 dW; (b) a CUTLASS sm90
// product that reads C in f32 and stores bf16 (alpha from the device), in three tile shapes. Also
// cuBLASLt and CUTLASS with beta 0 (their main loops alone), and (b)'s results against (a)'s. (c) the
// 128 x 256 kernel of (b) storing the whole bf16 dW in place over the kept sum, in launches over
// doubling row ranges (see main).
//
// Build: the CMake target probe_dw_store of a CUDA build for 90a (cmake --build build-cuda --target
// probe_dw_store). Run: build-cuda/tools/probe_dw_store V H K rounds (llama3-8b's last chunk:
// 128256 4096 2816 5).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_common.cuh"

__global__ void fill_f32(float* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2246822519u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = (float(h & 0xffffff) / 16777216.f - 0.5f) * scale;
  }
}
// Today's rounding pass: out = bf16(sum * scale), four a thread.
__global__ void round_scaled(const float4* sum, const float* scale, __nv_bfloat162* out, size_t n4) {
  const float s = *scale;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n4; i += size_t(gridDim.x) * blockDim.x) {
    const float4 v = sum[i];
    out[2 * i] = __floats2bfloat162_rn(v.x * s, v.y * s);
    out[2 * i + 1] = __floats2bfloat162_rn(v.z * s, v.w * s);
  }
}

int main(int argc, char** argv) {
  const int V = argc > 1 ? atoi(argv[1]) : 128256, H = argc > 2 ? atoi(argv[2]) : 4096;
  const int K = argc > 3 ? atoi(argv[3]) : 2816;
  const int reps = argc > 4 ? atoi(argv[4]) : 5;
  int sms = 0; CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t vh = size_t(V) * H;
  __nv_bfloat16 *g, *x, *d_ref, *d_new, *d16; float *c0, *c, *scale;
  CUDA_OK(cudaMalloc(&g, size_t(K) * V * 2)); CUDA_OK(cudaMalloc(&x, size_t(K) * H * 2));
  CUDA_OK(cudaMalloc(&c0, vh * 4)); CUDA_OK(cudaMalloc(&c, vh * 4));
  CUDA_OK(cudaMalloc(&d_ref, vh * 2)); CUDA_OK(cudaMalloc(&d_new, vh * 2)); CUDA_OK(cudaMalloc(&d16, vh * 2));
  CUDA_OK(cudaMalloc(&scale, 4));
  fill_bf16<<<1024, 256>>>(g, size_t(K) * V, 1, 2e-3f);
  fill_bf16<<<1024, 256>>>(x, size_t(K) * H, 2, 4.f);
  fill_f32<<<1024, 256>>>(c0, vh, 3, 0.5f);
  fill_bf16<<<1024, 256>>>(d16, vh, 4, 0.5f);
  const float one = 1.f; CUDA_OK(cudaMemcpy(scale, &one, 4, cudaMemcpyHostToDevice));
  cudaStream_t s; CUDA_OK(cudaStreamCreate(&s));
  cublasLtHandle_t lt; LT_OK(cublasLtCreate(&lt));
  LtProduct lt32(lt, V, H, K, CUDA_R_32F), lt16(lt, V, H, K, CUDA_R_16BF);
  using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using PingEpi = cutlass::epilogue::TmaWarpSpecialized;
  using K1 = DwStore<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, CoopEpi>;
  using K2 = DwStore<Shape<_256, _128, _64>, Shape<_1, _2, _1>, Coop, CoopEpi>;
  using K3 = DwStore<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Ping, PingEpi>;
  K1 k1(V, H, K, g, x, c0, d_new, scale, true, sms), k1z(V, H, K, g, x, c0, d_new, scale, false, sms);
  K2 k2(V, H, K, g, x, c0, d_new, scale, true, sms), k2z(V, H, K, g, x, c0, d_new, scale, false, sms);
  K3 k3(V, H, K, g, x, c0, d_new, scale, true, sms), k3z(V, H, K, g, x, c0, d_new, scale, false, sms);
  const size_t n4 = vh / 4;
  auto round_pass = [&] { round_scaled<<<sms * 8, 256, 0, s>>>((const float4*)c, scale, (__nv_bfloat162*)d_ref, n4); };

  // Correctness: (a) from c0 against each CUTLASS kernel from c0.
  CUDA_OK(cudaMemcpyAsync(c, c0, vh * 4, cudaMemcpyDeviceToDevice, s));
  lt32.run(x, g, c, 1.f, s); round_pass();
  std::vector<__nv_bfloat16> ref(vh), got(vh);
  CUDA_OK(cudaMemcpyAsync(ref.data(), d_ref, vh * 2, cudaMemcpyDeviceToHost, s)); CUDA_OK(cudaStreamSynchronize(s));
  auto compare = [&](const char* name, const void* result) {
    CUDA_OK(cudaMemcpy(got.data(), result, vh * 2, cudaMemcpyDeviceToHost));
    // The two sum in different orders, so a few differ by an ulp of their f32 terms; a wrong layout
    // or a dropped C moves nearly all by far more (G^T X is ~10% of C here). Where the terms
    // cancel, an ulp of theirs is large against the value itself, so the worst difference is
    // given against the largest value of dW, not element by element.
    size_t differ = 0;
    double worst = 0, largest = 0;
    for (size_t i = 0; i < vh; ++i) {
      const double a = bf(ref[i]), b = bf(got[i]);
      largest = std::max(largest, std::abs(a));
      if (a == b) continue;
      ++differ;
      worst = std::max(worst, std::abs(a - b));
    }
    printf("check %-28s differ %zu of %zu (%.2e), worst by %.2e of the largest\n", name, differ, vh,
           double(differ) / vh, worst / std::max(largest, 1e-30));
  };
  k1.run(s); CUDA_OK(cudaStreamSynchronize(s)); compare("cutlass 128x256 coop 2x1", d_new);
  k2.run(s); CUDA_OK(cudaStreamSynchronize(s)); compare("cutlass 256x128 coop 1x2", d_new);
  k3.run(s); CUDA_OK(cudaStreamSynchronize(s)); compare("cutlass 128x128 pingpong 2x1", d_new);

  // (c) b1's kernel storing the whole bf16 dW in place over the kept sum as lmloss holds it: f32
  // rows [0, V/2) over the gradient's own bytes (row r at byte 4 r H), the rest right after them.
  // bf16 row r lands on f32 row r / 2, so the rows go in launches over doubling ranges [R, 2R),
  // [2R, 4R), ..., [V/2, V): each stores over f32 rows that the launches before it have read, and
  // reads none that it stores over. Rows [0, R), whose bytes hold their own f32 rows, go to a
  // buffer first and are copied in last. The scale multiplies C too, as it would in a product
  // deferred to backward.
  // R = V / 2 / 2^levels, in 2 + levels launches (4, 2 and 1 levels timed).
  const int split = V / 2;
  const bool in_place = V % 16 == 0 && split >= 256;
  float* kept = nullptr;
  __nv_bfloat16* first_out = nullptr;
  struct InPlace {
    int first_rows;
    std::vector<std::unique_ptr<K1>> ranges;
    std::function<void()> run;
  };
  InPlace in_place_by_levels[3];
  if (in_place) {
    CUDA_OK(cudaMalloc(&kept, vh * 4));
    CUDA_OK(cudaMalloc(&first_out, size_t(split / 2) * H * 2));
    __nv_bfloat16* kept16 = reinterpret_cast<__nv_bfloat16*>(kept);
    const int levels[3] = {4, 2, 1};
    for (int l = 0; l < 3; ++l) {
      InPlace& ip = in_place_by_levels[l];
      ip.first_rows = (split >> levels[l]) / 8 * 8;
      ip.ranges.push_back(
          std::make_unique<K1>(V, H, K, g, x, kept, first_out, scale, true, sms, 0, ip.first_rows, true));
      printf("in place: rows [0, %d) to a buffer", ip.first_rows);
      for (int a = ip.first_rows; a < V;) {
        const int b = a < split ? std::min(2 * a, split) : V;
        ip.ranges.push_back(std::make_unique<K1>(V, H, K, g, x, kept + size_t(a) * H, kept16 + size_t(a) * H,
                                                 scale, true, sms, a, b - a, true));
        printf(", [%d, %d)", a, b);
        a = b;
      }
      printf("\n");
      ip.run = [&ip, &s, kept, first_out, H] {
        for (auto& k : ip.ranges) k->run(s);
        CUDA_OK(cudaMemcpyAsync(kept, first_out, size_t(ip.first_rows) * H * 2, cudaMemcpyDeviceToDevice, s));
      };
      CUDA_OK(cudaMemcpyAsync(kept, c0, vh * 4, cudaMemcpyDeviceToDevice, s));
      ip.run();
      CUDA_OK(cudaStreamSynchronize(s));
      const char* names[3] = {"c4: in place, 6 launches", "c2: in place, 4 launches", "c1: in place, 3 launches"};
      compare(names[l], kept);
    }
    // A scale not 1, as an upstream gradient would be: (a) rounds (sum + product) * scale, (c)
    // scale * product + scale * sum, so a few values may differ by an ulp; a scale missing from C
    // would move half of C's weight in every value.
    const float upstream = 0.37f;
    CUDA_OK(cudaMemcpy(scale, &upstream, 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpyAsync(c, c0, vh * 4, cudaMemcpyDeviceToDevice, s));
    lt32.run(x, g, c, 1.f, s); round_pass();
    CUDA_OK(cudaMemcpyAsync(ref.data(), d_ref, vh * 2, cudaMemcpyDeviceToHost, s));
    CUDA_OK(cudaMemcpyAsync(kept, c0, vh * 4, cudaMemcpyDeviceToDevice, s));
    in_place_by_levels[0].run();
    CUDA_OK(cudaStreamSynchronize(s));
    compare("c4 at scale 0.37", kept);
    CUDA_OK(cudaMemcpy(scale, &one, 4, cudaMemcpyHostToDevice));
  }

  std::vector<Variant> vs;
  vs.push_back({"a: lt f32 C+=, round pass", [&] { lt32.run(x, g, c, 1.f, s); round_pass(); }});
  vs.push_back({"   lt f32 C+= alone", [&] { lt32.run(x, g, c, 1.f, s); }});
  vs.push_back({"   round pass alone", [&] { round_pass(); }});
  vs.push_back({"b1: cutlass 128x256 coop C f32", [&] { k1.run(s); }});
  vs.push_back({"b2: cutlass 256x128 coop C f32", [&] { k2.run(s); }});
  vs.push_back({"b3: cutlass 128x128 ping C f32", [&] { k3.run(s); }});
  vs.push_back({"lt bf16 out, beta 0", [&] { lt16.run(x, g, d16, 0.f, s); }});
  vs.push_back({"lt bf16 C+= (per-chunk round)", [&] { lt16.run(x, g, d16, 1.f, s); }});
  vs.push_back({"cutlass 128x256 coop beta 0", [&] { k1z.run(s); }});
  vs.push_back({"cutlass 256x128 coop beta 0", [&] { k2z.run(s); }});
  vs.push_back({"cutlass 128x128 ping beta 0", [&] { k3z.run(s); }});
  auto restore_kept = [&] { CUDA_OK(cudaMemcpyAsync(kept, c0, vh * 4, cudaMemcpyDeviceToDevice, s)); };
  if (in_place) {
    vs.push_back({"c4: in place, 6 launches", in_place_by_levels[0].run, restore_kept});
    vs.push_back({"c2: in place, 4 launches", in_place_by_levels[1].run, restore_kept});
    vs.push_back({"c1: in place, 3 launches", in_place_by_levels[2].run, restore_kept});
  }
  char header[96];
  snprintf(header, sizeof header, "V %d H %d K %d, %d SMs", V, H, K, sms);
  time_variants(vs, reps, s, 2.0 * V * H * K, header);
  return 0;
}
