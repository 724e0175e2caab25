// Argument validation for the public calls: every rule of the contract that can be checked
// without reading the device, with a message that names the argument. Nothing is written here.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/backend.hpp"
#include "lmloss/lmloss.h"

namespace lmloss::core {

// The integer a caller stored in one of the C API's enum fields. C lets any int be stored there,
// but C++ may assume an enum holds only values within its enumerators' bit width (reading 7 from
// an lmloss_reduction is undefined), so a value not yet checked is read as its bytes.
template <class Enum>
int64_t raw_enum(const Enum& value) {
  static_assert(std::is_enum_v<Enum>);
  std::underlying_type_t<Enum> raw;
  std::memcpy(&raw, &value, sizeof raw);
  return int64_t(raw);
}

// Checks the arguments of a loss call and fills `call`. `loss`, `lse`, `grad_loss` and `grads`
// may be null where the mode does not use them.
lmloss_status validate_loss(Mode mode, const lmloss_head* head, const lmloss_targets* targets,
                            const lmloss_loss_options* options, const lmloss_tensor* loss,
                            const lmloss_tensor* lse, const lmloss_tensor* grad_loss,
                            const lmloss_grads* grads, LossCall& call);

lmloss_status validate_topk(const lmloss_head* head, const lmloss_topk_options* options,
                            const lmloss_tensor* ids, const lmloss_tensor* probs,
                            const lmloss_tensor* tail, TopkCall& call);

// Checks the arguments of lmloss_scale_gradient and fills `call`; `scale` may be null.
lmloss_status validate_scale(const lmloss_tensor* grad, const lmloss_tensor* scale, const lmloss_tensor* out,
                             ScaleCall& call);

// Checks the arguments of lmloss_round_grad_weight (and of its deferred form, `deferred` given)
// and fills `call`; `scale` and `deferred` may be null.
lmloss_status validate_round(const lmloss_tensor* grad_weight, const lmloss_tensor* tail, const lmloss_tensor* scale,
                             const lmloss_tensor* deferred, WeightSumCall& call);

}  // namespace lmloss::core
