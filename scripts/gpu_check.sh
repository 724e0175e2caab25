#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: the GPU tests against the float64 reference,
# compute-sanitizer memcheck, racecheck and synccheck on small cases, the CUDA benchmark at the
# issue's presets, and the peers (PyTorch, torch.compile, Liger Kernel, Cut Cross-Entropy; the step
# also on inputs shaped like a trained head's, where CCE's filtering works); a short table last.
# Logs and JSON go to $OUT (default: gpu-check-out/).
#
#   scripts/gpu_check.sh [--build DIR] [--stages tests,sanitizer,bench,curve,peers] [--quick]
#                        [--peer-rounds R]
#
# --stages may also name dw (not run by default): a 16-bit dW timed six ways, its products in two
# parts against one batched product, lmloss's dW errors against float64, and lmloss.torch with its
# dW's f32 sum kept against a float32 dW of its own, beside torch.compile; and kernels: the
# forward and the step kernel by kernel under ncu; and synccheck alone (also part of sanitizer).
#
# The build folder (default build-cuda) is used as it is when it holds the binaries (a build made
# on another machine: scripts/gpu_build.sh --pack), else configured and built here. Python peers
# come from wheels in .whl/ (and lmloss from dist/) when present, installed to a private folder,
# else from what python3 already has. The peers run R rounds (default 2, 1 with --quick), every
# other one in reverse order, so that no method is always timed on the card the others warmed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=build-cuda
STAGES=tests,sanitizer,bench,curve,peers
QUICK=0
PEER_ROUNDS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --stages) STAGES=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --peer-rounds) PEER_ROUNDS=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
has_stage() { [[ ",$STAGES," == *",$1,"* ]]; }
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader || {
  echo "no GPU here"; exit 1; }

# Binaries built elsewhere carry absolute paths of the build machine (rpaths, CTest files): give
# them their libraries through the loader path instead. extra-lib/ holds host libraries the build
# needs that this machine may lack (OpenBLAS and its Fortran runtime).
if [ ! -x "$BUILD/tests/test_cuda" ] || [ ! -f "$BUILD/src/liblmloss.so" ]; then
  echo "== building $BUILD"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_CUDA_ARCHITECTURES="90a-real;80-virtual" > "$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" --parallel >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
# The modes benchmark is built on request, where this machine holds the build's configuration.
if [ ! -x "$BUILD/tools/bench_cuda_modes" ] && [ -f "$BUILD/CMakeCache.txt" ]; then
  cmake --build "$BUILD" --target bench_cuda_modes >> "$OUT/build.log" 2>&1
fi
CUDA_LIBS=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; p = os.path.dirname(nvidia.__path__[0]); import glob; print(" ".join(glob.glob(p + "/nvidia/*/lib") + glob.glob(p + "/nvidia/cu*/lib")))' 2>/dev/null); do
  [ -d "$d" ] && CUDA_LIBS="$CUDA_LIBS:$d"
done
export LMLOSS_LD="$ROOT/$BUILD/src:$ROOT/$BUILD/extra-lib$CUDA_LIBS"
run() { LD_LIBRARY_PATH="$LMLOSS_LD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }
# Python with lmloss's wheel: its extension needs the host libraries of extra-lib/ (OpenBLAS), and
# nothing else of ours, so that PyTorch keeps its own CUDA libraries.
pyrun() { LD_LIBRARY_PATH="$ROOT/$BUILD/extra-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }

# The peers' wheels, and lmloss's own (scripts/gpu_build.sh --wheel) so that it is timed too,
# installed once to a private folder.
install_wheels() {
  [[ "${PYTHONPATH:-}" == */tmp/peers-site* ]] && return
  local wheels
  wheels=$(ls .whl/*.whl dist/lmloss-*.whl 2> /dev/null)
  if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peers-site \
      $wheels > "$OUT/pip.log" 2>&1 && export PYTHONPATH=/tmp/peers-site${PYTHONPATH:+:$PYTHONPATH}
  fi
}

# A GoogleTest log's closing counts on one line (PASSED is padded to the brackets' width), and its
# time: a call's plan needs to know how long each suite takes.
gtest_summary() {
  grep -E '^\[  (PASSED|FAILED|SKIPPED) *\]' "$1" | tr '\n' ' '
  grep -oE '\([0-9]+ ms total\)' "$1" | tail -1
}

FAILED=0
if has_stage tests; then
  echo "== tests (the CUDA instances of every suite, then the GPU-only suite)"
  # The statistics product's own cases run after the loop, once in each cluster shape.
  product_cases='*FromTheProduct*:*ClusterRows*:*FusedStep*:*ForwardOfManyTokens*:*RunsAreBitwiseIdentical*'
  for t in "$BUILD"/tests/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    filter='*cuda*:*Cuda*'
    [ "$name" = test_cuda ] && filter="*-$product_cases"
    run timeout 400 "$t" --gtest_filter="$filter" --gtest_brief=1 > "$OUT/$name.log" 2>&1
    rc=$?
    note "tests   $name rc=$rc $(gtest_summary "$OUT/$name.log")"
    [ $rc -ne 0 ] && { FAILED=1; grep -E 'Failure|error|FAILED' "$OUT/$name.log" | head -20; }
  done
  # The statistics product's cluster shape is chosen per card (2 x 2 on an H100, 2 x 1 on an
  # H200): its cases with each shape forced, so that one card checks both.
  if [ -x "$BUILD/tests/test_cuda" ]; then
    for clusters in 2x1 2x2; do
      LMLOSS_PRODUCT_CLUSTERS=$clusters run timeout 300 "$BUILD/tests/test_cuda" --gtest_brief=1 \
        --gtest_filter="$product_cases" > "$OUT/test_cuda_clusters_$clusters.log" 2>&1
      rc=$?
      note "tests   test_cuda product cases in $clusters clusters rc=$rc $(gtest_summary "$OUT/test_cuda_clusters_$clusters.log")"
      [ $rc -ne 0 ] && FAILED=1
    done
  fi
  if [ -x "$BUILD/examples/example_cuda_step" ]; then
    run "$BUILD/examples/example_cuda_step" > "$OUT/example_cuda_step.log" 2>&1
    rc=$?
    note "example example_cuda_step rc=$rc $(tail -1 "$OUT/example_cuda_step.log")"
    [ $rc -ne 0 ] && FAILED=1
  fi
  if [ -x "$BUILD/tools/lmloss" ]; then
    run "$BUILD/tools/lmloss" check --backend cuda > "$OUT/check.log" 2>&1
    note "check   lmloss check --backend cuda rc=$? $(tail -1 "$OUT/check.log")"
  fi
  # The PyTorch layer's CUDA tests, on lmloss's wheel (scripts/gpu_build.sh --wheel) where there is one.
  if ls dist/lmloss-*.whl > /dev/null 2>&1 && python3 -c 'import torch, pytest' 2> /dev/null; then
    install_wheels
    pyrun python3 -m pytest -q -p no:cacheprovider tests/python/test_torch.py -k cuda > "$OUT/pytest_torch_cuda.log" 2>&1
    rc=$?
    note "tests   pytest test_torch.py -k cuda rc=$rc $(tail -1 "$OUT/pytest_torch_cuda.log")"
    [ $rc -ne 0 ] && { FAILED=1; grep -E '^(FAILED|ERROR)' "$OUT/pytest_torch_cuda.log" | head -20; }
  fi
fi

if has_stage sanitizer; then
  echo "== compute-sanitizer (small cases)"
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  for tool in memcheck racecheck; do
    filter='Cuda.RunsAreBitwiseIdentical:Cuda.IdOutOfRange*:Cuda.TopkLargeKAndTiedRows:Cuda.TopkOfLongRows*:Cuda.LongRows*:Cuda.ForwardStatistics*:Cuda.FusedStepFromTheProduct*:Cuda.FusedStepWithFarLabels*:Cuda.DistillationFromTheProduct*:Cuda.TopkFromTheProduct*:Cuda.SixteenBitWeightGradient*:Cuda.RepeatedTeacherIdsAddTheirTermsAcrossChunks'
    # racecheck takes the kernels that share memory between a block's threads: the rows
    # kernels' sorts and selects among them (~190 s on an H200), and the fix-ups' sort.
    [ $tool = racecheck ] && filter='Cuda.RunsAreBitwiseIdentical:Cuda.LongRows*:Cuda.TopkFromTheProductRecomputesGroups:Cuda.TopkOfLongRows*:Cuda.TopkLargeKAndTiedRows:Cuda.RepeatedTeacherIdsAddTheirTermsAcrossChunks'
    run timeout 300 "$SAN" --tool $tool --error-exitcode 9 "$BUILD/tests/test_cuda" --gtest_filter="$filter" \
      > "$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    # Past the time limit: stop whatever is left of the target too, so that nothing after this
    # shares the device with it (a racecheck left running once doubled a benchmark's floors).
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      pkill -KILL -f "$BUILD/tests/test_cuda" 2>/dev/null
      note "sanit.  $tool ran past its 300 s and was stopped"
    fi
    note "sanit.  $tool rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1)"
    [ $rc -ne 0 ] && FAILED=1
  done
  # A 16-bit dW's kept f32 sum: its rows rounded in place, in waves, over their own bytes.
  if [ -x "$BUILD/tests/test_weight_sum" ]; then
    run timeout 200 "$SAN" --tool memcheck --error-exitcode 9 "$BUILD/tests/test_weight_sum" --gtest_filter='*cuda*' \
      > "$OUT/sanitizer_memcheck_weight_sum.log" 2>&1
    rc=$?
    note "sanit.  memcheck test_weight_sum rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_memcheck_weight_sum.log" | tail -1)"
    [ $rc -ne 0 ] && FAILED=1
  fi
fi

# synccheck over the kernels that take most barriers: a warp split by a branch of thread 0 that
# reaches a barrier in two parts lets the other warps pass it early (run 59: dense values written
# over fix-ups).
if has_stage sanitizer || has_stage synccheck; then
  echo "== compute-sanitizer synccheck"
  SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  filter='Cuda.LongRows*:Cuda.TopkLargeKAndTiedRows:Cuda.TopkOfLongRows*:Cuda.TopkFromTheProductRecomputesGroups:Cuda.FusedStepFromTheProduct*:Cuda.FusedStepWithFarLabels*:Cuda.DistillationFromTheProduct*:Cuda.RepeatedTeacherIdsAddTheirTermsAcrossChunks'
  run timeout 300 "$SAN" --tool synccheck --error-exitcode 9 "$BUILD/tests/test_cuda" --gtest_filter="$filter" \
    > "$OUT/sanitizer_synccheck.log" 2>&1
  rc=$?
  note "sanit.  synccheck rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer_synccheck.log" | tail -1)"
  [ $rc -ne 0 ] && FAILED=1
fi

REPEATS=10
[ $QUICK = 1 ] && REPEATS=3
[ -z "$PEER_ROUNDS" ] && { PEER_ROUNDS=2; [ $QUICK = 1 ] && PEER_ROUNDS=1; }
if has_stage bench; then
  echo "== bench: every mode at the presets"
  for spec in "llama3-8b 8192" "llama3-8b 32768" "gemma2-2b 8192"; do
    set -- $spec
    # seedtopk: the seed's top-k scheme (cuBLASLt's product into f32 logits, then the seed's row
    # kernel), the issue's bar for top-k up to 2048.
    modes=fwd_bwd,dx_only,forward,topk64,topk2048,seedtopk64,seedtopk2048,distill64
    [ "$2" = 32768 ] && modes=fwd_bwd,dx_only,forward,topk64,topk2048,distill64
    [ $QUICK = 1 ] && [ "$2" = 32768 ] && modes=fwd_bwd
    run "$BUILD/tools/bench_cuda_modes" --preset "$1" --tokens "$2" --modes "$modes" --repeats $REPEATS \
      --json "$OUT/modes_$1_$2.json" 2>&1 | tee "$OUT/modes_$1_$2.log"
  done
  # The same steps with the opt-in product tuning (lmloss_context_set_product_tuning).
  for preset in llama3-8b gemma2-2b; do
    run "$BUILD/tools/bench_cuda_modes" --preset "$preset" --modes fwd_bwd,dx_only --repeats $REPEATS \
      --tune 1 --json "$OUT/tuned_$preset.json" 2>&1 | sed 's/^\([a-z_0-9]* *budget\)/tuned \1/' |
      tee "$OUT/modes_tuned_$preset.log"
  done
  run "$BUILD/tools/lmloss" bench --backend cuda --preset llama3-8b --dtype bf16 --repeats 5 \
    --json "$OUT/lmloss_bench.json" > "$OUT/lmloss_bench.log" 2>&1
  note "bench   lmloss bench --backend cuda llama3-8b rc=$?"
  tail -12 "$OUT/lmloss_bench.log"
fi

# Not in the default stages: a 16-bit dW six ways (f32, rounded per chunk, summed in f32 and
# rounded once, its f32 sum kept with the caller's tail right after it, past a gap above it or
# apart, and rounded by a second call) in alternating rounds, its two-part product against one
# batched product (strided, and from arrays of pointers), lmloss's dW
# errors against float64 (bench/dw_rounding.py's emulation, checked), and lmloss.torch with the
# kept sum against a float32 dW of its own beside torch.compile, at llama3-8b and a 70B head
# (H 8192).
if has_stage dw; then
  echo "== dW: its dtype and rounding, its products in two parts, its error"
  for round in 1 2; do
    for dw in f32 input input-once input-kept input-kept-gap input-kept-apart; do
      run "$BUILD/tools/bench_cuda_modes" --preset llama3-8b --modes fwd_bwd --repeats 5 --dw-dtype $dw 2>&1 |
        sed "s/^fwd_bwd /dw $dw round $round: /" | tee -a "$OUT/modes_dw.log"
    done
  done
  for spec in "8192 2816" "32768 3328"; do
    set -- $spec
    run "$BUILD/tools/bench_cuda_modes" --preset llama3-8b --tokens "$1" --modes "" --floor 0 --repeats 5 \
      --dw-parts-rows "$2" 2>&1 | tee -a "$OUT/dw_parts.log"
  done
  install_wheels
  for tokens in 8192 32768; do
    pyrun env PYTHONUNBUFFERED=1 python3 bench/peers.py --presets llama3-8b --tokens $tokens --modes fwd_bwd --methods lmloss \
      --accuracy --repeats 3 2>&1 | tee -a "$OUT/dw_accuracy.log"
  done
  for hidden in 4096 8192; do
    pyrun env PYTHONUNBUFFERED=1 python3 bench/peers.py --presets llama3-8b --hidden $hidden --modes fwd_bwd \
      --methods lmloss,lmloss-f32dw,torch.compile --repeats 5 --rounds 2 --json "$OUT/peers_kept_$hidden.json" 2>&1 |
      tee -a "$OUT/peers_kept.log"
  done
  # The same with the host's launches ahead of the GPU, as in a training loop: the GPU's time alone,
  # with the SM clock each method ran at (a card at its power limit).
  pyrun env PYTHONUNBUFFERED=1 python3 bench/peers.py --presets llama3-8b --modes fwd_bwd --launch-ahead 3 --clocks \
    --methods lmloss,lmloss-f32dw,torch.compile --repeats 5 --rounds 2 --json "$OUT/peers_kept_ahead.json" 2>&1 |
    tee -a "$OUT/peers_kept.log"
fi

# Not in the default stages: the forward and the fused step at llama3-8b kernel by kernel under
# ncu, at the card's own clocks: each kernel's time, tensor-pipe and DRAM use and SM clock, the
# floor's cuBLASLt products among them (where a card's extra over its floor goes: run 49 had an
# H100's statistics product ~2 ms behind cuBLASLt's forward, an H200's level with it).
if has_stage kernels; then
  echo "== kernels: the forward and the step under ncu (llama3-8b)"
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  metrics=gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
  metrics=$metrics,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second
  for mode in forward fwd_bwd; do
    run timeout 300 "$NCU" --clock-control none --metrics "$metrics" --print-summary per-kernel \
      "$BUILD/tools/bench_cuda_modes" --preset llama3-8b --modes $mode --repeats 1 > "$OUT/kernels_$mode.log" 2>&1
    note "kernels $mode rc=$? (ncu per-kernel summary in kernels_$mode.log)"
  done
fi

if has_stage curve; then
  echo "== bench: time against the workspace budget (llama3-8b, N 8192)"
  run "$BUILD/tools/bench_cuda_modes" --preset llama3-8b --modes fwd_bwd --budgets-gib 0.125,0.25,0.5,1,2,4 \
    --repeats $REPEATS --json "$OUT/curve.json" 2>&1 | tee "$OUT/curve.log"
fi

if has_stage peers; then
  echo "== peers"
  install_wheels
  presets=llama3-8b,gemma2-2b
  pyrun env PYTHONUNBUFFERED=1 python3 bench/peers.py --presets $presets --accuracy \
    --modes fwd_bwd,forward,distill64,topk64,topk2048,dx_only \
    --repeats $REPEATS --rounds $PEER_ROUNDS --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log"
  if [ $QUICK = 0 ]; then
    pyrun env PYTHONUNBUFFERED=1 python3 bench/peers.py --presets llama3-8b --tokens 32768 --modes fwd_bwd --accuracy \
      --methods naive,torch.compile,cce --repeats 5 --rounds $PEER_ROUNDS --json "$OUT/peers_32768.json" 2>&1 | tee "$OUT/peers_32768.log"
    # CCE's filtering skips gradient blocks only where the softmax is peaked: the step again on
    # inputs shaped like a trained head's (the other methods' time does not depend on them).
    pyrun env PYTHONUNBUFFERED=1 python3 bench/peers.py --presets $presets --modes fwd_bwd --data peaked --accuracy \
      --methods lmloss,torch.compile,cce,cce-exact --repeats 5 --rounds $PEER_ROUNDS --json "$OUT/peers_peaked.json" 2>&1 |
      tee "$OUT/peers_peaked.log"
  fi
fi

# The budget curve beside the peers' points, when both ran and matplotlib is there.
if [ -f "$OUT/curve.json" ] && [ -f "$OUT/peers.json" ] && python3 -c 'import matplotlib' 2> /dev/null; then
  python3 bench/plot_curve.py "$OUT/curve.json" "$OUT/peers.json" "$OUT/budget_curve.png" &&
    note "plot    $OUT/budget_curve.png"
fi

# Few files come back from some machines: one archive holds every log.
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz ./* 2>/dev/null)

echo
echo "== summary"
cat "$SUMMARY"
for f in "$OUT"/modes_*.log "$OUT"/curve.log; do [ -f "$f" ] && grep -E 'x[0-9]|rows. ids differ' "$f"; done
[ -f "$OUT/peers.log" ] && grep -E 'x[0-9]' "$OUT/peers.log"
[ -f "$OUT/peers_peaked.log" ] && grep -E 'x[0-9]' "$OUT/peers_peaked.log" | sed 's/^/peaked /'
[ -f "$OUT/dw_parts.log" ] && grep '^dw-parts' "$OUT/dw_parts.log"
[ -f "$OUT/dw_accuracy.log" ] && grep 'vs f64' "$OUT/dw_accuracy.log"
exit $FAILED
