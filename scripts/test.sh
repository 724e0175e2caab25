#!/usr/bin/env bash
# Every test: builds build/ if needed, runs the C++ suites through CTest (CUDA suites skip with a
# reason on a machine without a GPU), then the Python package's tests.
set -euo pipefail
cd "$(dirname "$0")/.."

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --parallel
(cd build && ctest --output-on-failure --timeout 1800)
bash tests/python/run.sh
