"""Threshold files: calibrated Top-Theta thresholds of one model, in safetensors.

Tensors
-------
thresholds : float32 ``[num_layers, num_q_heads, max_row_id]``
    theta per (layer, query head, row id); column c is row id c + 1; -inf = dense.
sample_counts : int64 ``[num_layers, num_q_heads, max_row_id]``
    calibration samples behind each value (0: filled from the nearest calibrated row id).
sdc_table : float32 ``[num_layers, num_q_heads, max_row_id]``, optional
    offline softmax-denominator compensation (pre_softmax only), units of exp(a - m).

Metadata (safetensors string map)
---------------------------------
``format`` = "topth-thresholds", ``format_version``, ``model_name``,
``attention_config`` (JSON: model_type, num_layers, num_q_heads, num_kv_heads, head_dim),
``attention_fingerprint`` (sha256 prefix of that JSON), ``placement``, ``layer_k`` (JSON
list, 0 = dense layer), ``alpha`` (JSON number or null when unknown),
``topk_at_calibration``, ``calibration_text``, ``calibration_samples``,
``calibration_tokens``, ``source``, ``created_by``.

Writes are atomic (temporary file in the target folder, fsync, rename), so an
interrupted calibration never leaves a half-written file. Loading checks the format,
the metadata, every tensor's dtype and shape and the values, and :meth:`ThresholdSet.
check_model` compares the file with a model, naming both on mismatch.

The text format of the paper's reference code (kostyanoob/top-theta-attention,
``th.txt`` lines ``L{layer}_H{head}:{seq_len} {theta} {num_samples} {K}`` and ``sdc.txt``
lines ``L{layer}_H{head}:{seq_len} {value} {num_samples}``) is imported by
:func:`import_reference_text`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from .calibration import DENSE, PLACEMENTS, _dense_rows, base_k, fill_unsampled, format_layer_k

FORMAT = "topth-thresholds"
FORMAT_VERSION = 1
_CONFIG_KEYS = ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim")


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
    """Calibrated thresholds of one model for one placement (contents of one file).

    Attributes
    ----------
    thresholds : torch.Tensor
        float32 ``[num_layers, num_q_heads, max_row_id]``.
    counts : torch.Tensor
        int64, same shape: calibration samples per entry.
    layer_k : list of int
        k per layer, 0 (:data:`topth_ops.calibration.DENSE`) for a dense layer.
    placement : str
        "pre_softmax" (thresholds are logits) or "post_softmax" (probabilities).
    model_name : str
    attention_config : dict
        See :func:`attention_config_of`.
    alpha : float or None
        Standard deviations added to the mean; None when unknown (imported files).
    sdc_table : torch.Tensor or None
        float32, same shape; pre_softmax only.
    calibration_text, calibration_samples, calibration_tokens, topk_at_calibration,
    source : metadata describing how the file was made.
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
    path: Optional[str] = field(default=None, compare=False)

    @property
    def num_layers(self) -> int:
        return self.thresholds.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.thresholds.shape[1]

    @property
    def max_row_id(self) -> int:
        return self.thresholds.shape[2]

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
        """How messages refer to this set: ``"thresholds file (PATH)"``, or
        ``"thresholds file"`` when it was neither loaded nor saved (``path`` is None).

        Returns
        -------
        str
        """
        where = f" ({self.path})" if self.path else ""
        return f"thresholds file{where}"

    def summary(self) -> str:
        """One-line description for logs and CLI output.

        Returns
        -------
        str
            Model name, placement, k per layer (:func:`topth_ops.calibration.
            format_layer_k`), alpha, max_row_id, whether an SDC table is present, and the
            calibration text with its sample count.
        """
        return (f"{self.model_name}: placement={self.placement}, k per layer "
                f"[{format_layer_k(self.layer_k)}], alpha={self.alpha}, max_row_id="
                f"{self.max_row_id}, sdc_table={'yes' if self.sdc_table is not None else 'no'}, "
                f"calibration: {self.calibration_text}"
                + (f" ({self.calibration_samples} sample{'s' if self.calibration_samples != 1 else ''}, "
                   f"{self.calibration_tokens} tokens)"
                   if self.calibration_samples else ""))

    def check_model(self, config: Any, model_name: Optional[str] = None,
                    placement: Optional[str] = None, *, compare_name: bool = True) -> None:
        """Raise :class:`ThresholdFileError` unless the file fits the model (and placement).

        Parameters
        ----------
        config : transformers config or dict
            The model's config (see :func:`attention_config_of`).
        model_name : str, optional
            Used in messages; with ``compare_name``, a name other than the file's gives a
            UserWarning (another model with the same attention shape, e.g. a base vs an
            instruct model).
        placement : str, optional
            The placement the caller wants; must equal the file's.
        compare_name : bool
            Warn when ``model_name`` differs from the file's (off for unnamed models).

        Raises
        ------
        ThresholdFileError
            The model's attention config (layers, heads, head_dim, ...) differs from the
            file's, naming both models and every differing field; or the placement differs.
        """
        mine = attention_config_of(config)
        if fingerprint(mine) != self.fingerprint:
            diffs = [f"{k}: file {self.attention_config[k]!r} vs model {mine[k]!r}"
                     for k in _CONFIG_KEYS if self.attention_config[k] != mine[k]]
            raise ThresholdFileError(
                f"{self.name()} was calibrated for model {self.model_name!r} "
                f"({describe_config(self.attention_config)}), but the model "
                f"{model_name or '(given)'!r} is ({describe_config(mine)}); differs in "
                + "; ".join(diffs)
            )
        if compare_name and model_name is not None and model_name != self.model_name:
            warnings.warn(
                f"{self.name()} was calibrated on model {self.model_name!r} and is used with model "
                f"{model_name!r}: the attention shapes match, but thresholds are specific to the "
                "weights they were calibrated on", UserWarning, stacklevel=3)
        if placement is not None and placement != self.placement:
            raise ThresholdFileError(
                f"{self.name()} holds {self.placement} thresholds (model {self.model_name!r}), "
                f"but placement={placement!r} was requested; calibrate with --placement "
                f"{placement} or use placement={self.placement!r}"
            )

    # ---------------------------------------------------------------- writing

    def metadata(self) -> dict[str, str]:
        """The safetensors metadata map written by :meth:`save` (see the module docstring).

        Returns
        -------
        dict of str to str
            ``format``, ``format_version``, ``model_name``, ``attention_config`` (JSON),
            ``attention_fingerprint``, ``placement``, ``layer_k`` (JSON list, 0 = dense),
            ``alpha`` (JSON number or null), ``topk_at_calibration`` (JSON bool),
            ``calibration_text``, ``calibration_samples``, ``calibration_tokens``,
            ``source``, ``created_by``; every value a string, as safetensors requires.

        Raises
        ------
        ValueError
            ``attention_config`` lacks one of its keys (from :func:`attention_config_of`).
        """
        from . import __version__

        return {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "model_name": self.model_name,
            "attention_config": json.dumps(attention_config_of(self.attention_config), sort_keys=True),
            "attention_fingerprint": self.fingerprint,
            "placement": self.placement,
            "layer_k": json.dumps([int(k) for k in self.layer_k]),
            "alpha": json.dumps(self.alpha),
            "topk_at_calibration": json.dumps(bool(self.topk_at_calibration)),
            "calibration_text": self.calibration_text,
            "calibration_samples": str(int(self.calibration_samples)),
            "calibration_tokens": str(int(self.calibration_tokens)),
            "source": self.source,
            "created_by": f"topth-ops {__version__}",
        }

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Validate and write the file atomically (temporary file + fsync + rename).

        Parameters
        ----------
        path : str or os.PathLike
            Destination ``.safetensors`` file; missing parent folders are created, an
            existing file is replaced. On success ``self.path`` is set to it.

        Returns
        -------
        pathlib.Path
            The written path.

        Raises
        ------
        ThresholdFileError
            The set is inconsistent (same checks as loading).
        ValueError
            ``path`` names a directory.
        OSError
            The file cannot be written (the message names ``path``); no partial file is left.
        """
        from safetensors.torch import save_file

        _validate(self.thresholds, self.counts, self.sdc_table, self.layer_k, self.placement,
                  self.attention_config, where="the threshold set to save")
        path = Path(path)
        if not path.name or path.is_dir():
            raise ValueError(f"threshold file path {str(path)!r} names a directory; expected a file "
                             "path such as th_k16.safetensors")
        tensors = {
            "thresholds": self.thresholds.detach().to("cpu", torch.float32).contiguous(),
            "sample_counts": self.counts.detach().to("cpu", torch.int64).contiguous(),
        }
        if self.sdc_table is not None:
            tensors["sdc_table"] = self.sdc_table.detach().to("cpu", torch.float32).contiguous()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        except OSError as e:
            raise OSError(e.errno, f"cannot write threshold file {str(path)!r}: {e.strerror}") from None
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=self.metadata())
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
        self.path = str(path)
        return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _validate(thresholds, counts, sdc_table, layer_k, placement, attention_config, *, where: str) -> None:
    def bad(msg):
        raise ThresholdFileError(f"{where}: {msg}")

    if placement not in PLACEMENTS:
        bad(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if thresholds.dtype != torch.float32 or thresholds.dim() != 3:
        bad(f"'thresholds' must be float32 [num_layers, num_q_heads, max_row_id], got "
            f"{str(thresholds.dtype).replace('torch.', '')} {list(thresholds.shape)}")
    L, H, R = thresholds.shape
    if L != attention_config["num_layers"] or H != attention_config["num_q_heads"] or R < 1:
        bad(f"'thresholds' shape {list(thresholds.shape)} does not match the recorded attention "
            f"config ({describe_config(attention_config)}) with max_row_id >= 1")
    if counts.dtype != torch.int64 or tuple(counts.shape) != (L, H, R):
        bad(f"'sample_counts' must be int64 {[L, H, R]}, got "
            f"{str(counts.dtype).replace('torch.', '')} {list(counts.shape)}")
    if bool((counts < 0).any()):
        bad("'sample_counts' has negative entries")
    if len(layer_k) != L or any((not isinstance(k, int)) or k < 0 for k in layer_k):
        bad(f"'layer_k' must list {L} integers >= 0 (0 = dense layer), got {layer_k!r}")
    if bool(torch.isnan(thresholds).any()):
        bad("'thresholds' contains NaN")
    if bool((thresholds == float("inf")).any()):
        bad("'thresholds' contains +inf")
    finite = thresholds[torch.isfinite(thresholds)]
    if placement == "post_softmax" and finite.numel() and bool(((finite < 0) | (finite > 1)).any()):
        bad("post_softmax thresholds (probabilities) must lie in [0, 1] or be -inf")
    for layer, k in enumerate(layer_k):
        dense_cols = R if k == DENSE else min(k, R)
        if dense_cols and bool(torch.isfinite(thresholds[layer, :, :dense_cols]).any()):
            what = "a dense layer" if k == DENSE else f"rows with n <= k={k}"
            bad(f"layer {layer}: {what} must hold -inf thresholds")
    if sdc_table is not None:
        if placement != "pre_softmax":
            bad("an sdc_table is only valid with pre_softmax thresholds")
        if sdc_table.dtype != torch.float32 or tuple(sdc_table.shape) != (L, H, R):
            bad(f"'sdc_table' must be float32 {[L, H, R]}, got "
                f"{str(sdc_table.dtype).replace('torch.', '')} {list(sdc_table.shape)}")
        if not bool(torch.isfinite(sdc_table).all()) or bool((sdc_table < 0).any()):
            bad("'sdc_table' must be finite and >= 0")


def load_thresholds(path: Union[str, os.PathLike]) -> ThresholdSet:
    """Read and validate a threshold file.

    Parameters
    ----------
    path : str or path-like

    Returns
    -------
    ThresholdSet

    Raises
    ------
    FileNotFoundError
        No such file.
    ThresholdFileError
        A directory, not a threshold file, corrupt or truncated, written by a newer format version,
        missing or malformed metadata, tensors of the wrong dtype or shape, or values
        that cannot be thresholds (NaN, +inf, probabilities outside [0, 1], finite
        values in rows that must be dense).
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise ThresholdFileError(f"thresholds file {str(path)!r} is a directory; expected a .safetensors file")
    if not path.is_file():
        raise FileNotFoundError(f"thresholds file {str(path)!r} does not exist")
    where = f"thresholds file {str(path)!r}"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            names = set(f.keys())
            tensors = {n: f.get_tensor(n) for n in names}
    except Exception as e:  # safetensors raises its own error types (and OSError)
        raise ThresholdFileError(
            f"{where} is corrupt or truncated (not a readable safetensors file): {e}"
        ) from e
    if meta.get("format") != FORMAT:
        raise ThresholdFileError(f"{where} is not a topth-ops thresholds file (metadata 'format' is "
                                 f"{meta.get('format')!r}, expected {FORMAT!r})")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        raise ThresholdFileError(f"{where}: bad 'format_version' {meta.get('format_version')!r}") from None
    if version > FORMAT_VERSION:
        raise ThresholdFileError(f"{where} has format_version {version}; this topth-ops reads up to "
                                 f"{FORMAT_VERSION}: upgrade topth-ops")
    required = ("model_name", "attention_config", "attention_fingerprint", "placement", "layer_k",
                "alpha")
    missing = [k for k in required if k not in meta]
    if missing:
        raise ThresholdFileError(f"{where}: metadata lacks {missing}")
    for t in ("thresholds", "sample_counts"):
        if t not in names:
            raise ThresholdFileError(f"{where}: tensor {t!r} is missing (has {sorted(names)})")
    try:
        cfg = attention_config_of(json.loads(meta["attention_config"]))
        layer_k = json.loads(meta["layer_k"])
        alpha = json.loads(meta["alpha"])
        tac = json.loads(meta.get("topk_at_calibration", "false"))
        samples = int(meta.get("calibration_samples", "0"))
        tokens = int(meta.get("calibration_tokens", "0"))
    except (ValueError, TypeError) as e:
        raise ThresholdFileError(f"{where}: malformed metadata: {e}") from e
    if fingerprint(cfg) != meta["attention_fingerprint"]:
        raise ThresholdFileError(f"{where}: 'attention_fingerprint' does not match 'attention_config' "
                                 "(edited or corrupt metadata)")
    if alpha is not None and not (isinstance(alpha, (int, float)) and math.isfinite(alpha)):
        raise ThresholdFileError(f"{where}: 'alpha' must be a finite number or null, got {alpha!r}")
    ts = ThresholdSet(
        thresholds=tensors["thresholds"],
        counts=tensors["sample_counts"],
        layer_k=layer_k,
        placement=meta["placement"],
        model_name=meta["model_name"],
        attention_config=cfg,
        alpha=alpha,
        sdc_table=tensors.get("sdc_table"),
        calibration_text=meta.get("calibration_text", ""),
        calibration_samples=samples,
        calibration_tokens=tokens,
        topk_at_calibration=bool(tac),
        source=meta.get("source", ""),
        path=str(path),
    )
    _validate(ts.thresholds, ts.counts, ts.sdc_table, ts.layer_k, ts.placement, cfg, where=where)
    return ts


_TH_LINE = re.compile(r"^L(\d+)_H(\d+):(\d+)$")


def _parse_reference(path: Path, fields: int, what: str) -> dict:
    """{(layer, head, seq_len): [float value, int num_samples, (int K)]} from a reference file."""
    fmt = ("L{layer}_H{head}:{seq_len} {theta} {num_samples} {K}" if fields == 4
           else "L{layer}_H{head}:{seq_len} {value} {num_samples}")
    out: dict = {}
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            parts = line.split()
            m = _TH_LINE.match(parts[0]) if parts else None
            try:
                if m is None or len(parts) != fields:
                    raise ValueError
                key = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
                value = float(parts[1])
                nums = [int(p) for p in parts[2:]]
            except ValueError:
                raise ThresholdFileError(
                    f"{what} {str(path)!r} line {lineno}: expected '{fmt}', got {line[:120]!r}"
                ) from None
            if key[2] < 1 or nums[0] < 0 or math.isnan(value):
                raise ThresholdFileError(
                    f"{what} {str(path)!r} line {lineno}: seq_len must be >= 1, num_samples >= 0 and "
                    f"the value not NaN, got {line[:120]!r}"
                )
            out[key] = [value, *nums]  # a repeated key keeps the last line, as the reference loader
    if not out:
        raise ThresholdFileError(f"{what} {str(path)!r} holds no lines of the form '{fmt}'")
    return out


def import_reference_text(th_path: Union[str, os.PathLike], sdc_path: Optional[Union[str, os.PathLike]] = None,
                          *, placement: str, attention_config: Any, model_name: str) -> ThresholdSet:
    """Import thresholds written by the paper's reference code (``th.txt`` / ``sdc.txt``).

    Parameters
    ----------
    th_path : path
        ``th.txt``: lines ``L{layer}_H{head}:{seq_len} {theta} {num_samples} {K}``
        (seq_len is the row id n: the number of keys of the attention row).
    sdc_path : path, optional
        ``sdc.txt``: lines ``L{layer}_H{head}:{seq_len} {value} {num_samples}``
        (offline SDC, pre_softmax only).
    placement : str
        The placement the reference run used (the text format does not record it).
    attention_config : transformers config or dict
        The model the thresholds belong to.
    model_name : str

    Returns
    -------
    ThresholdSet
        Layers without lines are dense; rows with seq_len <= K are dense; row ids
        without a line take the nearest row id that has one (ties: the smaller), the same
        rule as the reference code's lookup.

    Raises
    ------
    ThresholdFileError
        Malformed lines, an empty file, layers or heads outside the model, several K in
        one layer, a layer with some heads missing, an sdc file with post_softmax,
        post_softmax values outside [0, 1] (logits imported with the wrong placement), or
        an sdc line for a layer without thresholds.
    ValueError
        ``placement`` is not "pre_softmax" or "post_softmax", or ``attention_config`` is
        a dict lacking keys (:func:`attention_config_of`).
    FileNotFoundError
        ``th_path`` or ``sdc_path`` does not exist (other ``OSError`` for unreadable
        files), raised by ``open``.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    cfg = attention_config_of(attention_config)
    L, H = cfg["num_layers"], cfg["num_q_heads"]
    th = _parse_reference(Path(th_path), 4, "reference thresholds file")
    sdc = _parse_reference(Path(sdc_path), 3, "reference SDC file") if sdc_path is not None else None
    if sdc is not None and placement != "pre_softmax":
        raise ThresholdFileError("an sdc.txt file applies to pre_softmax thresholds only")
    keys = list(th) + (list(sdc) if sdc else [])
    bad = sorted({(l, h) for l, h, _ in keys if l >= L or h >= H})
    if bad:
        l, h = bad[0]
        raise ThresholdFileError(
            f"reference file has layer {l} head {h}, outside model {model_name!r} "
            f"({describe_config(cfg)})"
        )
    R = max(s for _, _, s in keys)
    theta = np.full((L, H, R), np.nan)
    counts = np.zeros((L, H, R), dtype=np.int64)
    present = np.zeros((L, H, R), dtype=bool)
    layer_ks: dict[int, set] = {}
    for (l, h, s), (value, ns, k) in th.items():
        theta[l, h, s - 1] = value
        counts[l, h, s - 1] = ns
        present[l, h, s - 1] = True
        layer_ks.setdefault(l, set()).add(k)
    layer_k = [DENSE] * L
    for l, ks in layer_ks.items():
        if len(ks) != 1:
            raise ThresholdFileError(f"reference thresholds file: layer {l} has several K values {sorted(ks)}")
        layer_k[l] = ks.pop()
        if layer_k[l] < 1:
            raise ThresholdFileError(f"reference thresholds file: layer {l} has K={layer_k[l]} (< 1)")
        missing = [h for h in range(H) if not present[l, h].any()]
        if missing:
            raise ThresholdFileError(f"reference thresholds file: layer {l} has no lines for heads {missing}")
    if placement == "post_softmax":
        vals = theta[present]
        if vals.size and bool(((vals < 0) | (vals > 1)).any()):
            raise ThresholdFileError(
                f"reference thresholds file has values outside [0, 1] (min {vals.min():.4g}, max "
                f"{vals.max():.4g}), which cannot be post_softmax probabilities: were they calibrated "
                "on logits? then use placement pre_softmax")
    theta = fill_unsampled(np.where(present, theta, 0.0), present.astype(np.int64))
    theta = _dense_rows(theta, layer_k, -np.inf)
    sdc_table = None
    if sdc is not None:
        table = np.zeros((L, H, R))
        sdc_present = np.zeros((L, H, R), dtype=bool)
        for (l, h, s), (value, _ns) in sdc.items():
            if layer_k[l] == DENSE:
                raise ThresholdFileError(f"reference SDC file has layer {l}, which has no thresholds")
            table[l, h, s - 1] = value
            sdc_present[l, h, s - 1] = True
        table = fill_unsampled(table, sdc_present.astype(np.int64))
        table = _dense_rows(table, layer_k, 0.0)
        sdc_table = torch.from_numpy(table.astype(np.float32))
    return ThresholdSet(
        thresholds=torch.from_numpy(theta.astype(np.float32)),
        counts=torch.from_numpy(counts),
        layer_k=layer_k,
        placement=placement,
        model_name=model_name,
        attention_config=cfg,
        alpha=None,
        sdc_table=sdc_table,
        calibration_text=f"imported from {Path(th_path).name}" + (f" + {Path(sdc_path).name}" if sdc_path else ""),
        calibration_samples=0,
        source="reference-text",
    )
