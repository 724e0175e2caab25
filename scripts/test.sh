#!/usr/bin/env bash
# Every test: builds build/ if needed, runs the C++ suites through CTest (CUDA suites skip with a
# reason on a machine without a GPU), then the Python package's tests.
set -euo pipefail
case ${1:-} in
  "") ;;
  -h|--help) echo "usage: bash scripts/test.sh   (no options; LMLOSS_TEST_TORCH=0 leaves PyTorch out)"; exit 0 ;;
  *) echo "usage: bash scripts/test.sh   (no options)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --parallel
(cd build && ctest --output-on-failure --timeout 1800)
bash tests/python/run.sh
