#!/usr/bin/env bash
# The CPU library and its tests under AddressSanitizer and UndefinedBehaviorSanitizer: an
# out-of-bounds access, a leak or undefined behaviour (an enum read outside its range, a signed
# overflow) fails the run. First the C/C++ tests; then, where tests/python/run.sh has made its
# environment (scripts/test.sh does), the Python package's tests against an extension module
# built the same way, the sanitizers' runtime preloaded into the interpreter. The CUDA backend is
# left out: compute-sanitizer checks it on a GPU (scripts/gpu_check.sh).
#
#   bash scripts/sanitize.sh [BUILD_DIR]     # default build-sanitize
set -euo pipefail
case ${1:-} in
  -h|--help) echo "usage: bash scripts/sanitize.sh [BUILD_DIR]   (default build-sanitize)"; exit 0 ;;
  -*) echo "usage: bash scripts/sanitize.sh [BUILD_DIR]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
root=$PWD
BUILD=${1:-build-sanitize}
case $BUILD in /*) ;; *) BUILD=$root/$BUILD ;; esac
venv=${LMLOSS_VENV:-$root/build-python/venv-test}
SANITIZE="-fsanitize=address,undefined"
configure() {  # configure DIR [CMAKE ARGS...]
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLMLOSS_CUDA=OFF \
    -DCMAKE_C_FLAGS="$SANITIZE -fno-sanitize-recover=all -fno-omit-frame-pointer" \
    -DCMAKE_CXX_FLAGS="$SANITIZE -fno-sanitize-recover=all -fno-omit-frame-pointer" \
    -DCMAKE_EXE_LINKER_FLAGS="$SANITIZE" -DCMAKE_SHARED_LINKER_FLAGS="$SANITIZE" \
    -DCMAKE_MODULE_LINKER_FLAGS="$SANITIZE" "$@"
}

configure "$BUILD"
cmake --build "$BUILD" --parallel
# The install test builds a consumer of the installed library without the sanitizers' runtime,
# which must be the first library loaded: it is left to the plain build's run.
(cd "$BUILD" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure --timeout 1800 --parallel 2 --exclude-regex '^install\.')

if [ ! -x "$venv/bin/python" ]; then
  echo "sanitize.sh: no Python environment at $venv (tests/python/run.sh makes it): Python tests skipped"
  exit 0
fi
module=$BUILD/python-module
configure "$module" -DLMLOSS_BUILD_PYTHON=ON -DBUILD_SHARED_LIBS=OFF -DLMLOSS_BUILD_TESTS=OFF \
  -DLMLOSS_BUILD_TOOLS=OFF -DPython_EXECUTABLE="$venv/bin/python"
cmake --build "$module" --parallel
site=$BUILD/python-site
rm -rf "$site" && mkdir -p "$site/lmloss"
cp python/lmloss/*.py "$site/lmloss/" && cp "$module"/python/_lmloss*.so "$site/lmloss/"
# The interpreter is not instrumented: its own allocations are not checked for leaks.
export PYTHONPATH=$site ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1
export LD_PRELOAD="$(c++ -print-file-name=libasan.so) $(c++ -print-file-name=libubsan.so)"
"$venv/bin/python" -c "import sys, lmloss._lmloss as m; sys.exit(not m.__file__.startswith('$site/'))" ||
  { echo "sanitize.sh: the tests would not import the module built here" >&2; exit 1; }
cd tests/python
"$venv/bin/python" -m pytest -q -p no:cacheprovider
