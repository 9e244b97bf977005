"""Dense-activation half of :mod:`topth_ops.bench.studies.length_extrapolation`: record
kept-count histograms of long rows once, then judge each length model on them (no model run
per candidate)."""

from __future__ import annotations

import numpy as np

MODELS = (("theta constant", None), ("log log(n / k)", "log_log_n_over_k"), ("-k / n", "inverse_n_over_k"),
          ("log(1 - k / n)", "log_one_minus_k_over_n"))
TARGETS = (("pre_softmax", "head"), ("post_softmax", "head"), ("post_softmax", "group"))
PLACEMENTS, SELECTIONS = ("pre_softmax", "post_softmax"), ("head", "group")


def collect(model, seqs, ks, path) -> None:
    """One dense forward pass per sequence; save the CountAccumulator's histograms to ``path``."""
    from topth_ops.calibration import CountAccumulator
    from topth_ops.hf.attention import TopthSettings
    from topth_ops.hf.calibrate import run_calibration_pass

    c = model.config
    T = max(int(s.numel()) for s in seqs)
    acc = CountAccumulator(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, T, ks,
                           PLACEMENTS, SELECTIONS)
    run_calibration_pass(model, seqs, TopthSettings(mode="dense"),
                         lambda layer, a, n, m, lz: acc.record(layer, a, n, m, lz), "record", False)
    save(acc, ks, path)


def save(acc, ks, path) -> None:
    """Write the histograms of ``acc`` (recorded with both placements and selections for
    ``ks``) to ``path``, as :func:`_load` reads them."""
    import torch

    torch.save({"shape": (acc.L, acc.Hq, acc.Hkv, acc.max_row_id), "ks": list(ks), "hist": acc.hist,
                "range": acc.range, "rows": acc.rows, "log_n": acc.log_n}, path)


def _load(path):
    import torch

    from topth_ops.calibration import CountAccumulator

    d = torch.load(path, weights_only=False)
    acc = CountAccumulator(*d["shape"], d["ks"], PLACEMENTS, SELECTIONS)
    acc.hist, acc.range, acc.rows, acc.log_n = d["hist"], d["range"], d["rows"], d["log_n"]
    return acc


def _above(acc, p, s, layer, b, theta) -> float:
    """Values above theta (domain values, one per head) in bucket b, all heads (uniform within a bin)."""
    hist = acc.hist[(p, s)][layer, :, b].numpy().astype(np.float64)
    rng = acc.range[(p, s)][layer].numpy()
    pos = (theta - rng[:, 0]) / rng[:, 1]
    total = 0.0
    for h in range(hist.shape[0]):
        i = int(np.floor(pos[h]))
        if i < 0:
            total += hist[h].sum()
        elif i < hist.shape[1]:
            total += hist[h, i + 1:].sum() + hist[h, i] * (i + 1 - pos[h])
    return total


def spread(values) -> str:
    """``min..max`` of the finite values (``-`` when there are none)."""
    r = [float(x) for x in values if np.isfinite(x)]
    return f"{min(r):.2f}..{max(r):.2f}" if r else "-"


def compare(calib_path, held_path, t, ranges, ks, first_layer: int = 2) -> None:
    """Print k~/k by row range (calibration text | held-out) of each length model, fitted on row ids <= t."""
    from topth_ops.thresholds import LengthModel, fit_length_model

    A, B = _load(calib_path), _load(held_path)
    edges = A.edges
    print(f"== calibrated row ids <= {t}; k~/k by row range {' '.join(f'({lo},{hi}]' for lo, hi in ranges)}")
    for p, s in TARGETS:
        dom = "logit" if p == "pre_softmax" else "log_prob"
        for k in ks:
            for name, feature in MODELS:
                tot = {"calib": np.zeros((len(ranges), 2)), "held": np.zeros((len(ranges), 2))}
                per_layer = []  # held-out k~/k per range of each layer
                for layer in range(first_layer, A.L):
                    mine = np.zeros((len(ranges), 2))
                    cen, vals, rows, usable = A.bucket_thetas(p, s, layer, k)
                    cal = usable & (edges[1:] <= t)
                    x = feature or "log_n"  # theta constant: any feature, slope 0
                    fit = np.array([fit_length_model(cen[cal], v[cal], rows[cal], k, dom, feature=x) for v in vals])
                    slope = fit[:, 2] if feature else np.zeros(len(fit))
                    model = LengthModel(dom, fit[None, :, 0], fit[None, :, 1], slope[None], x, np.array([k]))
                    with np.errstate(invalid="ignore", divide="ignore"):  # buckets without rows: NaN, unused
                        theta = np.where(edges[1:] <= t, vals, model.value(cen)[0])  # domain values [H, buckets]
                    for b in np.flatnonzero(usable):
                        ri = [i for i, (lo, hi) in enumerate(ranges) if edges[b] >= lo and edges[b + 1] <= hi]
                        if not ri:
                            continue
                        for key, acc in (("calib", A), ("held", B)):
                            r = float(acc.rows[layer, b])
                            if r:
                                got = (_above(acc, p, s, layer, b, theta[:, b]), k * r * vals.shape[0])
                                tot[key][ri[0]] += got
                                if key == "held":
                                    mine[ri[0]] += got
                    per_layer.append(mine[:, 0] / np.where(mine[:, 1] > 0, mine[:, 1], np.nan))
                f = {key: " ".join(f"{x:.2f}" for x in v[:, 0] / np.maximum(v[:, 1], 1)) for key, v in tot.items()}
                by_layer = " ".join(spread(c) for c in np.array(per_layer).T)
                print(f"{p} {s} k={k:<3d} {name:15s} calibration text {f['calib']} | held-out {f['held']} "
                      f"| held-out per layer {by_layer}", flush=True)
