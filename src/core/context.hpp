// The context behind the opaque lmloss_context handle, and the error channel every call uses.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "core/backend.hpp"
#include "lmloss/lmloss.h"

struct lmloss_context {
  size_t workspace_budget = LMLOSS_DEFAULT_WORKSPACE_BYTES;
  size_t workspace_in_use = 0;
  size_t workspace_peak = 0;
  int num_threads = 0;  // 0: all cores
  bool tune_products = false;  // CUDA: time the heuristic's algorithms per product shape
  void* stream = nullptr;
  lmloss_allocator allocator{};
  bool has_allocator = false;
  std::unique_ptr<lmloss::core::BackendState> cpu_state;   // made by the CPU backend on first use
  std::unique_ptr<lmloss::core::BackendState> cuda_state;  // made by the CUDA backend on first use
};

// Returns from the enclosing function when a step fails (the step has set the message).
#define LMLOSS_CHECK(expr)                                                    \
  do {                                                                        \
    const lmloss_status lmloss_check_status_ = (expr);                        \
    if (lmloss_check_status_ != LMLOSS_SUCCESS) return lmloss_check_status_;  \
  } while (0)

namespace lmloss::core {

// Records `message` as this thread's last error and returns `status`.
lmloss_status fail(lmloss_status status, const std::string& message);
// Clears the last error; returns LMLOSS_SUCCESS.
lmloss_status succeed();

// Workspace accounting: backends report what they hold so the peak can be read back.
inline void note_workspace_acquired(lmloss_context& context, size_t bytes) {
  context.workspace_in_use += bytes;
  if (context.workspace_in_use > context.workspace_peak) context.workspace_peak = context.workspace_in_use;
}
inline void note_workspace_released(lmloss_context& context, size_t bytes) {
  context.workspace_in_use -= bytes < context.workspace_in_use ? bytes : context.workspace_in_use;
}

// How many rows of `bytes_per_row` fit in the budget beside `fixed_bytes`, at most `n_rows`;
// 0 when not even one row fits.
inline int64_t plan_chunk_rows(size_t budget, size_t fixed_bytes, size_t bytes_per_row, int64_t n_rows) {
  if (bytes_per_row == 0) return n_rows;
  if (fixed_bytes + bytes_per_row > budget) return 0;
  const size_t rows = (budget - fixed_bytes) / bytes_per_row;
  return static_cast<int64_t>(rows) < n_rows ? static_cast<int64_t>(rows) : n_rows;
}

}  // namespace lmloss::core
