// Builds without the sm_90 row statistics product (no CUTLASS headers at configure time, or no
// sm_90a among the target architectures): the loss always takes the cuBLASLt path.
#include "cuda/row_stats_product.cuh"

#ifndef LMLOSS_ROW_STATS_PRODUCT
#include "core/context.hpp"

namespace lmloss::cuda {

bool sm90_kernels_run(int) { return false; }

bool row_stats_product_supported(int, lmloss_dtype, const void*, int64_t, const void*, int64_t, int64_t) {
  return false;
}

size_t row_stats_product_workspace(const RowStatsProductArgs&) { return 0; }

lmloss_status run_row_stats_product(const RowStatsProductArgs&, void*, cudaStream_t) {
  return core::fail(LMLOSS_ERROR_UNSUPPORTED, "row statistics product: not in this build");
}

}  // namespace lmloss::cuda
#endif
