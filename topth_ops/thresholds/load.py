"""Reading threshold files: format version 2 (several threshold sets, selection, length
model) and format version 1 (one set, still read), validated and extended to
``extend_to`` row ids (docs/thresholds.md). Re-exported by :mod:`topth_ops.thresholds`."""

from __future__ import annotations

import json
import math
import operator
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from ..contract import SELECTIONS
from .format import FORMAT, FORMAT_VERSION, MAX_ROW_IDS, ThresholdFileError, attention_config_of, fingerprint
from .length_model import FEATURES, LengthModel
from .sets import ThresholdSet
from .validate import extend_sdc, extend_table, is_layer_k, validate_set


def _read(path: Path):
    from safetensors import safe_open

    if path.is_dir():
        raise ThresholdFileError(f"thresholds file {str(path)!r} is a directory; expected a .safetensors file")
    if not path.is_file():
        raise FileNotFoundError(f"thresholds file {str(path)!r} does not exist")
    where = f"thresholds file {str(path)!r}"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    except Exception as e:  # safetensors raises its own error types (and OSError)
        raise ThresholdFileError(f"{where} is corrupt or truncated (not a readable safetensors file): {e}") from e
    if meta.get("format") != FORMAT:
        raise ThresholdFileError(f"{where} is not a topth-ops thresholds file (metadata 'format' is "
                                 f"{meta.get('format')!r}, expected {FORMAT!r})")
    try:
        version = int(meta.get("format_version", ""))
    except ValueError:
        raise ThresholdFileError(f"{where}: bad 'format_version' {meta.get('format_version')!r}") from None
    if version > FORMAT_VERSION or version < 1:
        raise ThresholdFileError(f"{where} has format_version {version}; this topth-ops reads 1 to "
                                 f"{FORMAT_VERSION}" + (": upgrade topth-ops" if version > FORMAT_VERSION else ""))
    return meta, tensors, version, where


def _file_config(meta: dict, where: str) -> dict:
    missing = [k for k in ("model_name", "attention_config", "attention_fingerprint", "placement") if k not in meta]
    if missing:
        raise ThresholdFileError(f"{where}: metadata lacks {missing}")
    try:
        cfg = attention_config_of(json.loads(meta["attention_config"]))
    except (ValueError, TypeError) as e:
        raise ThresholdFileError(f"{where}: malformed metadata: {e}") from e
    if fingerprint(cfg) != meta["attention_fingerprint"]:
        raise ThresholdFileError(f"{where}: 'attention_fingerprint' does not match 'attention_config' "
                                 "(edited or corrupt metadata)")
    return cfg


def _check_names(tensors: dict, allowed: set, where: str) -> None:
    extra = sorted(set(tensors) - allowed)
    if extra:
        raise ThresholdFileError(f"{where}: unexpected tensors {extra} (a threshold file of this format holds "
                                 f"only {sorted(allowed)})")


def _check_alpha(alpha, where):
    if alpha is not None and not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool)
                                  and math.isfinite(alpha)):
        raise ThresholdFileError(f"{where}: 'alpha' must be a finite number or null, got {alpha!r}")


def _load_v1(meta, tensors, cfg, where, path) -> list:
    missing = [k for k in ("layer_k", "alpha") if k not in meta]
    if missing:
        raise ThresholdFileError(f"{where}: metadata lacks {missing}")
    for t in ("thresholds", "sample_counts"):
        if t not in tensors:
            raise ThresholdFileError(f"{where}: tensor {t!r} is missing (has {sorted(tensors)})")
    _check_names(tensors, {"thresholds", "sample_counts", "sdc_table"}, where)
    try:
        layer_k = json.loads(meta["layer_k"])
        alpha = json.loads(meta["alpha"])
        tac = json.loads(meta.get("topk_at_calibration", "false"))
        samples = int(meta.get("calibration_samples", "0"))
        tokens = int(meta.get("calibration_tokens", "0"))
    except (ValueError, TypeError) as e:
        raise ThresholdFileError(f"{where}: malformed metadata: {e}") from e
    _check_alpha(alpha, where)
    if tensors["sample_counts"].shape != tensors["thresholds"].shape:
        raise ThresholdFileError(f"{where}: 'sample_counts' must have the shape of 'thresholds' "
                                 f"{list(tensors['thresholds'].shape)}, got {list(tensors['sample_counts'].shape)}")
    ts = ThresholdSet(
        thresholds=tensors["thresholds"], counts=tensors["sample_counts"], layer_k=layer_k,
        placement=meta["placement"], model_name=meta["model_name"], attention_config=cfg, alpha=alpha,
        sdc_table=tensors.get("sdc_table"), calibration_text=meta.get("calibration_text", ""),
        calibration_samples=samples, calibration_tokens=tokens, topk_at_calibration=bool(tac),
        source=meta.get("source", ""), path=str(path))
    validate_set(ts, where=where)
    return [ts]


def _load_model(t: Optional[torch.Tensor], domain: Optional[str], L: int, H: int, what: str, where: str,
                feature: Optional[str] = None, layer_k=None):
    if feature is not None and (not isinstance(feature, str) or feature not in FEATURES):
        raise ThresholdFileError(f"{where}: unknown {what} feature {feature!r}; expected one of "
                                 f"{', '.join(FEATURES)}")  # also without its model
    if t is None and domain is None:
        return None
    feature = "log_n" if feature is None else feature
    if t is None or domain is None or t.dtype != torch.float64 or tuple(t.shape) != (3, L, H):
        raise ThresholdFileError(f"{where}: {what} must be float64 [3, {L}, {H}] with a domain, got "
                                 f"{None if t is None else (str(t.dtype), list(t.shape))}, domain {domain!r}")
    a = t.numpy()
    ok = isinstance(layer_k, list) and is_layer_k(layer_k, L) and all(v < 2 ** 63 for v in layer_k)  # int64
    k = np.array(layer_k, dtype=np.int64) if ok else None  # a malformed layer_k: validate_set says so
    if feature != "log_n" and k is None:
        raise ThresholdFileError(f"{where}: {what} needs the set's layer_k ({L} integers >= 0), got {layer_k!r}")
    return LengthModel(domain, a[0].copy(), a[1].copy(), a[2].copy(), feature, k)


def _load_v2(meta, tensors, cfg, where, path) -> list:
    try:
        num_sets = int(meta.get("num_sets", ""))
        entries = json.loads(meta.get("sets", ""))
    except (ValueError, TypeError) as e:
        raise ThresholdFileError(f"{where}: malformed metadata ('num_sets' / 'sets'): {e}") from e
    selection = meta.get("selection", "head")
    if selection not in SELECTIONS:
        raise ThresholdFileError(f"{where}: selection must be one of {SELECTIONS}, got {selection!r}")
    if not isinstance(entries, list) or len(entries) != num_sets or num_sets < 1:
        raise ThresholdFileError(f"{where}: 'sets' must list num_sets={num_sets} (>= 1) entries")
    _check_names(tensors, {f"set{i}.{t}" for i in range(num_sets) for t in
                           ("thresholds", "sample_counts", "sdc_table", "length_model", "sdc_length_model")}, where)
    L = cfg["num_layers"]
    H = cfg["num_q_heads"] if selection == "head" else cfg["num_kv_heads"]
    out = []
    for i, e in enumerate(entries):
        w = f"{where} set {i}"
        if not isinstance(e, dict) or any(k not in e for k in ("layer_k", "alpha", "estimator", "extend_to")):
            raise ThresholdFileError(f"{w}: set metadata must hold layer_k, alpha, estimator, extend_to")
        for t in ("thresholds", "sample_counts"):
            if f"set{i}.{t}" not in tensors:
                raise ThresholdFileError(f"{w}: tensor 'set{i}.{t}' is missing (has {sorted(tensors)})")
        _check_alpha(e["alpha"], w)
        lm = _load_model(tensors.get(f"set{i}.length_model"), e.get("length_domain"), L, H, "length_model", w,
                         e.get("length_feature"), e.get("layer_k"))
        sm = _load_model(tensors.get(f"set{i}.sdc_length_model"), e.get("sdc_length_domain"), L,
                         cfg["num_q_heads"], "sdc_length_model", w, e.get("sdc_length_feature"), e.get("layer_k"))
        stored = tensors[f"set{i}.thresholds"]
        if stored.dtype != torch.float32 or stored.dim() != 3:
            raise ThresholdFileError(f"{w}: 'set{i}.thresholds' must be float32 [num_layers, heads, row ids], got "
                                     f"{stored.dtype} {list(stored.shape)}")
        extend_to = e["extend_to"]
        if isinstance(extend_to, bool) or not isinstance(extend_to, int) or \
                not stored.shape[-1] <= extend_to <= max(MAX_ROW_IDS, stored.shape[-1]):
            raise ThresholdFileError(f"{w}: 'extend_to' must be an integer from the stored row ids "
                                     f"({stored.shape[-1]}) to {MAX_ROW_IDS}, got {extend_to!r}")
        if extend_to > stored.shape[-1] and lm is None:
            raise ThresholdFileError(f"{w}: 'extend_to' {extend_to} exceeds the stored row ids without a length model")
        th = extend_table(stored, lm, extend_to)
        sdc = tensors.get(f"set{i}.sdc_table")
        if sdc is not None and meta["placement"] != "pre_softmax":
            raise ThresholdFileError(f"{w}: an sdc_table is only valid with pre_softmax thresholds, the file's "
                                     f"placement is {meta['placement']!r}")
        if sdc is not None and extend_to > stored.shape[-1]:
            if sm is None or sdc.dtype != torch.float32 or sdc.dim() != 3:
                raise ThresholdFileError(f"{w}: an sdc_table beyond the calibrated row ids needs its length model")
            sdc = extend_sdc(sdc, sm, extend_to)
        rule = _rule(e.get("layerwise_rule"), w)
        try:
            ts = ThresholdSet(
                thresholds=th, counts=tensors[f"set{i}.sample_counts"], layer_k=e["layer_k"],
                placement=meta["placement"], model_name=meta["model_name"], attention_config=cfg,
                alpha=e["alpha"], sdc_table=sdc, calibration_text=str(e.get("calibration_text", "")),
                calibration_samples=int(e.get("calibration_samples", 0)),
                calibration_tokens=int(e.get("calibration_tokens", 0)),
                topk_at_calibration=bool(e.get("topk_at_calibration", False)),
                layerwise=bool(e.get("layerwise", False)), layerwise_rule=rule,
                source=str(e.get("source", "")),
                selection=selection, estimator=e["estimator"], length_model=lm, sdc_length_model=sm,
                path=str(path), set_index=i)
        except (TypeError, ValueError) as ex:
            raise ThresholdFileError(f"{w}: malformed metadata: {ex}") from ex
        validate_set(ts, where=w)
        out.append(ts)
    return out


def load_threshold_sets(path: Union[str, os.PathLike]) -> list:
    """Read and validate every threshold set of a file (format version 1 or 2).

    Parameters
    ----------
    path : str or path-like

    Returns
    -------
    list of ThresholdSet
        In file order; each with ``path`` and ``set_index``. Tables with a length model
        are extended to their ``extend_to`` row ids.

    Raises
    ------
    FileNotFoundError
        No such file.
    ThresholdFileError
        A directory, not a threshold file, corrupt or truncated, a newer format version,
        missing or malformed metadata, tensors of the wrong dtype or shape, or values that
        cannot be thresholds (NaN, +inf, probabilities outside [0, 1], finite values in
        rows that must be dense). Messages name the file (and the set).
    """
    path = Path(path)
    meta, tensors, version, where = _read(path)
    cfg = _file_config(meta, where)
    return (_load_v1 if version == 1 else _load_v2)(meta, tensors, cfg, where, path)


def load_thresholds(path: Union[str, os.PathLike], index: Optional[int] = None) -> ThresholdSet:
    """Read one threshold set of a file.

    Parameters
    ----------
    path : str or path-like
    index : int, optional
        Which set; may be omitted when the file holds one set.

    Returns
    -------
    ThresholdSet

    Raises
    ------
    FileNotFoundError, ThresholdFileError
        As :func:`load_threshold_sets`; also ``index`` out of range, or omitted for a file
        of several sets (the message names the file and lists the sets' k).
    TypeError
        ``index`` is not an integer (bool and str included).
    """
    sets = load_threshold_sets(path)
    return pick_set(sets, index, str(path))


def pick_set(sets: Sequence[ThresholdSet], index: Optional[int], path: str) -> ThresholdSet:
    """``sets[index]`` with the errors of :func:`load_thresholds`."""
    ks = ", ".join(f"{i}: k={ts.k}" for i, ts in enumerate(sets))
    if index is None:
        if len(sets) == 1:
            return sets[0]
        raise ThresholdFileError(f"thresholds file {path!r} holds {len(sets)} threshold sets ({ks}); "
                                 "choose one (index / --threshold-set)")
    i = as_index(index)
    if i is None:
        raise TypeError(f"threshold set index must be an int (for thresholds file {path!r}), got {index!r}")
    if not 0 <= i < len(sets):
        raise ThresholdFileError(f"threshold set index {i!r} is out of range for thresholds file {path!r}, "
                                 f"which holds {len(sets)} set{'s' if len(sets) != 1 else ''} ({ks})")
    return sets[i]


def as_index(value) -> Optional[int]:
    """``value`` as a Python int when it is an integer (int, numpy integer, one-element
    integer tensor), else None (bool, str, bytes, float, float tensor, array of several
    elements): the check of a threshold-set index."""
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _rule(value, where: str):
    """A set's ``layerwise_rule`` entry: None, or ``{"sdc": str, "vmc": bool}``."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("sdc"), str) or not isinstance(value.get("vmc"), bool):
        raise ThresholdFileError(f"{where}: malformed metadata: layerwise_rule must be "
                                 f'{{"sdc": str, "vmc": bool}}, got {value!r}')
    return {"sdc": value["sdc"], "vmc": value["vmc"]}
