// Builds without sm_90a kernels (see row_stats_product_fallback.cpp): the last chunk's dW product
// goes into the f32 sum and the rounding pass follows; a kept pair takes its products in slices.
#include "cuda/weight_grad_store.cuh"

#ifndef LMLOSS_ROW_STATS_PRODUCT
#include "core/context.hpp"

namespace lmloss::cuda {

bool weight_grad_store_supported(const WeightGradStoreArgs&) { return false; }

size_t weight_grad_store_workspace(const WeightGradStoreArgs&) { return 0; }

lmloss_status run_weight_grad_store(const WeightGradStoreArgs&, void*, cudaStream_t) {
  return core::fail(LMLOSS_ERROR_UNSUPPORTED, "dW store: not in this build");
}

bool rest_product_supported(const RestProductArgs&) { return false; }

size_t rest_product_workspace(const RestProductArgs&) { return 0; }

lmloss_status run_rest_product(const RestProductArgs&, void*, cudaStream_t) {
  return core::fail(LMLOSS_ERROR_UNSUPPORTED, "dW product into rests: not in this build");
}

}  // namespace lmloss::cuda
#endif
