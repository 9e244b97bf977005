#!/usr/bin/env bash
# One-shot GPU check for the Triton backend on one CUDA GPU (prepared for an H200), in the
# order that matters most if time runs out:
#   1. the kernel benchmark on the h200 cases: thresholded op vs the best dense kernel
#      importable (FlashInfer with and without tensor cores, flash-attn, SDPA) and our own
#      dense mode, plain and CUDA-graph timing, keep-fraction sweep and clustered keeps,
#      device copy bandwidth; every output checked before it is timed;
#   2. registers / spills of every compiled Triton variant as the driver reports them;
#   3. DRAM bytes read at f = 0.1 vs dense (only if Nsight Compute `ncu` is on the PATH);
#      3b. the K pass alone, a raw gather of the kept V rows and SDPA (bench/gpu_probe.py);
#   4. a short sweep of launch configs (bench/tune.py);
#   5. the CUDA conformance subset (tests/conformance -k triton, quick shapes) and the
#      Triton kernel tests, bf16 included, with the time left;
# writing everything under bench/results/<date>-<device>/ (override: RESULTS_DIR=...).
# When $OUT is set (the device-runner's output folder) the results are packed there too
# (gpu_results.tgz).
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

# time left of the 285 s budget (15 s margin under 5 minutes)
left() { echo $(( 285 - ($(date +%s) - T0) )); }

# 1. benchmark first: the numbers this script exists for
echo "== [1] benchmark (h200 cases)"
timeout -s INT 130 "$PY" -m topth_ops.bench --cases h200 --backends triton --out "$RESULTS_DIR" --budget-ms 50 \
    --check-targets \
    2>&1 | tee "$RESULTS_DIR/bench.txt" | tail -45
rc=${PIPESTATUS[0]}
echo "bench exit code: $rc (1 = a target missed or a variant wrong, 130 = out of time: partial rows written)" \
    | tee -a "$RESULTS_DIR/bench.txt"
[ "$rc" -ne 0 ] && status=1

# 2. registers and spills of the kernels the benchmark compiled (driver's numbers)
echo "== [2] compiled kernels: n_regs / n_spills"
timeout -s INT 40 "$PY" -m topth_ops.bench.gpu resources 2>&1 | tee "$RESULTS_DIR/kernels.txt" | tail -30
rc=${PIPESTATUS[0]}
[ "$rc" -ne 0 ] && { echo "kernel resources exit code $rc (1 = a kernel spills)"; status=1; }

# 3. DRAM bytes at f = 0.1 vs dense, if Nsight Compute is here
if command -v ncu >/dev/null 2>&1 && [ "$(left)" -gt 150 ]; then
    echo "== [3] ncu: DRAM bytes read per call"
    timeout -s INT 60 "$PY" -m topth_ops.bench.gpu ncu 2>&1 | tee "$RESULTS_DIR/ncu.txt" | tail -15
else
    echo "== [3] ncu skipped ($(command -v ncu >/dev/null 2>&1 && echo "$(left)s left" || echo "ncu not on the PATH"))" \
        | tee "$RESULTS_DIR/ncu.txt"
fi

# 3b. where the thresholded kernel's time goes: K pass alone, raw gather, SDPA (about 20 s)
if [ "$(left)" -gt 120 ]; then
    echo "== [3b] probe: K pass vs raw stream and gather"
    timeout -s INT 60 "$PY" -m topth_ops.bench.gpu_probe 2>&1 | tee "$RESULTS_DIR/probe.txt" | tail -12
else
    echo "== [3b] probe skipped ($(left)s left)" | tee "$RESULTS_DIR/probe.txt"
fi

# 4. launch-config sweep on the target shape (at most 45 s)
t=$(left)
if [ "$t" -gt 90 ]; then
    t=$(( t - 60 < 45 ? t - 60 : 45 ))
    echo "== [4] config sweep (${t}s)"
    timeout -s INT "$t" "$PY" -m topth_ops.bench.tune --out "$RESULTS_DIR" --seconds $(( t - 8 )) --budget-ms 30 \
        2>&1 | tee "$RESULTS_DIR/tune.txt" | tail -40
else
    echo "== [4] config sweep skipped ($(left)s left)" | tee "$RESULTS_DIR/tune.txt"
fi

# 5. correctness on the GPU last, bf16 included (the interpreter cannot run bf16): the
#    conformance suite on its quick shape set plus the Triton kernel tests, time permitting.
TESTS=(tests/backends/triton/test_triton_kernels.py tests/backends/triton/test_triton_v02.py
       tests/backends/triton/test_triton_inputs.py)
[ -d tests/conformance ] && TESTS=(tests/conformance "${TESTS[@]}")
t=$(left)
if "$PY" -c "import pytest" 2>/dev/null && [ "$t" -gt 20 ]; then
    echo "== [5] pytest -k triton ${TESTS[*]} (conformance quick shapes, ${t}s)"
    TOPTH_CONFORMANCE_SHAPES=quick timeout -s INT "$t" "$PY" -m pytest -q -x -p no:cacheprovider -k triton \
        "${TESTS[@]}" --junitxml="$RESULTS_DIR/pytest.xml" 2>&1 | tee "$RESULTS_DIR/pytest.txt" | tail -25
    rc=${PIPESTATUS[0]}
    echo "pytest exit code: $rc (124 = out of time: partial results)" | tee -a "$RESULTS_DIR/pytest.txt"
    [ "$rc" -eq 1 ] && status=1
else
    echo "== [5] tests skipped (pytest missing or $(left)s left)" | tee "$RESULTS_DIR/pytest.txt"
fi
# 6. calibration accumulators fed from CUDA tensors (a few seconds)
if "$PY" -c "import pytest" 2>/dev/null && [ "$(left)" -gt 10 ]; then
    echo "== [6] pytest tests/calibration/test_calibration_device.py"
    timeout -s INT "$(left)" "$PY" -m pytest -q -p no:cacheprovider tests/calibration/test_calibration_device.py 2>&1 \
        | tee "$RESULTS_DIR/pytest_calibration_device.txt" | tail -5
    [ "${PIPESTATUS[0]}" -eq 1 ] && status=1
fi

echo "gpu_check: done in $(( $(date +%s) - T0 ))s, status $status; results in $RESULTS_DIR"
if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    # one archive: the device runner returns at most 8 files
    tar czf "$OUT/gpu_results.tgz" -C "$(dirname "$RESULTS_DIR")" "$(basename "$RESULTS_DIR")"
fi
exit $status
