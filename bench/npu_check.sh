#!/usr/bin/env bash
# One-shot Ascend check for the ascendc backend on one NPU (Atlas A2 / Ascend 910B), the
# twin of bench/gpu_check.sh:
#   1. the conformance suite on the NPU: topth-ops conformance --backend ascendc
#      (every rule, fp16/bf16/fp32, the contract's full shape set, paged caches, group
#      selection, threshold sets), JSON saved, on the default path (the cube path's mix
#      kernel for fp16/bf16, the all-vector kernel for fp32) and again with
#      TOPTH_ASCENDC_PATH=vector (the all-vector kernel on every dtype); then the kept sets
#      on inputs planted with a wide margin around every threshold (bench/studies/npu_margin.py),
#      compared exactly;
#   2. the kernel benchmark on the issue-5 target cases (bench/cases.py, set "npu"):
#      each case checked against the torch reference on the NPU (output, stats, V rows =
#      planted kept-union), then timed with NPU events against the dense baselines
#      (torch_npu.npu_incre_flash_attention = "npu-ifa", and SDPA), with the device copy
#      bandwidth; the summary says whether f = 0.1 reaches 1.5x over IFA (default path;
#      BENCH_VECTOR_PATH=1 also times the all-vector kernel, into bench-vector/);
# writing everything under bench/results/<date>-<device>/ (override: RESULTS_DIR=...).
# When $OUT is set (a device-runner's output folder) the results are copied there too.
# Not run yet: no Ascend machine was available to this project (docs/ascendc.md).
#
# Requirements: CANN >= 8.0 (set_env.sh sourced, or found at its default place), torch +
# the matching torch_npu, pytest not needed. If the NPU extension is not built yet, this
# installs the checkout with `pip install --no-build-isolation -e .` (builds it with CANN).
#
# Usage (from the repository root, on the Ascend machine):  bash bench/npu_check.sh
# Time: a few minutes per conformance run (two: default path and all-vector), a few more for the benchmark (15 cases,
# 32k context); each step has its own timeout (CONFORMANCE_TIMEOUT, BENCH_TIMEOUT seconds).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
T0=$(date +%s)

if [ -z "${ASCEND_HOME_PATH:-}" ] && [ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]; then
    # shellcheck disable=SC1091
    source /usr/local/Ascend/ascend-toolkit/set_env.sh
fi
if ! "$PY" -c "import torch, torch_npu, sys; sys.exit(0 if torch.npu.is_available() else 1)"; then
    echo "npu_check: torch_npu is missing or sees no Ascend NPU ($PY); nothing to do" >&2
    exit 2
fi
if ! "$PY" -c "import topth_ops.bench; from topth_ops.npu_kernels import _ascendc_npu" 2>/dev/null; then
    if [ -z "${ASCEND_HOME_PATH:-}" ]; then
        echo "npu_check: the NPU extension is not built and ASCEND_HOME_PATH is not set (source set_env.sh)" >&2
        exit 2
    fi
    echo "npu_check: building the NPU extension: TOPTH_BUILD_NPU=required pip install --no-build-isolation -e ."
    # required: a failed NPU build fails the install (by default it is only a warning)
    TOPTH_BUILD_NPU=required "$PY" -m pip install -q --no-deps --no-build-isolation -e . || {
        echo "npu_check: cannot build/install topth-ops from this checkout" >&2; exit 2; }
fi
"$PY" -m topth_ops info || true

DEV=$("$PY" -c "import torch, torch_npu; print(torch.npu.get_device_name(0).replace(' ', '-'))")
RESULTS_DIR=${RESULTS_DIR:-bench/results/$(date +%F)-$DEV}
mkdir -p "$RESULTS_DIR"
echo "npu_check: results in $RESULTS_DIR"

{
    date -u +%FT%TZ
    npu-smi info 2>&1 | head -20
    "$PY" -c "import torch, torch_npu; print('torch', torch.__version__, '| torch_npu', torch_npu.__version__)"
    for f in "${ASCEND_HOME_PATH:-/nonexistent}/version.cfg" "${ASCEND_HOME_PATH:-/nonexistent}/compiler/version.info"; do
        [ -f "$f" ] && { echo "== $f"; head -5 "$f"; }
    done
    echo "TOPTH_SOC_VERSION=${TOPTH_SOC_VERSION:-} TOPTH_ASCENDC_PATH=${TOPTH_ASCENDC_PATH:-auto}"
    git rev-parse HEAD 2>/dev/null || true
    git status --short 2>/dev/null | head -20 || true
} > "$RESULTS_DIR/env.txt" 2>&1
cat "$RESULTS_DIR/env.txt"

status=0

# 1. correctness on the NPU: every conformance rule x dtype
echo "== [1] topth-ops conformance --backend ascendc"
timeout -s INT "${CONFORMANCE_TIMEOUT:-900}" "$PY" -m topth_ops conformance --backend ascendc \
    --json "$RESULTS_DIR/conformance.json" 2>&1 | tee "$RESULTS_DIR/conformance.txt" | tail -40
rc=${PIPESTATUS[0]}
echo "conformance exit code: $rc (124 = out of time)" | tee -a "$RESULTS_DIR/conformance.txt"
[ "$rc" -ne 0 ] && status=1

# 1a. the same with the all-vector kernel for every dtype (the default runs the cube path's
# mix kernel for fp16 / bf16): both kernels are checked on the device
echo "== [1a] TOPTH_ASCENDC_PATH=vector topth-ops conformance --backend ascendc"
TOPTH_ASCENDC_PATH=vector timeout -s INT "${CONFORMANCE_TIMEOUT:-900}" "$PY" -m topth_ops conformance \
    --backend ascendc --json "$RESULTS_DIR/conformance-vector.json" 2>&1 \
    | tee "$RESULTS_DIR/conformance-vector.txt" | tail -40
rc=${PIPESTATUS[0]}
echo "conformance (all-vector kernel) exit code: $rc (124 = out of time)" | tee -a "$RESULTS_DIR/conformance-vector.txt"
[ "$rc" -ne 0 ] && status=1

# 1b. kept sets on the NPU with inputs planted at a wide margin: the conformance suite's
# guard band (2e-4) is meant for CPU float32 against a float64 oracle; the device's Exp / Ln
# round differently, so a kept / v_rows mismatch in [1] can be rounding. This check plants
# every score >= 0.5 nat away from its threshold (head and group selection, threshold
# sets, BNSD and paged NHD / HND caches) and compares kept / v_rows exactly.
echo "== [1b] kept sets with planted margins: python -m topth_ops.bench.studies.npu_margin"
timeout -s INT "${MARGIN_TIMEOUT:-600}" "$PY" -m topth_ops.bench.studies.npu_margin --backend ascendc --device npu \
    2>&1 | tee "$RESULTS_DIR/margin.txt" | tail -20
rc=${PIPESTATUS[0]}
echo "margin check exit code: $rc" | tee -a "$RESULTS_DIR/margin.txt"
[ "$rc" -ne 0 ] && status=1

# 2. benchmark: the npu cases, the ascendc backend and the dense baselines (IFA included)
echo "== [2] benchmark (npu cases)"
timeout -s INT "${BENCH_TIMEOUT:-1200}" "$PY" -m topth_ops.bench --device npu --cases npu --backends ascendc \
    --out "$RESULTS_DIR" 2>&1 | tee "$RESULTS_DIR/bench.txt" | tail -45
rc=${PIPESTATUS[0]}
echo "bench exit code: $rc (1 = a variant wrong or failing, 124/130 = out of time: partial results)" \
    | tee -a "$RESULTS_DIR/bench.txt"
[ "$rc" -ne 0 ] && status=1

# 2b. optional: the all-vector kernel on the same cases (how much the cube path gains)
if [ "${BENCH_VECTOR_PATH:-0}" = "1" ]; then
    echo "== [2b] benchmark, TOPTH_ASCENDC_PATH=vector"
    mkdir -p "$RESULTS_DIR/bench-vector"
    TOPTH_ASCENDC_PATH=vector timeout -s INT "${BENCH_TIMEOUT:-1200}" "$PY" -m topth_ops.bench --device npu \
        --cases npu --backends ascendc --out "$RESULTS_DIR/bench-vector" 2>&1 \
        | tee "$RESULTS_DIR/bench-vector.txt" | tail -45
    rc=${PIPESTATUS[0]}
    echo "bench (all-vector kernel) exit code: $rc" | tee -a "$RESULTS_DIR/bench-vector.txt"
    [ "$rc" -ne 0 ] && status=1
fi

echo "npu_check: done in $(( $(date +%s) - T0 ))s, status $status; results in $RESULTS_DIR"
if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    cp -r "$RESULTS_DIR" "$OUT/"
fi
exit $status
