// Built without CUDA: the CUDA backend is absent and calls on CUDA tensors say so.
#include "core/backend.hpp"

namespace lmloss::core {
Backend* cuda_backend() { return nullptr; }
}  // namespace lmloss::core
