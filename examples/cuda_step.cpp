// A training step of the head on a GPU, as an engine takes it: bf16 hidden states and head in
// device memory, the engine's own stream, dX in bf16 and dW in f32 (it sums over every token: the
// recommended dtype), and nothing waited for until the loss is read. Then the same step captured
// into a CUDA graph (after that first call, which made the context's handles) and launched on the
// next batch's hidden states, uploaded into the same buffer. Exits with 77 (skipped) where no
// CUDA device is usable.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "lmloss/lmloss.hpp"

#define CUDA_OK(expr)                                                               \
  do {                                                                              \
    const cudaError_t e = (expr);                                                   \
    if (e != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s: %s\n", #expr, cudaGetErrorString(e));               \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0 ||
      !lmloss::backend_available(LMLOSS_DEVICE_CUDA)) {
    std::printf("no CUDA device, or lmloss built without CUDA: skipped\n");
    return 77;
  }
  const int64_t n_tokens = 1024, hidden = 256, vocab = 32000;
  std::vector<__nv_bfloat16> x(n_tokens * hidden), next_x(x.size()), w(vocab * hidden);
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = __float2bfloat16(std::sin(0.37f * float(i)));
    next_x[i] = __float2bfloat16(std::cos(0.23f * float(i)));
  }
  for (size_t i = 0; i < w.size(); ++i) w[i] = __float2bfloat16(0.1f * std::cos(0.11f * float(i)));
  std::vector<int64_t> labels(n_tokens);
  for (int64_t t = 0; t < n_tokens; ++t) labels[t] = (t * 7919) % vocab;
  labels[3] = -100;  // ignored, as in PyTorch

  void *d_x, *d_w, *d_labels, *d_dx, *d_dw, *d_loss;
  CUDA_OK(cudaMalloc(&d_x, x.size() * sizeof(x[0])));
  CUDA_OK(cudaMalloc(&d_w, w.size() * sizeof(w[0])));
  CUDA_OK(cudaMalloc(&d_labels, labels.size() * sizeof(labels[0])));
  CUDA_OK(cudaMalloc(&d_dx, x.size() * sizeof(x[0])));
  CUDA_OK(cudaMalloc(&d_dw, w.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(&d_loss, sizeof(float)));
  CUDA_OK(cudaMemcpy(d_x, x.data(), x.size() * sizeof(x[0]), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_w, w.data(), w.size() * sizeof(w[0]), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_labels, labels.data(), labels.size() * sizeof(labels[0]), cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  using lmloss::Tensor;
  lmloss::Context ctx;
  ctx.set_stream(stream);
  const lmloss::Linear head{Tensor::matrix(d_x, LMLOSS_BF16, n_tokens, hidden).on_cuda(),
                            Tensor::matrix(d_w, LMLOSS_BF16, vocab, hidden).on_cuda(), Tensor{}};
  const Tensor labels_t = Tensor::vector(d_labels, LMLOSS_I64, n_tokens).on_cuda();
  const Tensor loss_t = Tensor::scalar(d_loss, LMLOSS_F32).on_cuda();
  const lmloss::LinearGrads grads{Tensor::matrix(d_dx, LMLOSS_BF16, n_tokens, hidden).on_cuda(),
                                  Tensor::matrix(d_dw, LMLOSS_F32, vocab, hidden).on_cuda(), Tensor{}};
  auto step = [&] {
    lmloss::linear_cross_entropy(ctx, head, labels_t, lmloss::LossOptions{}, loss_t, Tensor{}, grads);
  };
  auto read_loss = [&](float* loss) {
    if (cudaMemcpyAsync(loss, d_loss, sizeof(float), cudaMemcpyDeviceToHost, stream) != cudaSuccess) return false;
    return cudaStreamSynchronize(stream) == cudaSuccess;
  };

  float loss = 0, replayed = 0, next_loss = 0, next_replayed = 0;
  cudaGraphExec_t graph_exec = nullptr;
  try {
    step();  // enqueued on `stream`; the call returns without waiting
    if (!read_loss(&loss)) return 1;
    ctx.synchronize();  // throws if a label was out of range on the device

    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    try {
      step();
    } catch (const lmloss::Error&) {
      cudaStreamEndCapture(stream, &graph);
      throw;
    }
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    CUDA_OK(cudaGraphInstantiate(&graph_exec, graph, 0));
    CUDA_OK(cudaGraphDestroy(graph));
    CUDA_OK(cudaGraphLaunch(graph_exec, stream));  // the same step again
    if (!read_loss(&replayed)) return 1;
    CUDA_OK(cudaMemcpyAsync(d_x, next_x.data(), x.size() * sizeof(x[0]), cudaMemcpyHostToDevice, stream));
    CUDA_OK(cudaGraphLaunch(graph_exec, stream));  // the next batch
    if (!read_loss(&next_replayed)) return 1;
    step();  // and the same directly, to compare
    if (!read_loss(&next_loss)) return 1;
    ctx.synchronize();
  } catch (const lmloss::Error& e) {
    std::fprintf(stderr, "lmloss: %s\n", e.what());
    return 1;
  }
  std::printf("loss %.6f (graph %.6f), next batch %.6f (graph %.6f)\n", loss, replayed, next_loss,
              next_replayed);
  cudaGraphExecDestroy(graph_exec);
  for (void* p : {d_x, d_w, d_labels, d_dx, d_dw, d_loss}) cudaFree(p);
  cudaStreamDestroy(stream);
  // The graph's launches compute what direct calls do, bitwise; the two batches differ.
  return std::isfinite(loss) && replayed == loss && next_replayed == next_loss && next_loss != loss ? 0 : 1;
}
