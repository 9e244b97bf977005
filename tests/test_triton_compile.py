"""GPU compile check without a GPU: every launch of decode_attn_fwd used by the contract
(pre/post-softmax, dense, every SDC mode, VMC with and without value_mean, fp16/bf16/fp32,
head_dim 64/80/96/128/256) is compiled ahead of time for sm_90 (H100/H200) by Triton and
ptxas, in a subprocess without TRITON_INTERPRET. The CPU interpreter cannot catch
GPU-only compile errors; this does (it does not run the kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "topth_ops.cuda_kernels.aot_check", "--arch", "90"],
                          capture_output=True, text=True, env=env, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    by = {(r["case"], r["kernel"]): r for r in rows}
    assert len(rows) == 16 and all(r["status"] == "ok" for r in rows)
    main = by[("target-pre-bf16", "_decode_attn_kernel")]
    # tensor cores for q k^T and for the two-term p v product (bf16 inputs, fp32 accumulation)
    assert main["mma_types"] == ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"]
    assert main["mma"] >= 3 * 16
    assert main["cp_async"] > 0  # K tiles are software-pipelined
    assert main["predicated_ld_global"] > 0  # V rows: predicated (masked) loads
    dense = by[("target-dense-bf16", "_decode_attn_kernel")]
    assert dense["cp_async"] > main["cp_async"]  # dense mode pipelines V as well
    fp32 = by[("post-vmc-fp32-d96", "_decode_post_select_kernel")]
    assert fp32["mma"] == 0  # fp32 inputs: exact fp32 dot, no TF32 tensor cores
