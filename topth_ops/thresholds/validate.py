"""Checks of a threshold set (what saving and loading both require) and the extension of
its tables beyond the calibrated row ids by the length model."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..contract import PLACEMENTS, SELECTIONS
from ..validation import dtype_str
from .format import ESTIMATORS, MAX_ROW_IDS, ThresholdFileError, describe_config
from .layer_k import DENSE
from .length_model import DOMAINS, FEATURES, LengthModel

_LOG_F32_MAX = float(np.log(np.finfo(np.float32).max))


def is_layer_k(layer_k, num_layers: int) -> bool:
    """Whether ``layer_k`` is a list or tuple of ``num_layers`` integers >= 0 (0 = dense
    layer; bools are not integers here): the layer-k map a threshold set must hold."""
    return isinstance(layer_k, (list, tuple)) and len(layer_k) == num_layers and all(
        isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in layer_k)


def extend_table(stored: torch.Tensor, model: Optional[LengthModel], extend_to: int) -> torch.Tensor:
    """Table ``[L, H, extend_to]`` float32: the stored columns, then the length model.

    Parameters
    ----------
    stored : torch.Tensor
        ``[L, H, R_cal]`` float32.
    model : LengthModel or None
        Required when ``extend_to > R_cal``.
    extend_to : int
        >= R_cal.
    """
    Rc = stored.shape[-1]
    if extend_to <= Rc:
        return stored[..., :extend_to]
    if model is None:
        raise ValueError(f"extending a table of {Rc} row ids to {extend_to} needs a length model")
    n = np.arange(Rc + 1, extend_to + 1, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # a bad model's overflow: validate_set names it
        ext = torch.from_numpy(model.theta(n).astype(np.float32))
    return torch.cat([stored.to(torch.float32), ext], dim=-1)


def extend_sdc(stored: torch.Tensor, model: LengthModel, extend_to: int) -> torch.Tensor:
    """SDC table extension: like :func:`extend_table`, but dense entries (NaN model: -inf)
    are 0; +inf (an overflowing model) stays, for :func:`validate_set` to refuse."""
    t = extend_table(stored, model, extend_to)
    return torch.where(torch.isneginf(t), torch.zeros_like(t), t)


def _check_model_values(m: LengthModel, name: str, layer_k, Rc: int, R: int, bad) -> None:
    """A length model's numbers, per (layer, head) of a thresholded layer: anchor_n above
    k (k features; log n: above 0) and at most the calibrated row ids ``Rc``, anchor_value
    and slope finite (or the marker of a head without calibrated rows: anchor_n and
    anchor_value NaN, slope 0; the SDC model's anchor_value may be -inf: no dropped mass);
    and over the row ids it extends to (``Rc + 1 .. R``) finite values: logit thresholds
    within +-1e4 (a scaled logit beyond it has softmax weight 0 in any float format, so it
    cannot be a real threshold), log probabilities above -87 (exp(v) > 0 in float32; above
    0 theta is capped at probability 1, as fitted lines of peaked heads do), an SDC log
    dropped mass below log(float32 max) = 88.72. No tighter upper bounds: lines fitted by
    earlier laws overshoot (log p up to 2.7, dropped mass up to 3 n on tiny models'
    near-uniform heads) and their files still load. ``bad(msg)`` raises."""
    an, av, sl = (np.asarray(a, dtype=np.float64) for a in (m.anchor_n, m.anchor_value, m.slope))
    for layer, k in enumerate(layer_k):  # x(anchor) must be finite: n > k (k features), n > 0 (log n)
        low = k if m.feature != "log_n" else 0
        if k != DENSE and bool((np.isfinite(an[layer]) & (an[layer] <= low)).any()):
            bad(f"{name!r} layer {layer}: anchor row ids must exceed {'k=' + str(k) if low else 0} "
                f"(feature {m.feature!r}), got {an[layer].min():g}")
    on = np.broadcast_to(np.array([k != DENSE for k in layer_k])[:, None], an.shape)
    marker = np.isnan(an) & np.isnan(av) & (sl == 0)
    value_ok = np.isfinite(av) | (np.isneginf(av) if m.domain == "log" else False)
    good = marker | (np.isfinite(an) & np.isfinite(sl) & value_ok & (an <= Rc * (1 + 1e-9)))
    if not good[on].all():
        layer, head = (int(i) for i in np.argwhere(on & ~good)[0])
        bad(f"{name!r} layer {layer} head {head}: anchor_n, anchor_value and slope must be finite with anchor_n "
            f"<= the {Rc} calibrated row ids (or anchor_n and anchor_value NaN with slope 0: no calibrated rows), "
            f"got {float(an[layer, head])!r}, {float(av[layer, head])!r}, {float(sl[layer, head])!r}")
    if R <= Rc:
        return
    n = np.arange(Rc + 1, R + 1, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        v = m.value(n)
    live = np.broadcast_to((on & ~marker & np.isfinite(av))[..., None], v.shape)
    if m.domain == "logit":
        ok, what = np.isfinite(v) & (np.abs(v) <= 1e4), "thresholds within +-1e4"
    elif m.domain == "log_prob":  # above 0 (probability 1) theta is capped at 1, as documented
        ok, what = np.isfinite(v) & (v > -87.0), "log probabilities above -87 (float32 probabilities > 0)"
    else:  # exp(v) must stay a float32 number: +inf was read as no compensation
        ok, what = np.isfinite(v) & (v < _LOG_F32_MAX), "a log dropped mass below 88.72 (float32 range)"
    if not ok[live].all():
        layer, head, c = (int(i) for i in np.argwhere(live & ~ok)[0])
        bad(f"{name!r} layer {layer} head {head}: the model must give {what} on the row ids it extends to "
            f"({Rc + 1}..{R}), got {v[layer, head, c]:.6g} at row id {Rc + 1 + c}")


def validate_set(ts, *, where: str) -> None:
    """Check a threshold set's fields, tensor dtypes and shapes, and values.

    Parameters
    ----------
    ts : ThresholdSet
    where : str
        Prefix of the error message (the file or the set being saved).

    Raises
    ------
    ThresholdFileError
        Unknown placement, selection or estimator; a tensor whose dtype or shape does not
        match the recorded attention config; negative sample counts; a bad ``layer_k``;
        NaN or +inf thresholds, post_softmax thresholds outside [0, 1], pre_softmax ones
        beyond +-1e4, finite thresholds in dense rows, more than MAX_ROW_IDS row ids; a
        length model of the wrong shape, domain (pre_softmax: logit, post_softmax:
        log_prob) or feature, with numbers :func:`_check_model_values` refuses, or columns
        beyond the calibrated row ids that do not follow it; an SDC table with
        post_softmax, of the wrong shape, negative or not finite.
    """
    def bad(msg):
        raise ThresholdFileError(f"{where}: {msg}")

    cfg = ts.attention_config
    if ts.placement not in PLACEMENTS:
        bad(f"placement must be one of {PLACEMENTS}, got {ts.placement!r}")
    if ts.selection not in SELECTIONS:
        bad(f"selection must be one of {SELECTIONS}, got {ts.selection!r}")
    if ts.estimator not in ESTIMATORS:
        bad(f"estimator must be one of {ESTIMATORS}, got {ts.estimator!r}")
    th, counts, sdc = ts.thresholds, ts.counts, ts.sdc_table
    H_name = "num_q_heads" if ts.selection == "head" else "num_kv_heads"
    if th.dtype != torch.float32 or th.dim() != 3:
        bad(f"'thresholds' must be float32 [num_layers, {H_name}, max_row_id], got "
            f"{dtype_str(th.dtype)} {list(th.shape)}")
    L, H, R = th.shape
    if L != cfg["num_layers"] or H != cfg[H_name] or R < 1:
        bad(f"'thresholds' shape {list(th.shape)} does not match the recorded attention config "
            f"({describe_config(cfg)}) with selection {ts.selection!r} ([num_layers, {H_name}, max_row_id >= 1])")
    if counts.dtype != torch.int64 or counts.dim() != 3 or tuple(counts.shape[:2]) != (L, H) \
            or not 1 <= counts.shape[2] <= R:
        bad(f"'sample_counts' must be int64 [{L}, {H}, R_cal] with 1 <= R_cal <= {R}, got "
            f"{dtype_str(counts.dtype)} {list(counts.shape)}")
    Rc = counts.shape[2]
    if bool((counts < 0).any()):
        bad("'sample_counts' has negative entries")
    if not is_layer_k(ts.layer_k, L):
        bad(f"'layer_k' must list {L} integers >= 0 (0 = dense layer), got {ts.layer_k!r}")
    for name, m, heads in (("length_model", ts.length_model, H), ("sdc_length_model", ts.sdc_length_model,
                                                                    cfg["num_q_heads"])):
        if m is None:
            continue
        if any(np.shape(a) != (L, heads) for a in (m.anchor_n, m.anchor_value, m.slope)):
            bad(f"{name!r} arrays must have shape [{L}, {heads}]")
        want = DOMAINS[ts.placement] if name == "length_model" else "log"
        if m.domain != want:
            why = f" with {ts.placement} thresholds" if name == "length_model" else ""
            bad(f"{name!r} domain must be {want!r}{why}, got {m.domain!r}")
        if m.feature not in FEATURES:
            bad(f"{name!r} feature must be one of {FEATURES}, got {m.feature!r}")
        model_k = None if m.k is None else [int(v) for v in np.ravel(m.k)]
        if m.feature != "log_n" and model_k != list(ts.layer_k):
            bad(f"{name!r} feature {m.feature!r} needs k per layer equal to the set's layer_k {list(ts.layer_k)}, "
                f"got {model_k}")
        _check_model_values(m, name, ts.layer_k, Rc, R, bad)
    if bool(torch.isnan(th).any()):
        bad("'thresholds' contains NaN")
    if bool((th == float("inf")).any()):
        bad("'thresholds' contains +inf")
    finite = th[torch.isfinite(th)]
    if ts.placement == "post_softmax" and finite.numel() and bool(((finite < 0) | (finite > 1)).any()):
        bad("post_softmax thresholds (probabilities) must lie in [0, 1] or be -inf")
    if ts.placement == "pre_softmax" and finite.numel() and bool((finite.abs() > 1e4).any()):
        bad("pre_softmax thresholds (scaled logits) must lie within +-1e4 or be -inf")
    if R > max(MAX_ROW_IDS, Rc):
        bad(f"'thresholds' has {R} row ids; at most {MAX_ROW_IDS} (MAX_ROW_IDS) are allowed")
    for layer, k in enumerate(ts.layer_k):
        dense_cols = R if k == DENSE else min(k, R)
        if dense_cols and bool(torch.isfinite(th[layer, :, :dense_cols]).any()):
            what = "a dense layer" if k == DENSE else f"rows with n <= k={k}"
            bad(f"layer {layer}: {what} must hold -inf thresholds")
    if R > Rc:
        if ts.length_model is None:
            bad(f"'thresholds' has {R} row ids but only {Rc} are calibrated, and there is no length model")
        if not torch.equal(th, extend_table(th[..., :Rc], ts.length_model, R)):
            bad(f"'thresholds' beyond the {Rc} calibrated row ids must follow the length model")
    if sdc is not None:
        if ts.placement != "pre_softmax":
            bad("an sdc_table is only valid with pre_softmax thresholds")
        Hq = cfg["num_q_heads"]
        if sdc.dtype != torch.float32 or tuple(sdc.shape) != (L, Hq, R):
            bad(f"'sdc_table' must be float32 {[L, Hq, R]} (per query head, also with group selection), "
                f"got {dtype_str(sdc.dtype)} {list(sdc.shape)}")
        if not bool(torch.isfinite(sdc).all()) or bool((sdc < 0).any()):
            bad("'sdc_table' must be finite and >= 0")
        if R > Rc and (ts.sdc_length_model is None or
                       not torch.equal(sdc, extend_sdc(sdc[..., :Rc], ts.sdc_length_model, R))):
            bad(f"'sdc_table' beyond the {Rc} calibrated row ids must follow its length model")
