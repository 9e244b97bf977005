#!/usr/bin/env bash
# vLLM backend on one CUDA GPU (UNTESTED: no GPU has been available to this project).
# Needs vLLM's CUDA build next to topth-ops:
#   pip install vllm==0.32.0 && pip install -e ".[hf,triton]"
# The plugin overrides vLLM's FLASH_ATTN and TRITON_ATTN backends with subclasses that send
# only thresholded decode rows to the op (topth_ops/vllm/gpu_backend.py); the scripts below
# pass --attention-backend FLASH_ATTN (bench/vllm_common.py, topth-ops serve) on CUDA.
# TOPTH_BENCH_ATTN_BACKEND=TRITON_ATTN (or CUSTOM, the generic backend) runs vllm_check with another.
# Runs: export-hf, calibrate k=16 post-softmax, -inf vs vLLM's own attention and the file
# vs transformers (bench/vllm_check.py), then 32 concurrent requests through the server.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/vllm_gpu}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
python -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device'; print('vllm', vllm.__version__, torch.cuda.get_device_name())"
[ -f "$OUT/smol-hf/config.json" ] || topth-ops export-hf "$OUT/smol-hf" --quiet
[ -f "$OUT/th_k16_post.safetensors" ] || topth-ops calibrate --k 16 --placement post_softmax --out "$OUT/th_k16_post.safetensors" --quiet
python -m topth_ops.bench.vllm_check --model "$OUT/smol-hf" --thresholds "$OUT/th_k16_post.safetensors" \
    --prompts 16 --max-tokens 64 --json "$OUT/vllm_check.json"
python -m topth_ops.bench.vllm_serve_load --model "$OUT/smol-hf" --thresholds "$OUT/th_k16_post.safetensors" \
    --requests 32 --json "$OUT/vllm_serve_load.json"
echo "results in $OUT"
