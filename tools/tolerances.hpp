// The one table of error bounds of the `lmloss` command, by input dtype: the largest relative
// error ||out - ref|| / ||ref|| of any output against the float64 reference. Half-precision
// inputs reach the reference already rounded, so what remains is f32 arithmetic and the rounding
// of half-precision outputs (~2^-9).
#pragma once

#include <stdexcept>
#include <string>

#include "common.hpp"
#include "lmloss/lmloss.h"

namespace lmloss::tools {

struct Tolerance {
  lmloss_dtype dtype;
  double relative;
};

inline constexpr Tolerance kTolerances[] = {
    {LMLOSS_F64, 1e-10},
    {LMLOSS_F32, 1e-5},
    {LMLOSS_BF16, 1e-2},
    {LMLOSS_F16, 1e-2},
};

inline double tolerance_for(lmloss_dtype dtype) {
  for (const Tolerance& t : kTolerances) {
    if (t.dtype == dtype) return t.relative;
  }
  throw std::invalid_argument(std::string("no tolerance for dtype ") + dtype_name(dtype));
}

}  // namespace lmloss::tools
