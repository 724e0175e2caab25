#!/usr/bin/env bash
# The CPU library and its C/C++ tests under AddressSanitizer and UndefinedBehaviorSanitizer:
# an out-of-bounds access, a leak or undefined behaviour (an enum read outside its range, a
# signed overflow) fails the run. The CUDA backend is left out: compute-sanitizer checks it on a
# GPU (scripts/gpu_check.sh).
#
#   bash scripts/sanitize.sh [BUILD_DIR]     # default build-sanitize
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build-sanitize}
SANITIZE="-fsanitize=address,undefined"

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLMLOSS_CUDA=OFF \
  -DCMAKE_C_FLAGS="$SANITIZE -fno-sanitize-recover=all -fno-omit-frame-pointer" \
  -DCMAKE_CXX_FLAGS="$SANITIZE -fno-sanitize-recover=all -fno-omit-frame-pointer" \
  -DCMAKE_EXE_LINKER_FLAGS="$SANITIZE" -DCMAKE_SHARED_LINKER_FLAGS="$SANITIZE"
cmake --build "$BUILD" --parallel
# The install test builds a consumer of the installed library without the sanitizers' runtime,
# which must be the first library loaded: it is left to the plain build's run.
cd "$BUILD"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --output-on-failure --timeout 1800 --parallel 2 --exclude-regex '^install\.'
