#!/usr/bin/env bash
# Builds lmloss for NVIDIA GPUs here, to be run by scripts/gpu_check.sh on another machine: the
# library, tests and tools for sm_90a (and sm_80 PTX) into build-cuda/, the modes benchmark, and
# the host libraries the build links that a GPU machine may lack (OpenBLAS and its Fortran
# runtime) into build-cuda/extra-lib/. Optionally packs what gpu_check.sh needs into a tarball,
# and builds the Python wheel for another interpreter.
#
#   scripts/gpu_build.sh [--pack FILE.tar] [--wheel PYTHON --wheel-dir DIR]
#
# On the GPU machine: tar xf FILE.tar && scripts/gpu_check.sh --build build-cuda
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build-cuda
PACK=""
WHEEL_PYTHON=""
WHEEL_DIR=dist
while [ $# -gt 0 ]; do
  case "$1" in
    --pack) PACK=$2; shift 2 ;;
    --wheel) WHEEL_PYTHON=$2; shift 2 ;;
    --wheel-dir) WHEEL_DIR=$2; shift 2 ;;
    *) echo "usage: scripts/gpu_build.sh [--pack FILE.tar] [--wheel PYTHON --wheel-dir DIR]" >&2; exit 2 ;;
  esac
done
ARCHS="90a-real;80-virtual"

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" > /dev/null
# Everything, and the modes benchmark (the bench source as a program of its own, built on request).
cmake --build "$BUILD" --parallel --target all bench_cuda_modes

# Host libraries beyond the C and C++ runtimes, as the loader resolves them here.
mkdir -p "$BUILD/extra-lib"
ldd "$BUILD/src/liblmloss.so" | awk '/=> \// {print $3}' |
  grep -E 'openblas|gfortran|gomp|quadmath' | while read -r lib; do
    cp -L "$lib" "$BUILD/extra-lib/"
  done
echo "host libraries: $(ls "$BUILD/extra-lib" | tr '\n' ' ')"

if [ -n "$PACK" ]; then
  tar cf "$PACK" "$BUILD"/src/liblmloss.so* "$BUILD"/tests/test_* "$BUILD"/tools/lmloss \
    "$BUILD"/tools/bench_cuda_modes "$BUILD"/examples/example_cuda_step "$BUILD"/extra-lib
  echo "packed: $PACK ($(du -h "$PACK" | cut -f1))"
fi

if [ -n "$WHEEL_PYTHON" ]; then
  # A virtual environment of that interpreter with the build tools, then the wheel.
  venv="$BUILD/wheel-venv"
  [ -x "$venv/bin/python" ] || "$WHEEL_PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q scikit-build-core nanobind cmake ninja
  CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$ARCHS" "$venv/bin/pip" wheel . --no-build-isolation \
    --no-deps -w "$WHEEL_DIR" -Cbuild-dir="$BUILD/wheel-build"
fi
