#!/usr/bin/env bash
# vLLM-Ascend backend on one Ascend NPU (UNTESTED: no NPU or CANN has been available).
# Needs CANN, torch_npu and vLLM-Ascend for vLLM 0.32 next to topth-ops:
#   pip install vllm==0.32.0 vllm-ascend  (versions as vLLM-Ascend documents for 0.32)
#   pip install -e ".[hf]"
# The plugin wraps vLLM-Ascend's NPUPlatform.get_attn_backend_cls so that it returns a
# subclass of vLLM-Ascend's AscendAttentionBackend (topth_ops/vllm/ascend_backend.py) while
# TOPTH_VLLM_* / additional_config['topth'] are set: vLLM-Ascend's cache, writes and kernels,
# decode rows of decode-only steps through the op. The op runs the `ascendc` backend when
# its kernel is built (docs/ascendc.md), else `torch`. Written against vLLM-Ascend's sources
# (2026-08 main); its interfaces may differ in the release that pairs with vLLM 0.32.
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
