"""Top-Theta decode attention as a vLLM attention backend (needs the ``vllm`` extra and
vLLM itself; see docs/vllm.md).

The package registers itself with every vLLM process through the entry point group
``vllm.general_plugins`` (:func:`register`). Top-Theta is switched on per engine by
``TOPTH_VLLM_THRESHOLDS=th.safetensors`` (or ``TOPTH_VLLM_MODE=dense`` for the A/B
baseline), or by ``additional_config={"topth": {"thresholds": ...}}``; otherwise vLLM's
own attention runs unchanged. Importing this package does not import vLLM; ``import
topth_ops`` never imports this package.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from .settings import ENV, MODES, TopthConfigError, VllmTopthSettings, from_sources, is_active

logger = logging.getLogger("vllm.topth_ops")

__all__ = ["register", "enable", "ENV", "MODES", "TopthConfigError", "VllmTopthSettings",
           "from_sources", "is_active"]


def register() -> None:
    """Entry point of ``vllm.general_plugins``: register the backend with vLLM's attention
    registry for this process's platform (see :mod:`topth_ops.vllm.platforms`).
    Idempotent; vLLM calls it once in every process it starts."""
    from .platforms import register_for_platform

    register_for_platform()


def enable(thresholds: Optional[str] = None, *, mode: Optional[str] = None, vmc: bool = False,
           sdc: str = "none", stats_file: Optional[str] = None, log_interval: Optional[float] = None,
           op_backend: Optional[str] = None, threshold_set: Optional[int] = None, metrics: Optional[bool] = None,
           metrics_every: Optional[int] = None, guard_band: Optional[tuple] = None, guard_window: Optional[int] = None,
           dense_beyond: Optional[int] = None, calibrate: Optional[dict] = None) -> VllmTopthSettings:
    """Switch Top-Theta on for vLLM engines this process starts from now on, by setting
    the ``TOPTH_VLLM_*`` environment variables (inherited by vLLM's engine and worker
    processes).

    Parameters
    ----------
    thresholds : str, optional
        Threshold file from ``topth-ops calibrate``; required unless ``mode="dense"``.
    mode : {"topth", "dense", "calibrate"}, optional
        Default "topth" with a file, "calibrate" with ``calibrate``, else "dense".
    vmc : bool
        V-mean compensation (paper section 3.2.2).
    sdc : {"none", "exact", "exp_threshold", "offline"}
        Softmax-denominator compensation (pre_softmax files only).
    stats_file : str, optional
        JSON report of V rows read vs dense (docs/vllm.md, "Statistics").
    log_interval : float, optional
        Seconds between statistics log lines (0: off).
    op_backend : str, optional
        Backend of the decode op.
    threshold_set : int, optional
        Which set of a file holding several (0-based); needed only then. The engine
        default: requests may choose another (``extra_args={"topth": ...}``).
    metrics : bool, optional
        Fidelity statistics and ``topth_*`` Prometheus metrics (default on).
    metrics_every : int, optional
        Statistics of one decode step in this many (default 4; 1: every step).
    guard_band : (float, float), optional
        k~/k band of the drift guardrail (default (0.8, 1.25)).
    guard_window : int, optional
        Decode steps of the guardrail's window (default 256).
    dense_beyond : int, optional
        Serve decode rows longer than this row id dense (default 0: off).
    calibrate : dict, optional
        Calibration from served traffic (mode "calibrate", the default with it): keys
        ``out`` (required), ``k`` (e.g. "16,32"), ``layer_k``, ``placement``,
        ``selection``, ``requests``, ``prefill`` (docs/vllm.md, "Calibrating in the engine").

    Returns
    -------
    VllmTopthSettings
        The settings the engines will read.

    Raises
    ------
    TopthConfigError
        Invalid settings: values and combinations of the settings themselves, checked
        now, before any engine starts; the environment is left unchanged then. What
        needs the model or the file is checked at engine start, before the weights
        load (a file for another model, a set index out of range, an SDC mode the file
        cannot serve, a second round's target, the output path); ``topth-ops serve``
        runs those checks too before it starts the server.
    """
    values = {"mode": mode, "thresholds": os.path.abspath(os.fspath(thresholds)) if thresholds is not None else None,
              "vmc": "1" if vmc else None, "sdc": None if sdc == "none" else sdc,
              "stats_file": os.path.abspath(stats_file) if stats_file else None,
              "log_interval": None if log_interval is None else str(log_interval), "op_backend": op_backend,
              "threshold_set": None if threshold_set is None else str(threshold_set),
              "metrics": None if metrics is None else ("1" if metrics else "0"),
              "metrics_every": None if metrics_every is None else str(metrics_every),
              "guard_band": None if guard_band is None else ",".join(str(float(x)) for x in guard_band),
              "guard_window": None if guard_window is None else str(guard_window),
              "dense_beyond": None if dense_beyond is None else str(dense_beyond)}
    for key, v in (calibrate or {}).items():
        if f"calibrate_{key}" not in ENV:
            raise TopthConfigError(f"topth vLLM backend: unknown calibrate key {key!r}; known: "
                                   f"{sorted(k[len('calibrate_'):] for k in ENV if k.startswith('calibrate_'))}")
        if key == "out":
            v = os.path.abspath(os.fspath(v))
        values[f"calibrate_{key}"] = str(int(v) if isinstance(v, bool) else
                                         ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
    if calibrate and mode is None:
        values["mode"] = "calibrate"
    new = {ENV[k]: str(v) for k, v in values.items() if v is not None}
    env = {k: v for k, v in os.environ.items() if k not in ENV.values()}
    env.update(new)
    settings = from_sources(env)  # raises before touching os.environ
    for var in ENV.values():
        os.environ.pop(var, None)
    os.environ.update(new)
    return settings
