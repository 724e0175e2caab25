#!/usr/bin/env bash
# Builds and installs the lmloss Python package (pip install .) into a virtual environment and
# runs its tests with pytest. Exits non-zero when a test fails, when the build fails, and when
# pytest collects no test at all (its exit status 5).
#
#   tests/python/run.sh [pytest arguments...]
#
# Environment:
#   LMLOSS_VENV   the virtual environment to use or create (default: build-python/venv-test).
#                 It sees the system's site-packages, so an installed PyTorch is used and the
#                 PyTorch tests run; without PyTorch they are skipped with the reason.
#   PYTHON        the interpreter that creates it (default: python3)
#   CMAKE_ARGS    extra CMake arguments for the build, e.g. -DLMLOSS_CUDA=OFF
#   CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default: 2)
#   LMLOSS_TEST_TORCH  0: do not install PyTorch (its tests skip); default 1
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
venv=${LMLOSS_VENV:-$root/build-python/venv-test}
python=${PYTHON:-python3}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"

# The build tools are installed beside the package (not in a throw-away isolated environment)
# so that the build folder below stays valid from one run to the next and rebuilds are
# incremental.
"$py" -m pip install --quiet "scikit-build-core>=0.10" "nanobind>=2.2" "cmake>=3.26" "ninja" \
  "numpy>=1.22" "pytest>=7"
# PyTorch, so that lmloss.torch's tests (autograd, gradcheck, torch.compile) run on the CPU too;
# LMLOSS_TEST_TORCH=0 leaves it out, and those tests then skip with the reason.
if [ "${LMLOSS_TEST_TORCH:-1}" != 0 ]; then
  "$py" -m pip install --quiet "torch>=2.4"
fi
"$py" -m pip install --quiet --no-build-isolation --no-deps \
  -Cbuild-dir="$root/build-python/wheel-$(basename "$venv")" "$root"

# From outside the source tree, so that `import lmloss` finds the installed package.
cd "$root/build-python"
status=0
"$py" -m pytest -ra -p no:cacheprovider "$root/tests/python" "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "tests/python/run.sh: pytest collected no tests" >&2
  exit 1
fi
exit "$status"
