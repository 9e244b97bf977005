#!/usr/bin/env bash
# One-shot GPU check for the Triton backend on one CUDA GPU (prepared for an H200):
#   1. the CUDA conformance subset (tests/conformance -k triton, quick shapes) and
#      tests/test_triton_kernels.py, bf16 included,
#   2. the kernel benchmark on the H200 target cases (with the device copy bandwidth),
#   3. a short sweep of launch configs (bench/tune.py),
#   4. the conformance suite on its full shape set with the time left (partial if cut),
# writing everything under bench/results/<date>-<device>/ (override: RESULTS_DIR=...).
# When $OUT is set (the device-runner's output folder) the results are copied there too.
# Budget: under 5 minutes on one H200; each step has its own timeout and later steps still run.
#
# Usage (from the repository root, on the GPU machine):  bash bench/gpu_check.sh
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
unset TRITON_INTERPRET            # real kernels, not the CPU interpreter
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T0=$(date +%s)

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch is missing or sees no CUDA device ($PY); nothing to do" >&2
    exit 2
fi
if ! "$PY" -c "import topth_ops.cuda_kernels, topth_ops.bench" 2>/dev/null; then
    # offline install of this checkout (torch, triton, numpy must already be installed)
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || {
        echo "gpu_check: cannot install topth-ops from this checkout" >&2; exit 2; }
fi

DEV=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")
RESULTS_DIR=${RESULTS_DIR:-bench/results/$(date +%F)-$DEV}
mkdir -p "$RESULTS_DIR"
echo "gpu_check: results in $RESULTS_DIR"

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1
    "$PY" -c "import torch, triton, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '| numpy', numpy.__version__)"
    git rev-parse HEAD 2>/dev/null || true
    git status --short 2>/dev/null | head -20 || true
} > "$RESULTS_DIR/env.txt" 2>&1
cat "$RESULTS_DIR/env.txt"

status=0

# time left of the 280 s budget (20 s margin under 5 minutes)
left() { echo $(( 280 - ($(date +%s) - T0) )); }

# 1. correctness on the GPU, bf16 included (the interpreter cannot run bf16):
#    the conformance suite on its quick shape set plus the kernel tests.
TESTS=(tests/test_triton_kernels.py)
[ -d tests/conformance ] && TESTS=(tests/conformance "${TESTS[@]}")
"$PY" -c "import pytest" 2>/dev/null || echo "gpu_check: pytest is not installed here: steps 1 and 3 cannot run" >&2
echo "== [1] pytest -k triton ${TESTS[*]} (conformance quick shapes)"
TOPTH_CONFORMANCE_SHAPES=quick timeout -s INT 120 "$PY" -m pytest -q -p no:cacheprovider -k triton "${TESTS[@]}" \
    --junitxml="$RESULTS_DIR/pytest-quick.xml" 2>&1 | tee "$RESULTS_DIR/pytest-quick.txt" | tail -25
rc=${PIPESTATUS[0]}
echo "pytest exit code: $rc (124 = out of time: partial results)" | tee -a "$RESULTS_DIR/pytest-quick.txt"
[ "$rc" -ne 0 ] && status=1

# 2. benchmark: H200 target cases, dense baselines, copy bandwidth; checked before timed
echo "== [2] benchmark (h200 cases)"
timeout -s INT 100 "$PY" -m topth_ops.bench --cases h200 --out "$RESULTS_DIR" --budget-ms 100 --check-targets \
    2>&1 | tee "$RESULTS_DIR/bench.txt" | tail -40
rc=${PIPESTATUS[0]}
echo "bench exit code: $rc (1 = a target missed or a variant wrong, 124 = out of time)" | tee -a "$RESULTS_DIR/bench.txt"
[ "$rc" -ne 0 ] && status=1

# 3. launch-config sweep on the target shape (at most 40 s)
t=$(left)
if [ "$t" -gt 30 ]; then
    t=$(( t < 40 ? t : 40 ))
    echo "== [3] config sweep (${t}s)"
    timeout -s INT "$t" "$PY" -m topth_ops.bench.tune --out "$RESULTS_DIR" --seconds $(( t - 10 )) \
        2>&1 | tee "$RESULTS_DIR/tune.txt" | tail -40
else
    echo "== [3] config sweep skipped ($(left)s left)" | tee "$RESULTS_DIR/tune.txt"
fi

# 4. the conformance suite on its full shape set, with whatever time is left
t=$(left)
if [ -d tests/conformance ] && [ "$t" -gt 30 ]; then
    echo "== [4] pytest -k triton tests/conformance (full shapes, ${t}s)"
    timeout -s INT "$t" "$PY" -m pytest -q -p no:cacheprovider -k triton tests/conformance \
        --junitxml="$RESULTS_DIR/pytest-full.xml" 2>&1 | tee "$RESULTS_DIR/pytest-full.txt" | tail -25
    rc=${PIPESTATUS[0]}
    echo "pytest (full shapes) exit code: $rc (124 = out of time: partial results)" \
        | tee -a "$RESULTS_DIR/pytest-full.txt"
    [ "$rc" -eq 1 ] && status=1
else
    echo "== [4] full-shape conformance skipped ($(left)s left)"
fi

echo "gpu_check: done in $(( $(date +%s) - T0 ))s, status $status; results in $RESULTS_DIR"
if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    cp -r "$RESULTS_DIR" "$OUT/"
fi
exit $status
