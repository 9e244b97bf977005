"""bench/studies/length_extrapolation_dense.py: kept counts read off recorded histograms equal a
brute-force count (to within the values of the bin that holds theta), and the model comparison
runs on them; bench/studies/length_extrapolation.py: argument checks, row ranges, cache names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from topth_ops.bench.studies import length_extrapolation as lx
from topth_ops.bench.studies import length_extrapolation_dense as lxd
from topth_ops.calibration import CountAccumulator

L, HQ, HKV, T = 2, 4, 2, 256
KS = (16, 32, 64, 96)


def _acc_file(tmp_path, name, seed):
    acc = CountAccumulator(L, HQ, HKV, T, KS, ("pre_softmax", "post_softmax"), ("head", "group"), rows_per_octave=0)
    g = torch.Generator().manual_seed(seed)
    logits = []
    for _ in range(2):
        a = torch.randn(1, HQ, T, T, generator=g) * 2.0
        a = a.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        logits.append(a)
        for layer in range(L):
            acc.record(layer, a, torch.arange(1, T + 1).view(1, T))
    path = tmp_path / f"{name}.pt"
    lxd.save(acc, KS, path)
    return path, acc, logits


def test_counts_from_histograms_match_brute_force(tmp_path):
    path, acc, logits = _acc_file(tmp_path, "a", 0)
    back = lxd._load(str(path))
    b = int(np.searchsorted(back.edges, 200)) - 1  # the bucket holding row id 200
    lo, hi = int(back.edges[b]), int(back.edges[b + 1])
    theta = np.array([0.5, 1.0, 1.5, 2.0])
    got = lxd._above(back, "pre_softmax", "head", 1, b, theta)
    x = torch.cat([a[0, :, lo:hi, :] for a in logits], dim=1).double()  # [HQ, rows, T], rows n in (lo, hi]
    exact = sum(float((x[h] > theta[h]).sum()) for h in range(HQ))
    rng = back.range[("pre_softmax", "head")][1].numpy()
    in_bin = sum(float(((x[h] > theta[h] - rng[h, 1]) & (x[h] <= theta[h] + rng[h, 1])).sum()) for h in range(HQ))
    assert abs(got - exact) <= in_bin and exact > 0


def test_compare_prints_every_model_and_keeps_k_inside_the_calibration(tmp_path, capsys):
    pa, _, _ = _acc_file(tmp_path, "calib", 1)
    pb, _, _ = _acc_file(tmp_path, "held", 2)
    lxd.compare(str(pa), str(pb), 64, [(32, 64), (64, 128), (128, 256)], [16], first_layer=0)
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith(("pre_softmax", "post_softmax"))]
    assert len(rows) == 3 * len(lxd.MODELS)
    for line in rows:
        calib = [float(v) for v in line.split("calibration text")[1].split("|")[0].split()]
        assert abs(calib[0] - 1.0) < 0.02  # calibrated range, calibration text: k kept by construction
        assert all(0.2 < v < 5 for v in calib)
        held = [float(v) for v in line.split("| held-out ")[1].split("|")[0].split()]
        spread = line.split("held-out per layer ")[1].split()
        assert len(spread) == len(held)
        for agg, cell in zip(held, spread):  # a rows-weighted mean of the layers' own ratios lies within them
            lo, hi = (float(v) for v in cell.split(".."))
            assert lo - 0.005 <= agg <= hi + 0.005 and lo <= hi


def test_mean_takes_the_tokens_that_rows_in_the_range_predict():
    # nll[i] is the loss of the token position i predicts; row n sits at position n - 1
    nll = [torch.arange(8, dtype=torch.float64), torch.arange(8, dtype=torch.float64) + 100]
    assert lx._mean(nll, 2, 4) == (2 + 3 + 102 + 103) / 4  # rows 3, 4 -> positions 2, 3
    assert lx._mean(nll[:1], 4, 9) == (4 + 5 + 6 + 7) / 4  # row 9 (the last) predicts no token
    assert lx._ranges(1024) == [(512, 1024), (1024, 2048), (2048, 4096), (4096, 8192)]
    assert lx._ranges(4096) == [(2048, 4096), (4096, 8192)]


def _main_stopping_at_the_model(argv, tmp_path, monkeypatch, seen=None):
    """Run the study's main with the model load replaced by a RuntimeError (``seen`` gets
    the ``_setup`` arguments)."""

    def model(*a, **kw):
        if seen is not None:
            seen.append(a)
        raise RuntimeError("reached the model")

    monkeypatch.setattr(lx, "_setup", model)
    lx.main(argv + ["--cache", str(tmp_path)])


@pytest.mark.parametrize("argv", [["op", "--calib-tokens", "256"], ["op", "--k", "0"], ["op", "--k", "16", "1024"],
                                  ["dense", "--k", "-4"], ["dense", "--k", "1024"], ["dense", "--k", "48"],
                                  ["op", "--docs", "0"], ["op", "--samples", "1"],
                                  ["op", "--targets", "pre-group"]])
def test_argument_errors_come_before_the_model_loads(argv, tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        _main_stopping_at_the_model(argv, tmp_path, monkeypatch)


@pytest.mark.parametrize("argv", [["op"], ["op", "--calib-tokens", "512", "--k", "16", "96"], ["dense", "--k", "16"],
                                  ["op", "--model", "gemma3-270m", "--targets", "post-head", "post-group"],
                                  ["dense", "--model", "gemma3-270m"]])
def test_valid_arguments_reach_the_run(argv, tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="reached the model"):
        _main_stopping_at_the_model(argv, tmp_path, monkeypatch)


def test_layer_spread_takes_each_thresholded_layer_alone_and_skips_empty_ones():
    seen = []

    class Col:  # k~/k = layer / 10 in range (0, 8], no rows (NaN) for layer 3 anywhere and for range (8, 16]
        def k_tilde_over_k(self, layer_k, lo, hi):
            (layer,) = [i for i, k in enumerate(layer_k) if k != 0]
            seen.append((layer, layer_k[layer]))
            return (float("nan") if layer == 3 or lo == 8 else layer / 10), 1

    out = lx._layer_spread(Col(), [256, 256, 32, 32, 0, 32, 32], [(0, 8), (8, 16)])
    assert out == "0.20..0.60 -"
    assert sorted(set(seen)) == [(2, 32), (3, 32), (5, 32), (6, 32)]  # layers 0-1 and the dense layer 4 left out


@pytest.mark.parametrize("argv,model", [(["op"], None), (["dense"], None),
                                        (["op", "--model", "gemma3-270m", "--targets", "post-head"], "gemma3-270m"),
                                        (["dense", "--model", "/m/gemma-dir/"], "/m/gemma-dir/")])
def test_the_model_flag_reaches_the_model_load(argv, model, tmp_path, monkeypatch):
    seen = []
    with pytest.raises(RuntimeError, match="reached the model"):
        _main_stopping_at_the_model(argv, tmp_path, monkeypatch, seen)
    assert seen == [(2, model)]  # (--docs, --model)


@pytest.mark.parametrize("model,prefix", [(None, ""), ("smollm2-135m", ""), ("gemma3-270m", "gemma3-270m_"),
                                          ("/m/gemma-dir/", "gemma-dir_"), ("/m/gemma-dir", "gemma-dir_")])
def test_dense_cache_files_are_named_after_the_model(model, prefix, tmp_path):
    paths = lx._cache_paths(str(tmp_path), model)
    assert paths == {n: str(tmp_path / f"{prefix}{n}_8192.pt") for n in ("calib", "heldout")}
