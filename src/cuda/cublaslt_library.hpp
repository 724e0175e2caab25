// cuBLASLt, loaded at run time rather than linked: a CUDA-enabled lmloss then loads, and runs
// its CPU path, on machines without the CUDA libraries, and the CUDA backend reports itself
// unavailable there instead of the whole library failing to load.
#pragma once

#include <cublasLt.h>

namespace lmloss::cuda {

// The entry points the backend uses, resolved from the library of the cuBLAS major version the
// backend was built against.
struct CublasLt {
  decltype(&cublasLtCreate) Create = nullptr;
  decltype(&cublasLtDestroy) Destroy = nullptr;
  decltype(&cublasLtGetStatusString) GetStatusString = nullptr;
  decltype(&cublasLtMatmul) Matmul = nullptr;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) MatmulAlgoConfigGetAttribute = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic = nullptr;
  decltype(&cublasLtMatmulDescCreate) MatmulDescCreate = nullptr;
  decltype(&cublasLtMatmulDescDestroy) MatmulDescDestroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) MatrixLayoutCreate = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) MatrixLayoutSetAttribute = nullptr;
};

// The loaded library, or nullptr when it cannot be loaded (then `cublaslt_error()` says why).
// Loaded once per process; thread-safe.
const CublasLt* cublaslt();
const char* cublaslt_error();

}  // namespace lmloss::cuda
