"""Calibration accumulators fed from an accelerator: chunks recorded from CUDA tensors give
the same thresholds and SDC table as the same chunks on the CPU (the accumulators keep
their state in host memory; before, CUDA row ids indexed CPU tensors and failed).

Runs only where CUDA is present (skipped otherwise: hardware absent)."""

import numpy as np
import pytest
import torch

from topth_ops.calibration import CalibrationResult, CountAccumulator, SdcAccumulator, ThresholdAccumulator, to_host

HQ, HKV, T = 4, 2, 64
DEVICE = "cuda"  # the device compared with the CPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (absent on this machine)")


def _rows(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(1, HQ, T, T, generator=g) * 2.0 + torch.randn(1, HQ, T, 1, generator=g)
    a = a.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return a, torch.arange(1, T + 1).view(1, T)


def _feed(acc, device):
    for s in range(2):
        a, n = _rows(s)
        for c0 in range(0, T, 24):
            acc.record(1, a[:, :, c0:c0 + 24].to(device), n[:, c0:c0 + 24].to(device))


def test_to_host_copies_to_the_cpu_and_keeps_none():
    x = torch.ones(2)
    h, none = to_host(x, None)
    assert none is None and h.device.type == "cpu" and torch.equal(h, x)


@cuda
@pytest.mark.parametrize("selection", ["head", "group"])
def test_count_accumulator_from_cuda_equals_cpu(selection):
    out = []
    for device in ("cpu", DEVICE):
        acc = CountAccumulator(2, HQ, HKV, T, [8], ["pre_softmax", "post_softmax"], [selection])
        _feed(acc, device)
        out.append([acc.result(p, selection, [0, 8])[0] for p in ("pre_softmax", "post_softmax")])
    for cpu_th, cuda_th in zip(*out):
        assert np.isfinite(cpu_th[1, :, 8:]).all()  # layer 1 is thresholded above k
        np.testing.assert_allclose(cuda_th, cpu_th, rtol=1e-4, atol=1e-4)  # equal infinities pass


@cuda
def test_mean_estimator_and_sdc_table_from_cuda_equal_cpu():
    res = []
    for device in ("cpu", DEVICE):
        acc = ThresholdAccumulator(2, HQ, T, [[0, 8]], ["pre_softmax"])
        _feed(acc, device)
        r = acc.result(0, "pre_softmax", 0.0)
        sdc = SdcAccumulator([CalibrationResult(thresholds=r.thresholds, counts=r.counts, layer_k=[0, 8],
                                                placement="pre_softmax", alpha=0.0)], num_q_heads=HQ)
        _feed(sdc, device)
        res.append((r.thresholds, sdc.finalize()[0].sdc_table))
    (th_c, sdc_c), (th_g, sdc_g) = res
    torch.testing.assert_close(th_g, th_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sdc_g, sdc_c, rtol=1e-5, atol=1e-5)
