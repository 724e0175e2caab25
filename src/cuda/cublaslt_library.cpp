#include "cuda/cublaslt_library.hpp"

#include <dlfcn.h>

#include <string>

namespace lmloss::cuda {
namespace {

struct Loaded {
  CublasLt api;
  bool ok = false;
  std::string error;
};

template <typename Fn>
bool resolve(void* library, const char* name, Fn& fn, std::string& error) {
  fn = reinterpret_cast<Fn>(dlsym(library, name));
  if (!fn && error.empty()) error = std::string("cuBLASLt has no symbol ") + name;
  return fn != nullptr;
}

Loaded load() {
  Loaded l;
  // The soname of the major version built against, then the unversioned development name.
  const std::string versioned = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* library = dlopen(versioned.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!library) library = dlopen("libcublasLt.so", RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    const char* why = dlerror();
    l.error = "cannot load " + versioned + (why ? std::string(": ") + why : std::string());
    return l;
  }
  // Kept loaded for the life of the process: plans and handles may outlive any one context.
  CublasLt& a = l.api;
  bool ok = true;
  ok &= resolve(library, "cublasLtCreate", a.Create, l.error);
  ok &= resolve(library, "cublasLtDestroy", a.Destroy, l.error);
  ok &= resolve(library, "cublasLtGetStatusString", a.GetStatusString, l.error);
  ok &= resolve(library, "cublasLtMatmul", a.Matmul, l.error);
  ok &= resolve(library, "cublasLtMatmulAlgoConfigGetAttribute", a.MatmulAlgoConfigGetAttribute, l.error);
  ok &= resolve(library, "cublasLtMatmulAlgoGetHeuristic", a.MatmulAlgoGetHeuristic, l.error);
  ok &= resolve(library, "cublasLtMatmulDescCreate", a.MatmulDescCreate, l.error);
  ok &= resolve(library, "cublasLtMatmulDescDestroy", a.MatmulDescDestroy, l.error);
  ok &= resolve(library, "cublasLtMatmulDescSetAttribute", a.MatmulDescSetAttribute, l.error);
  ok &= resolve(library, "cublasLtMatmulPreferenceCreate", a.MatmulPreferenceCreate, l.error);
  ok &= resolve(library, "cublasLtMatmulPreferenceDestroy", a.MatmulPreferenceDestroy, l.error);
  ok &= resolve(library, "cublasLtMatmulPreferenceSetAttribute", a.MatmulPreferenceSetAttribute, l.error);
  ok &= resolve(library, "cublasLtMatrixLayoutCreate", a.MatrixLayoutCreate, l.error);
  ok &= resolve(library, "cublasLtMatrixLayoutDestroy", a.MatrixLayoutDestroy, l.error);
  ok &= resolve(library, "cublasLtMatrixLayoutSetAttribute", a.MatrixLayoutSetAttribute, l.error);
  l.ok = ok;
  return l;
}

const Loaded& loaded() {
  static const Loaded instance = load();
  return instance;
}

}  // namespace

const CublasLt* cublaslt() { return loaded().ok ? &loaded().api : nullptr; }
const char* cublaslt_error() { return loaded().error.c_str(); }

}  // namespace lmloss::cuda
