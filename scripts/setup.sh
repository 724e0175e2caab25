#!/usr/bin/env bash
# Set-up on a fresh Debian/Ubuntu machine: installs the build dependencies, builds lmloss into
# build/, and runs the default benchmark. `--no-bench` stops after the build; `--deps-only`
# after the packages.
set -euo pipefail
cd "$(dirname "$0")/.."

run_bench=1
build=1
for arg in "$@"; do
  case "$arg" in
    --no-bench) run_bench=0 ;;
    --deps-only) run_bench=0; build=0 ;;
    *) echo "usage: scripts/setup.sh [--no-bench | --deps-only]" >&2; exit 2 ;;
  esac
done

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
packages=(cmake ninja-build g++ pkg-config libopenblas-dev libgtest-dev libcli11-dev
          nlohmann-json3-dev python3 python3-pip python3-venv python3-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
[ "$build" -eq 1 ] || exit 0

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build --parallel
if [ "$run_bench" -eq 1 ]; then
  ./build/tools/lmloss bench
fi
