"""The served model against the settings: the model's name for the file check, loading the
threshold file and checking it against the model's attention shape and the tensor-parallel
layout (engine start and ``topth-ops serve``, before the engine loads). Nothing here
imports vLLM."""

from __future__ import annotations

import os
from typing import Any, Optional

from ..thresholds import (MODEL_NAME_KEY, ThresholdFileError, ThresholdSet, attention_config_of,
                          exported_model_name, load_threshold_sets, pick_set)
from .settings import ENV, TopthConfigError, VllmTopthSettings


def model_name_of(hf_config: Any, model_path: Optional[str]) -> Optional[str]:
    """The served model's name for the threshold-file name check: the name an export
    (``topth-ops export-hf``) records under :data:`~topth_ops.thresholds.MODEL_NAME_KEY`,
    else the last component of the model path (as the transformers path names a folder)."""
    name = exported_model_name(getattr(hf_config, MODEL_NAME_KEY, None))
    if name:
        return name
    if model_path:
        return os.path.basename(str(model_path).rstrip("/\\")) or None
    return None


def load_for_model(settings: VllmTopthSettings, hf_config: Any, model_name: Optional[str],
                   tp_size: int) -> Optional[ThresholdSet]:
    """The set to serve: :func:`load_sets_for_model`'s second value."""
    return load_sets_for_model(settings, hf_config, model_name, tp_size)[1]


def load_sets_for_model(settings: VllmTopthSettings, hf_config: Any, model_name: Optional[str],
                        tp_size: int) -> tuple[list, Optional[ThresholdSet]]:
    """Load the threshold file and check it against the served model and TP size.

    Parameters
    ----------
    settings : VllmTopthSettings
    hf_config : transformers config
        The served model's config (vLLM's ``model_config.hf_config``).
    model_name : str, optional
        For messages and the same-shape name warning.
    tp_size : int
        Tensor-parallel size.

    Returns
    -------
    (sets, ThresholdSet or None)
        Every set of the file (they share the model and attention config, checked once)
        and the one served, which is one of them; ``([], None)`` in mode dense and in
        mode calibrate without a file.

    Raises
    ------
    TopthConfigError
        TP size that does not divide the query heads.
    ThresholdFileError
        Missing, unreadable or corrupt file, a file for another model (layers, heads,
        head_dim differ; both are named), or an sdc mode the file cannot serve.

    Warns
    -----
    UserWarning
        The same attention shape under another model name, or a set calibrated layer-wise
        or in a second round served with another compensation (vmc / sdc) than it was
        calibrated with (:meth:`ThresholdSet.check_rule`).
    """
    cfg = attention_config_of(hf_config)
    if tp_size < 1 or cfg["num_q_heads"] % tp_size:
        raise TopthConfigError(
            f"topth vLLM backend: tensor-parallel size {tp_size} does not divide the model's "
            f"{cfg['num_q_heads']} query heads, so the threshold rows cannot be split per rank")
    if settings.op_backend:
        _check_op_backend(settings.op_backend)
    if settings.mode == "dense" or not settings.thresholds:  # dense, calibrate's first round: no file to serve
        return [], None
    path = settings.thresholds
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise ThresholdFileError(f"topth vLLM backend: threshold file {path!r} {what} "
                                 f"({ENV['thresholds']} / additional_config['topth']['thresholds'])")
    sets = load_threshold_sets(path)
    # the sets of a file share model and attention config: a file for another model is named first
    sets[0].check_model(hf_config, model_name, compare_name=model_name is not None)
    try:
        ts = pick_set(sets, settings.threshold_set, path)
    except ThresholdFileError as e:
        raise ThresholdFileError(f"{e} (serving picks one set: {ENV['threshold_set']} / "
                                 "additional_config['topth']['threshold_set'] / `topth-ops serve --threshold-set`)") from None
    ts.check_rule(settings.sdc, settings.vmc)  # a layer-wise or second-round set served with another compensation
    hkv = cfg["num_kv_heads"]
    if ts.selection == "group" and hkv % tp_size and tp_size % hkv:
        raise TopthConfigError(
            f"topth vLLM backend: {ts.name()} has group-selection thresholds (one per KV head); tensor-parallel "
            f"size {tp_size} must divide the model's {hkv} KV heads or be a multiple of them")
    if settings.sdc != "none" and ts.placement != "pre_softmax":
        raise ThresholdFileError(f"{ts.name()} holds {ts.placement} thresholds; sdc={settings.sdc!r} needs "
                                 "pre_softmax thresholds (set TOPTH_VLLM_SDC=none)")
    if settings.sdc == "offline" and ts.sdc_table is None:
        raise ThresholdFileError(f"sdc='offline' needs an sdc_table; {ts.name()} has none")
    return sets, ts


def _check_op_backend(name: str) -> None:
    from ..registry import get_backend

    try:
        be = get_backend(name)
    except ValueError as e:
        raise TopthConfigError(f"topth vLLM backend: {ENV['op_backend']} / additional_config['topth']['op_backend'] "
                               f"= {name!r} is not a registered backend of the op: {e}") from None
    reasons = be.unavailable_reasons()
    if reasons:
        raise TopthConfigError(f"topth vLLM backend: {ENV['op_backend']} = {name!r} is unavailable here: "
                               + "; ".join(reasons))
