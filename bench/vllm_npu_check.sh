#!/usr/bin/env bash
# vLLM-Ascend backend on one Ascend NPU (UNTESTED: no NPU or CANN has been available).
# Needs CANN, torch_npu and vLLM-Ascend for vLLM 0.32 next to topth-ops:
#   pip install vllm==0.32.0 vllm-ascend  (versions as vLLM-Ascend documents for 0.32)
#   pip install -e ".[hf]"
# The plugin wraps vLLM-Ascend's NPUPlatform.get_attn_backend_cls so that it returns the
# Top-Theta backend while TOPTH_VLLM_* / additional_config['topth'] are set. The decode op
# runs the `ascendc` backend when its kernel is built (docs/ascendc.md), else `torch`.
# Known risk: vLLM-Ascend may allocate its KV cache in its own shape instead of asking the
# backend for the LBNHC layout; the backend then refuses the cache shape at the first step.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/vllm_npu}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
python -c "import torch, torch_npu, vllm; assert torch.npu.is_available(), 'no NPU'; print('vllm', vllm.__version__)"
[ -f "$OUT/smol-hf/config.json" ] || topth-ops export-hf "$OUT/smol-hf" --quiet
[ -f "$OUT/th_k16_post.safetensors" ] || topth-ops calibrate --k 16 --placement post_softmax --out "$OUT/th_k16_post.safetensors" --quiet
python -m topth_ops.bench.vllm_check --model "$OUT/smol-hf" --thresholds "$OUT/th_k16_post.safetensors" \
    --prompts 16 --max-tokens 64 --json "$OUT/vllm_check.json"
python -m topth_ops.bench.vllm_serve_load --model "$OUT/smol-hf" --thresholds "$OUT/th_k16_post.safetensors" \
    --requests 32 --json "$OUT/vllm_serve_load.json"
echo "results in $OUT"
