"""bench/gpu_probe.py runs end to end (tiny shape; Triton's interpreter without a GPU) and
its gather kernel's check against torch holds; the timings themselves are GPU-only."""

from __future__ import annotations

import pytest
import torch

from topth_ops.bench import gpu_probe


def test_probe_small_runs(capsys):
    assert gpu_probe.main(["--small", "--budget-ms", "5"]) == 0
    out = capsys.readouterr().out
    for name in ("stream K", "gather V f=0.1", "ours keep none", "ours f=0.1", "ours dense mode", "torch SDPA"):
        assert name in out


def test_rows_sum_refuses_a_wrong_gather(monkeypatch):
    x = torch.randn(40, 16)
    idx = torch.arange(0, 40, 3, dtype=torch.int32)
    gpu_probe.rows_sum(x, idx, block=8)  # right: passes its own check
    real = gpu_probe._rows_sum_kernel

    class Broken:  # leaves out the last listed row
        def __getitem__(self, grid):
            def launch(X, IDX, OUT, n, D, BLOCK, num_warps):
                real[grid](X, IDX, OUT, n - 1, D=D, BLOCK=BLOCK, num_warps=num_warps)
            return launch

    monkeypatch.setattr(gpu_probe, "_rows_sum_kernel", Broken())
    with pytest.raises(RuntimeError, match="gather is wrong"):
        gpu_probe.rows_sum(x, idx, block=8)


def test_probe_refuses_full_shape_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the full shape is the probe's job there")
    assert gpu_probe.main([]) == 2
