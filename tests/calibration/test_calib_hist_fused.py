"""CountAccumulator's compiled histogram pass (cpu_kernels/src/calib_hist.cpp) against its
torch path: identical histograms and ranges over random chunks with causal -inf masks, NaN
and +/-inf scores, values outside the histogram range, every placement / selection subset
and GQA group sizes 1-4; and the compiled pass is the one that runs."""

import zlib

import pytest
import torch

from topth_ops.calibration import CountAccumulator, hist_fast


def test_the_compiled_pass_is_built():
    """No skip: every install with a C++ compiler builds the CPU kernel module (the cpu
    backend's tests need it too); a module without calib_hist_add is a stale build."""
    assert hist_fast._module() is not None, "topth_ops.cpu_kernels._topth_cpu lacks calib_hist_add"


def _chunk(g, Hq, T, S, first_id, junk):
    """Scores [1, Hq, T, S] of rows first_id..first_id+T-1 (-inf at keys >= the row id),
    scaled so that some values fall outside the range the first chunk sets."""
    a = torch.randn(1, Hq, T, S, generator=g) * (1.0 + 4.0 * torch.rand(1, Hq, T, 1, generator=g))
    a = a + 3.0 * torch.randn(1, Hq, T, 1, generator=g)
    if junk:
        pick = torch.rand(a.shape, generator=g)
        a = torch.where(pick < 0.01, float("nan"), a)
        a = torch.where((pick >= 0.01) & (pick < 0.02), float("inf"), a)
        a = torch.where((pick >= 0.02) & (pick < 0.03), -float("inf"), a)
        a = torch.where((pick >= 0.03) & (pick < 0.04), a * 1e30, a)
    ids = torch.arange(first_id, first_id + T)
    a = a.masked_fill(torch.arange(S)[None, :] >= ids[:, None], float("-inf"))
    return a, ids.view(1, T)


def _run(fused, monkeypatch, Hq, Hkv, placements, selections, junk, seed):
    monkeypatch.setattr(hist_fast, "FUSED_CPU", fused)
    acc = CountAccumulator(2, Hq, Hkv, 600, [4, 16], placements, selections, bins=64, rows_per_octave=8)
    g = torch.Generator().manual_seed(seed)
    for layer in (0, 1):
        for first, T in ((1, 40), (41, 90), (131, 200), (331, 260)):
            a, n = _chunk(g, Hq, T, first + T - 1 + (layer * 7), first, junk)
            acc.record(layer, a, n)
    return acc


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2), (8, 2), (9, 3)])
@pytest.mark.parametrize("junk", [False, True])
@pytest.mark.parametrize("sets", ["all", "pre_head", "post_group", "post_both"])
def test_compiled_pass_equals_torch_path(monkeypatch, Hq, Hkv, junk, sets):
    placements = {"all": ("pre_softmax", "post_softmax"), "pre_head": ("pre_softmax",),
                  "post_group": ("post_softmax",), "post_both": ("post_softmax",)}[sets]
    selections = {"all": ("head", "group"), "pre_head": ("head",), "post_group": ("group",),
                  "post_both": ("head", "group")}[sets]
    seed = zlib.crc32(repr((Hq, junk, sets)).encode())
    ref = _run(False, monkeypatch, Hq, Hkv, placements, selections, junk, seed)
    got = _run(True, monkeypatch, Hq, Hkv, placements, selections, junk, seed)
    for key in ref.hist:
        assert ref.hist[key].sum() > 0, key
        assert torch.equal(got.range[key], ref.range[key]), key
        diff = (got.hist[key] - ref.hist[key]).abs()
        assert torch.equal(got.hist[key], ref.hist[key]), (key, int(diff.sum()), diff.nonzero()[:5].tolist())
    assert torch.equal(got.rows, ref.rows) and torch.equal(got.rows_per_id, ref.rows_per_id)


def test_the_compiled_pass_runs_after_a_layers_first_chunk(monkeypatch):
    """The torch path runs only for a layer's first chunk (it sets the ranges); every later
    chunk goes through the compiled pass (else the comparison above is torch against torch)."""
    monkeypatch.setattr(hist_fast, "FUSED_CPU", True)
    acc = CountAccumulator(1, 4, 2, 300, [4], bins=32, rows_per_octave=0)
    g = torch.Generator().manual_seed(0)
    calls = []
    orig = CountAccumulator._add
    monkeypatch.setattr(CountAccumulator, "_add", lambda self, *a: (calls.append(a[0]), orig(self, *a))[1])
    for first, T in ((1, 30), (31, 50), (81, 60)):
        a, n = _chunk(g, 4, T, first + T - 1, first, False)
        acc.record(0, a, n)
    assert len(calls) == 2  # both placements, first chunk only


@pytest.mark.parametrize("case", ["float64_lse", "broadcast_lse", "head_mismatch"])
def test_unusual_inputs_take_the_torch_path(monkeypatch, case):
    """A log-normaliser in float64 or broadcast over heads gives the torch path's bins; a
    chunk with another head count gets the torch path's error (never a compiled pass that
    reads past the accumulator's heads)."""
    g = torch.Generator().manual_seed(1)
    chunks = [_chunk(g, 4, T, f + T - 1, f, False) for f, T in ((1, 30), (31, 50))]
    got = []
    for fused in (False, True):
        monkeypatch.setattr(hist_fast, "FUSED_CPU", fused)
        acc = CountAccumulator(1, 4, 2, 300, [4], bins=256, rows_per_octave=0)
        for i, (a, n) in enumerate(chunks):
            if case == "head_mismatch" and i:
                with pytest.raises(RuntimeError):
                    acc.record(0, torch.cat([a, a], 1), n)
                continue
            x = a.double() if case == "float64_lse" else a
            m = x.amax(-1, keepdim=True)
            log_z = torch.log(torch.exp(x - m).sum(-1, keepdim=True))
            if case == "broadcast_lse":
                m, log_z = m[:, :1], log_z[:, :1]
            acc.record(0, a, n, m, log_z)
        got.append(acc)
    for key in got[0].hist:
        assert torch.equal(got[0].hist[key], got[1].hist[key]), key


def test_bins_are_bounded_and_huge_logits_do_not_break_the_range():
    with pytest.raises(ValueError, match=r"bins must be in \[8, 1048576\]"):
        CountAccumulator(1, 4, 2, 300, [4], bins=(1 << 24) + 4)
    acc = CountAccumulator(1, 4, 2, 300, [4], bins=64, rows_per_octave=0)
    a, n = _chunk(torch.Generator().manual_seed(2), 4, 20, 20, 1, False)
    a = torch.where(torch.isfinite(a), torch.full_like(a, 1e13), a)  # one huge value per head
    acc.record(0, a, n)
    acc.record(0, a, n)
    for key, h in acc.hist.items():
        assert int(h.sum()) > 0 and torch.isfinite(acc.range[key]).all(), key
