// The shared bits of the `lmloss` command: dtype conversions, random ids, CPU/CUDA buffers.
#include "common.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <unordered_set>

#if defined(LMLOSS_TOOLS_CUDA)
#include <cuda_runtime.h>
#endif

namespace lmloss::tools {

// ---- dtypes --------------------------------------------------------------------------------

std::optional<lmloss_dtype> parse_dtype(const std::string& name) {
  for (int d = 0; d < LMLOSS_DTYPE_COUNT; ++d) {
    if (name == dtype_name(static_cast<lmloss_dtype>(d))) return static_cast<lmloss_dtype>(d);
  }
  return std::nullopt;
}

void encode(lmloss_dtype dtype, const double* values, int64_t n, void* out) {
  switch (dtype) {
    case LMLOSS_F64:
      std::memcpy(out, values, n * sizeof(double));
      return;
    case LMLOSS_F32: {
      auto* o = static_cast<float*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<float>(values[i]);
      return;
    }
    case LMLOSS_BF16: {
      auto* o = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = float_to_bf16(static_cast<float>(values[i]));
      return;
    }
    case LMLOSS_F16: {
      auto* o = static_cast<uint16_t*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = float_to_f16(static_cast<float>(values[i]));
      return;
    }
    case LMLOSS_I32: {
      auto* o = static_cast<int32_t*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int32_t>(values[i]);
      return;
    }
    case LMLOSS_I64: {
      auto* o = static_cast<int64_t*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<int64_t>(values[i]);
      return;
    }
    case LMLOSS_U8: {
      auto* o = static_cast<uint8_t*>(out);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<uint8_t>(values[i]);
      return;
    }
    default:
      throw std::invalid_argument("encode: unsupported dtype");
  }
}

void decode(lmloss_dtype dtype, const void* in, int64_t n, double* values) {
  switch (dtype) {
    case LMLOSS_F64:
      std::memcpy(values, in, n * sizeof(double));
      return;
    case LMLOSS_F32: {
      const auto* p = static_cast<const float*>(in);
      for (int64_t i = 0; i < n; ++i) values[i] = p[i];
      return;
    }
    case LMLOSS_BF16: {
      const auto* p = static_cast<const uint16_t*>(in);
      for (int64_t i = 0; i < n; ++i) values[i] = bf16_to_float(p[i]);
      return;
    }
    case LMLOSS_F16: {
      const auto* p = static_cast<const uint16_t*>(in);
      for (int64_t i = 0; i < n; ++i) values[i] = f16_to_float(p[i]);
      return;
    }
    case LMLOSS_I32: {
      const auto* p = static_cast<const int32_t*>(in);
      for (int64_t i = 0; i < n; ++i) values[i] = p[i];
      return;
    }
    case LMLOSS_I64: {
      const auto* p = static_cast<const int64_t*>(in);
      for (int64_t i = 0; i < n; ++i) values[i] = static_cast<double>(p[i]);
      return;
    }
    case LMLOSS_U8: {
      const auto* p = static_cast<const uint8_t*>(in);
      for (int64_t i = 0; i < n; ++i) values[i] = p[i];
      return;
    }
    default:
      throw std::invalid_argument("decode: unsupported dtype");
  }
}

double round_to(lmloss_dtype dtype, double x) {
  unsigned char storage[8];
  double y = 0;
  encode(dtype, &x, 1, storage);
  decode(dtype, storage, 1, &y);
  return y;
}

// ---- random data ---------------------------------------------------------------------------

std::vector<int64_t> Rng::distinct(int64_t k, int64_t n) {
  if (k > n) throw std::invalid_argument("distinct: k > n");
  std::vector<int64_t> ids;
  std::unordered_set<int64_t> seen;
  while (static_cast<int64_t>(ids.size()) < k) {
    const int64_t id = index(n);
    if (seen.insert(id).second) ids.push_back(id);
  }
  return ids;
}

// ---- memory on either side -----------------------------------------------------------------

std::string cuda_unavailable_reason() {
#if defined(LMLOSS_TOOLS_CUDA)
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return std::string("no usable CUDA device: ") + cudaGetErrorString(err);
  if (count == 0) return "no CUDA device";
  if (!lmloss_backend_available(LMLOSS_DEVICE_CUDA)) {
    return "the library reports its CUDA backend unavailable";
  }
  return "";
#else
  return "this build has no CUDA (configure with LMLOSS_CUDA=ON)";
#endif
}

#if defined(LMLOSS_TOOLS_CUDA)
namespace {
void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}
}  // namespace
#endif

Buffer::Buffer(lmloss_device_type device, size_t bytes) : device_(device), bytes_(bytes) {
  const size_t alloc = bytes ? bytes : 1;
  if (device == LMLOSS_DEVICE_CPU) {
    // 64-byte alignment: what the vector units and a cache line want.
    data_ = std::aligned_alloc(64, (alloc + 63) / 64 * 64);
    if (!data_) throw std::bad_alloc();
    return;
  }
#if defined(LMLOSS_TOOLS_CUDA)
  cuda_check(cudaMalloc(&data_, alloc), "cudaMalloc");
#else
  throw std::runtime_error("CUDA buffer requested in a build without CUDA");
#endif
}

Buffer::~Buffer() {
  if (device_ == LMLOSS_DEVICE_CPU) {
    std::free(data_);
    return;
  }
#if defined(LMLOSS_TOOLS_CUDA)
  cudaFree(data_);
#endif
}

void Buffer::upload(const void* host, size_t bytes, size_t offset) {
  if (offset + bytes > bytes_) throw std::out_of_range("Buffer::upload past the end");
  if (device_ == LMLOSS_DEVICE_CPU) {
    std::memcpy(static_cast<char*>(data_) + offset, host, bytes);
    return;
  }
#if defined(LMLOSS_TOOLS_CUDA)
  cuda_check(cudaMemcpy(static_cast<char*>(data_) + offset, host, bytes, cudaMemcpyHostToDevice),
             "cudaMemcpy to the device");
#endif
}

void Buffer::download(void* host, size_t bytes, size_t offset) const {
  if (offset + bytes > bytes_) throw std::out_of_range("Buffer::download past the end");
  if (device_ == LMLOSS_DEVICE_CPU) {
    std::memcpy(host, static_cast<const char*>(data_) + offset, bytes);
    return;
  }
#if defined(LMLOSS_TOOLS_CUDA)
  cuda_check(
      cudaMemcpy(host, static_cast<const char*>(data_) + offset, bytes, cudaMemcpyDeviceToHost),
      "cudaMemcpy to the host");
#endif
}

void device_synchronize() {
#if defined(LMLOSS_TOOLS_CUDA)
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
}

// ---- time ----------------------------------------------------------------------------------

double median(std::vector<double> values) {
  if (values.empty()) return NAN;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

}  // namespace lmloss::tools
