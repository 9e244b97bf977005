"""Threshold files: calibrated Top-Theta thresholds of one model, in safetensors.

A file holds one or more *threshold sets* (e.g. k = 16, 32, 64 from one calibration pass)
that share the model, the placement and the selection mode, so that one batch can mix
requests at different k through the op's 3-D ``thresholds`` and ``threshold_set``
(op contract v0.2, docs/semantics.md).

Format version 2 (written)
--------------------------
Tensors of set i (``H`` = num_q_heads for selection "head", num_kv_heads for "group"):

``set{i}.thresholds`` : float32 ``[num_layers, H, R_cal]``
    theta per (layer, head, row id) over the calibrated row ids (column c is row id c + 1;
    -inf = dense).
``set{i}.sample_counts`` : int64 ``[num_layers, H, R_cal]``
    calibration rows behind each value (0: filled from a neighbour).
``set{i}.sdc_table`` : float32 ``[num_layers, num_q_heads, R_cal]``, optional
    offline softmax-denominator compensation (pre_softmax only), units of exp(a - m).
``set{i}.length_model``, ``set{i}.sdc_length_model`` : float64 ``[3, num_layers, H]``, optional
    the log-linear model of theta (of the SDC table) beyond the calibrated row ids:
    anchor row id, anchor value and slope (:class:`topth_ops.calib_count.LengthModel`).
    When present, loading extends the table to ``extend_to`` row ids with it.

Metadata: ``format`` = "topth-thresholds", ``format_version`` = "2", ``model_name``,
``attention_config`` (JSON: model_type, num_layers, num_q_heads, num_kv_heads, head_dim),
``attention_fingerprint`` (sha256 prefix of it), ``placement``, ``selection``,
``num_sets``, ``sets`` (JSON list, one object per set: ``layer_k`` (0 = dense layer),
``alpha``, ``estimator`` ("mean" = algorithm 1, "count" = kept-count), ``extend_to``,
``length_domain``, ``length_feature``, ``sdc_length_domain``, ``topk_at_calibration``, ``calibration_text``,
``calibration_samples``, ``calibration_tokens``, ``source``), ``created_by``.

Format version 1 (still read)
-----------------------------
One set: ``thresholds`` / ``sample_counts`` / ``sdc_table`` ``[num_layers, num_q_heads,
max_row_id]`` and the set's fields as top-level metadata; selection "head", estimator
"mean", no length model (the op reuses the last column beyond ``max_row_id``).

Writes are atomic (temporary file in the target folder, fsync, rename), so an interrupted
calibration never leaves a half-written file. Loading checks the format, the metadata,
every tensor's dtype and shape and the values; :meth:`ThresholdSet.check_model` compares a
set with a model, naming both on mismatch. The paper reference code's text format is
imported by :func:`topth_ops.threshold_import.import_reference_text` (re-exported here).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from .calib_count import SELECTIONS, LengthModel
from .calibration import DENSE, PLACEMENTS, base_k, format_layer_k

FORMAT = "topth-thresholds"
FORMAT_VERSION = 2
ESTIMATORS = ("mean", "count")
_CONFIG_KEYS = ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim")
_SET_KEYS = ("layer_k", "alpha", "estimator", "extend_to", "length_domain", "sdc_length_domain",
             "topk_at_calibration", "calibration_text", "calibration_samples", "calibration_tokens", "source")


class ThresholdFileError(ValueError):
    """A threshold file that cannot be used: corrupt, truncated, inconsistent, or made
    for another model or placement."""


def attention_config_of(config: Any) -> dict:
    """The attention shape of a model, from a transformers config (or a dict).

    Parameters
    ----------
    config : transformers.PretrainedConfig or dict
        A config with ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads`` (default: num_attention_heads), ``head_dim`` (default:
        hidden_size // num_attention_heads) and ``model_type``; or a dict with the keys
        of the returned dict.

    Returns
    -------
    dict
        ``{"model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"}``.

    Raises
    ------
    ValueError
        ``config`` is a dict that lacks one of those five keys (the message lists them).
    AttributeError
        ``config`` is an object without ``num_attention_heads`` or
        ``num_hidden_layers``, or without ``hidden_size`` when it has no ``head_dim``.
    """
    if isinstance(config, dict):
        missing = [k for k in _CONFIG_KEYS if k not in config]
        if missing:
            raise ValueError(f"attention config lacks {missing}")
        return {k: config[k] for k in _CONFIG_KEYS}
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return {
        "model_type": str(getattr(config, "model_type", "unknown")),
        "num_layers": int(config.num_hidden_layers),
        "num_q_heads": heads,
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
    }


def fingerprint(attention_config: dict) -> str:
    """sha256 prefix (16 hex digits) of the canonical JSON of an attention config."""
    blob = json.dumps({k: attention_config[k] for k in _CONFIG_KEYS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def describe_config(c: dict) -> str:
    """One-line human description of an attention config, for error messages.

    Parameters
    ----------
    c : dict
        An attention config as returned by :func:`attention_config_of` (keys
        ``model_type``, ``num_layers``, ``num_q_heads``, ``num_kv_heads``, ``head_dim``).

    Returns
    -------
    str
        E.g. ``"llama, 30 layers, 9 query heads, 3 KV heads, head_dim 64"``.

    Raises
    ------
    KeyError
        One of those keys is missing.
    """
    return (f"{c['model_type']}, {c['num_layers']} layers, {c['num_q_heads']} query heads, "
            f"{c['num_kv_heads']} KV heads, head_dim {c['head_dim']}")


@dataclass
class ThresholdSet:
    """One threshold set of one model (one k map, placement and selection).

    Attributes
    ----------
    thresholds : torch.Tensor
        float32 ``[num_layers, H, max_row_id]``, H = num_q_heads (selection "head") or
        num_kv_heads ("group"); the op's 2-D thresholds of a layer are ``thresholds[layer]``.
    counts : torch.Tensor
        int64 ``[num_layers, H, R_cal]``, R_cal <= max_row_id: calibration rows behind
        each value over the calibrated row ids. Columns beyond R_cal come from
        ``length_model``.
    layer_k : list of int
        k per layer, 0 (:data:`topth_ops.calibration.DENSE`) for a dense layer; with
        selection "group" the number of V rows a group keeps.
    placement : str
        "pre_softmax" (thresholds are logits) or "post_softmax" (probabilities).
    model_name : str
    attention_config : dict
        See :func:`attention_config_of`.
    alpha : float or None
        Standard deviations added to the mean (estimator "mean"); None when unknown.
    sdc_table : torch.Tensor or None
        float32 ``[num_layers, num_q_heads, max_row_id]``; pre_softmax only.
    selection : {"head", "group"}
    estimator : {"mean", "count"}
        "mean": algorithm 1 (mean + alpha * std of per-row (k+1)-th values); "count":
        mean kept count k per row-length bucket (:mod:`topth_ops.calib_count`).
    length_model, sdc_length_model : LengthModel or None
        theta (SDC table) as a function of the row id beyond the calibrated row ids.
    calibration_text, calibration_samples, calibration_tokens, topk_at_calibration,
    source : metadata describing how the set was made.
    path, set_index : where it was loaded from / saved to.
    """

    thresholds: torch.Tensor
    counts: torch.Tensor
    layer_k: list
    placement: str
    model_name: str
    attention_config: dict
    alpha: Optional[float] = None
    sdc_table: Optional[torch.Tensor] = None
    calibration_text: str = ""
    calibration_samples: int = 0
    calibration_tokens: int = 0
    topk_at_calibration: bool = False
    source: str = "calibrate"
    selection: str = "head"
    estimator: str = "mean"
    length_model: Optional[LengthModel] = field(default=None, compare=False)
    sdc_length_model: Optional[LengthModel] = field(default=None, compare=False)
    path: Optional[str] = field(default=None, compare=False)
    set_index: int = field(default=0, compare=False)

    @property
    def num_layers(self) -> int:
        return self.thresholds.shape[0]

    @property
    def num_heads(self) -> int:
        """Threshold heads: query heads ("head") or KV heads ("group")."""
        return self.thresholds.shape[1]

    @property
    def num_q_heads(self) -> int:
        return int(self.attention_config["num_q_heads"])

    @property
    def max_row_id(self) -> int:
        return self.thresholds.shape[2]

    @property
    def calibrated_row_ids(self) -> int:
        """Columns that come from calibration (the rest from the length model)."""
        return self.counts.shape[2]

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.attention_config)

    @property
    def max_calibrated_row_id(self) -> int:
        """Largest row id with at least one calibration sample (0 if none)."""
        cols = torch.nonzero(self.counts.sum(dim=(0, 1)) > 0)
        return int(cols.max()) + 1 if cols.numel() else 0

    @property
    def k(self) -> int:
        """The k of the thresholded layers (the most common non-dense value)."""
        return base_k(self.layer_k)

    def name(self) -> str:
        """How messages refer to this set: ``"thresholds file (PATH)"`` (with ``set i``
        when the file holds several), or ``"thresholds file"`` when it was neither loaded
        nor saved."""
        where = f" ({self.path}{', set ' + str(self.set_index) if self.set_index else ''})" if self.path else ""
        return f"thresholds file{where}"

    def summary(self) -> str:
        """One-line description for logs and CLI output."""
        ext = (f", length model to row id {self.max_row_id}" if self.length_model is not None
               and self.max_row_id > self.calibrated_row_ids else "")
        return (f"{self.model_name}: placement={self.placement}, selection={self.selection}, k per layer "
                f"[{format_layer_k(self.layer_k)}], estimator={self.estimator}, alpha={self.alpha}, "
                f"calibrated row ids={self.calibrated_row_ids}{ext}, "
                f"sdc_table={'yes' if self.sdc_table is not None else 'no'}, "
                f"calibration: {self.calibration_text}"
                + (f" ({self.calibration_samples} sample{'s' if self.calibration_samples != 1 else ''}, "
                   f"{self.calibration_tokens} tokens)" if self.calibration_samples else ""))

    def check_model(self, config: Any, model_name: Optional[str] = None, placement: Optional[str] = None,
                    *, selection: Optional[str] = None, compare_name: bool = True) -> None:
        """Raise :class:`ThresholdFileError` unless the set fits the model, placement and
        selection mode.

        Parameters
        ----------
        config : transformers config or dict
            The model's config (see :func:`attention_config_of`).
        model_name : str, optional
            Used in messages; with ``compare_name``, a name other than the file's gives a
            UserWarning (same attention shape, other weights, e.g. base vs instruct).
        placement : str, optional
            The placement the caller wants; must equal the set's.
        selection : str, optional
            The selection mode the caller wants ("head" / "group"); must equal the set's.
        compare_name : bool

        Raises
        ------
        ThresholdFileError
            Another attention config (naming both models and every differing field, e.g. a
            file for the other model family), or another placement or selection mode.
        """
        mine = attention_config_of(config)
        if fingerprint(mine) != self.fingerprint:
            diffs = [f"{k}: file {self.attention_config[k]!r} vs model {mine[k]!r}"
                     for k in _CONFIG_KEYS if self.attention_config[k] != mine[k]]
            raise ThresholdFileError(
                f"{self.name()} was calibrated for model {self.model_name!r} "
                f"({describe_config(self.attention_config)}), but the model "
                f"{model_name or '(given)'!r} is ({describe_config(mine)}); differs in " + "; ".join(diffs))
        if compare_name and model_name is not None and model_name != self.model_name:
            warnings.warn(
                f"{self.name()} was calibrated on model {self.model_name!r} and is used with model "
                f"{model_name!r}: the attention shapes match, but thresholds are specific to the "
                "weights they were calibrated on", UserWarning, stacklevel=3)
        if placement is not None and placement != self.placement:
            raise ThresholdFileError(
                f"{self.name()} holds {self.placement} thresholds (model {self.model_name!r}), "
                f"but placement={placement!r} was requested; calibrate with --placement "
                f"{placement} or use placement={self.placement!r}")
        if selection is not None and selection != self.selection:
            raise ThresholdFileError(
                f"{self.name()} was calibrated for selection={self.selection!r} (one threshold per "
                f"{'query head' if self.selection == 'head' else 'KV head, against the group maximum'}), "
                f"but selection={selection!r} was requested; calibrate with --selection {selection}")

    def set_metadata(self) -> dict:
        """This set's entry of the file's ``sets`` metadata (JSON-serializable)."""
        return {
            "layer_k": [int(k) for k in self.layer_k],
            "alpha": self.alpha,
            "estimator": self.estimator,
            "extend_to": int(self.max_row_id),
            "length_domain": self.length_model.domain if self.length_model is not None else None,
            "length_feature": self.length_model.feature if self.length_model is not None else None,
            "sdc_length_domain": self.sdc_length_model.domain if self.sdc_length_model is not None else None,
            "topk_at_calibration": bool(self.topk_at_calibration),
            "calibration_text": self.calibration_text,
            "calibration_samples": int(self.calibration_samples),
            "calibration_tokens": int(self.calibration_tokens),
            "source": self.source,
        }

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write this set alone as a threshold file (see :func:`save_threshold_sets`)."""
        return save_threshold_sets(path, [self])


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
    ext = torch.from_numpy(model.theta(n).astype(np.float32))
    return torch.cat([stored.to(torch.float32), ext], dim=-1)


def _model_tensor(m: LengthModel) -> torch.Tensor:
    return torch.from_numpy(np.stack([m.anchor_n, m.anchor_value, m.slope]).astype(np.float64))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_threshold_sets(path: Union[str, os.PathLike], sets: Sequence[ThresholdSet]) -> Path:
    """Validate and write threshold sets to one file atomically (temporary file + fsync +
    rename).

    Parameters
    ----------
    path : str or os.PathLike
        Destination ``.safetensors`` file; missing parent folders are created, an existing
        file is replaced. On success each set's ``path`` and ``set_index`` are set.
    sets : sequence of ThresholdSet
        At least one; all for the same model (attention config and name), placement and
        selection mode, so that the op can take them as one 3-D thresholds tensor.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    ThresholdFileError
        A set is inconsistent (same checks as loading), or the sets disagree in model,
        placement or selection.
    ValueError
        No sets, or ``path`` names a directory.
    OSError
        The file cannot be written (the message names ``path``); no partial file is left.
    """
    from safetensors.torch import save_file

    from . import __version__

    sets = list(sets)
    if not sets:
        raise ValueError("save_threshold_sets needs at least one threshold set")
    first = sets[0]
    for i, ts in enumerate(sets):
        _validate(ts, where=f"threshold set {i} to save")
        for f in ("model_name", "placement", "selection"):
            if getattr(ts, f) != getattr(first, f):
                raise ThresholdFileError(f"threshold sets of one file must share the {f}: set 0 has "
                                         f"{getattr(first, f)!r}, set {i} {getattr(ts, f)!r}")
        if ts.fingerprint != first.fingerprint:
            raise ThresholdFileError("threshold sets of one file must share the attention config: set 0 is "
                                     f"({describe_config(first.attention_config)}), set {i} "
                                     f"({describe_config(ts.attention_config)})")
    path = Path(path)
    if not path.name or path.is_dir():
        raise ValueError(f"threshold file path {str(path)!r} names a directory; expected a file "
                         "path such as th_k16.safetensors")
    tensors = {}
    for i, ts in enumerate(sets):
        Rc = ts.calibrated_row_ids
        tensors[f"set{i}.thresholds"] = ts.thresholds[..., :Rc].detach().to("cpu", torch.float32).contiguous()
        tensors[f"set{i}.sample_counts"] = ts.counts.detach().to("cpu", torch.int64).contiguous()
        if ts.sdc_table is not None:
            tensors[f"set{i}.sdc_table"] = ts.sdc_table[..., :Rc].detach().to("cpu", torch.float32).contiguous()
        if ts.length_model is not None:
            tensors[f"set{i}.length_model"] = _model_tensor(ts.length_model)
        if ts.sdc_length_model is not None:
            tensors[f"set{i}.sdc_length_model"] = _model_tensor(ts.sdc_length_model)
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "model_name": first.model_name,
        "attention_config": json.dumps(attention_config_of(first.attention_config), sort_keys=True),
        "attention_fingerprint": first.fingerprint,
        "placement": first.placement,
        "selection": first.selection,
        "num_sets": str(len(sets)),
        "sets": json.dumps([ts.set_metadata() for ts in sets]),
        "created_by": f"topth-ops {__version__}",
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, f"cannot write threshold file {str(path)!r}: {e.strerror}") from None
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; follow the umask like open()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write threshold file {str(path)!r}: {e.strerror}") from None
        raise
    for i, ts in enumerate(sets):
        ts.path, ts.set_index = str(path), i
    return path


def _validate(ts: ThresholdSet, *, where: str) -> None:
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
            f"{str(th.dtype).replace('torch.', '')} {list(th.shape)}")
    L, H, R = th.shape
    if L != cfg["num_layers"] or H != cfg[H_name] or R < 1:
        bad(f"'thresholds' shape {list(th.shape)} does not match the recorded attention config "
            f"({describe_config(cfg)}) with selection {ts.selection!r} ([num_layers, {H_name}, max_row_id >= 1])")
    if counts.dtype != torch.int64 or counts.dim() != 3 or tuple(counts.shape[:2]) != (L, H) \
            or not 1 <= counts.shape[2] <= R:
        bad(f"'sample_counts' must be int64 [{L}, {H}, R_cal] with 1 <= R_cal <= {R}, got "
            f"{str(counts.dtype).replace('torch.', '')} {list(counts.shape)}")
    Rc = counts.shape[2]
    if bool((counts < 0).any()):
        bad("'sample_counts' has negative entries")
    if len(ts.layer_k) != L or any((not isinstance(k, int)) or isinstance(k, bool) or k < 0 for k in ts.layer_k):
        bad(f"'layer_k' must list {L} integers >= 0 (0 = dense layer), got {ts.layer_k!r}")
    if bool(torch.isnan(th).any()):
        bad("'thresholds' contains NaN")
    if bool((th == float("inf")).any()):
        bad("'thresholds' contains +inf")
    finite = th[torch.isfinite(th)]
    if ts.placement == "post_softmax" and finite.numel() and bool(((finite < 0) | (finite > 1)).any()):
        bad("post_softmax thresholds (probabilities) must lie in [0, 1] or be -inf")
    for layer, k in enumerate(ts.layer_k):
        dense_cols = R if k == DENSE else min(k, R)
        if dense_cols and bool(torch.isfinite(th[layer, :, :dense_cols]).any()):
            what = "a dense layer" if k == DENSE else f"rows with n <= k={k}"
            bad(f"layer {layer}: {what} must hold -inf thresholds")
    for name, m, heads in (("length_model", ts.length_model, H), ("sdc_length_model", ts.sdc_length_model,
                                                                    cfg["num_q_heads"])):
        if m is None:
            continue
        if any(np.shape(a) != (L, heads) for a in (m.anchor_n, m.anchor_value, m.slope)):
            bad(f"{name!r} arrays must have shape [{L}, {heads}]")
        allowed = ("logit", "log_prob") if name == "length_model" else ("log",)
        if m.domain not in allowed:
            bad(f"{name!r} domain must be one of {allowed}, got {m.domain!r}")
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
                f"got {str(sdc.dtype).replace('torch.', '')} {list(sdc.shape)}")
        if not bool(torch.isfinite(sdc).all()) or bool((sdc < 0).any()):
            bad("'sdc_table' must be finite and >= 0")
        if R > Rc and (ts.sdc_length_model is None or
                       not torch.equal(sdc, _extend_sdc(sdc[..., :Rc], ts.sdc_length_model, R))):
            bad(f"'sdc_table' beyond the {Rc} calibrated row ids must follow its length model")


def _extend_sdc(stored: torch.Tensor, model: LengthModel, extend_to: int) -> torch.Tensor:
    """SDC table extension: like :func:`extend_table`, but dense entries (NaN model) are 0."""
    t = extend_table(stored, model, extend_to)
    return torch.where(torch.isinf(t), torch.zeros_like(t), t)


def stack_sets(sets: Sequence[ThresholdSet], layer: int, name: str = "thresholds") -> Optional[torch.Tensor]:
    """One layer of several sets as the op's 3-D table ``[num_sets, H, max_row_id]``.

    Sets shorter than the longest are padded with their last column (what the op does
    with ``min(n, max_row_id) - 1`` anyway). ``name`` is "thresholds" or "sdc_table";
    None when some set has no such table.
    """
    tabs = [getattr(ts, name) for ts in sets]
    if any(t is None for t in tabs):
        return None
    R = max(t.shape[-1] for t in tabs)
    rows = []
    for t in tabs:
        x = t[layer]
        if x.shape[-1] < R:
            x = torch.cat([x, x[:, -1:].expand(x.shape[0], R - x.shape[-1])], dim=-1)
        rows.append(x)
    return torch.stack(rows)


def import_reference_text(*args, **kwargs):
    """See :func:`topth_ops.threshold_import.import_reference_text` (kept here for
    compatibility)."""
    from .threshold_import import import_reference_text as f

    return f(*args, **kwargs)


# readers (format 1 and 2) live in threshold_load.py; imported last, as they use the above
from .threshold_load import load_threshold_sets, load_thresholds, pick_set  # noqa: E402,F401
