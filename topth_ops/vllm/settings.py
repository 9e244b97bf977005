"""Settings of the vLLM backend: read from environment variables and vLLM's
``additional_config``, checked against the served model and the tensor-parallel layout
at engine start. Nothing here imports vLLM.

Environment variables (``additional_config={"topth": {...}}`` keys in brackets override
them):

========================  ==================  ==============================================
variable                  [key]               meaning
========================  ==================  ==============================================
TOPTH_VLLM_MODE           [mode]              ``topth`` (default when a file is given) or
                                              ``dense`` (same backend, every row kept: A/B)
TOPTH_VLLM_THRESHOLDS     [thresholds]        threshold file from ``topth-ops calibrate``
TOPTH_VLLM_THRESHOLD_SET  [threshold_set]     which set of a file holding several (0-based;
                                              needed only then)
TOPTH_VLLM_VMC            [vmc]               1/0: V-mean compensation (paper 3.2.2)
TOPTH_VLLM_SDC            [sdc]               none, exact, exp_threshold, offline (pre_softmax)
TOPTH_VLLM_SDC_GAMMA      [sdc_gamma]         gamma of exp_threshold
TOPTH_VLLM_OP_BACKEND     [op_backend]        backend of the decode op (default: automatic)
TOPTH_VLLM_STATS          [stats_file]        JSON report of V rows read, rewritten as it runs
TOPTH_VLLM_LOG_INTERVAL   [log_interval]      seconds between statistics log lines (0: off)
TOPTH_VLLM_METRICS        [metrics]           1/0: fidelity statistics and Prometheus metrics
                                              (default 1; docs/vllm.md, "Metrics")
TOPTH_VLLM_GUARD_BAND     [guard_band]        k~/k band of the drift guardrail (``0.8,1.25``)
TOPTH_VLLM_GUARD_WINDOW   [guard_window]      decode steps of the guardrail's window (256)
TOPTH_VLLM_DENSE_BEYOND   [dense_beyond]      rows longer than this row id are served dense
                                              (0: off)
========================  ==================  ==============================================

The backend is active when TOPTH_VLLM_MODE or TOPTH_VLLM_THRESHOLDS is set, or when
``additional_config`` has a ``"topth"`` entry; otherwise vLLM keeps its own attention.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Optional

from ..contract import DEFAULT_SDC_GAMMA, SDC_MODES
from ..thresholds import ThresholdFileError, ThresholdSet, attention_config_of, load_thresholds

MODES = ("topth", "dense")
CONFIG_KEY = "topth"
ENV = {
    "mode": "TOPTH_VLLM_MODE",
    "thresholds": "TOPTH_VLLM_THRESHOLDS",
    "threshold_set": "TOPTH_VLLM_THRESHOLD_SET",
    "vmc": "TOPTH_VLLM_VMC",
    "sdc": "TOPTH_VLLM_SDC",
    "sdc_gamma": "TOPTH_VLLM_SDC_GAMMA",
    "op_backend": "TOPTH_VLLM_OP_BACKEND",
    "stats_file": "TOPTH_VLLM_STATS",
    "log_interval": "TOPTH_VLLM_LOG_INTERVAL",
    "metrics": "TOPTH_VLLM_METRICS",
    "guard_band": "TOPTH_VLLM_GUARD_BAND",
    "guard_window": "TOPTH_VLLM_GUARD_WINDOW",
    "dense_beyond": "TOPTH_VLLM_DENSE_BEYOND",
}
ENV_PREFIX = "TOPTH_VLLM_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class TopthConfigError(ValueError):
    """Settings of the vLLM backend that cannot be used (raised at engine start)."""


@dataclass(frozen=True)
class VllmTopthSettings:
    """What the vLLM backend does (see the module docstring for where each field comes from).

    Attributes
    ----------
    mode : {"topth", "dense"}
    thresholds : str or None
        Path of the threshold file; required by mode "topth".
    threshold_set : int or None
        Index of the set to serve when the file holds several (``topth-ops calibrate
        --k 16,32,64`` writes one set per k); None for a file of one set.
    vmc : bool
    sdc : str
    sdc_gamma : float
    op_backend : str or None
        ``backend=`` of :func:`topth_ops.decode_attention`.
    stats_file : str or None
        Report path; with tensor parallelism rank r > 0 writes ``<stem>.rank<r><suffix>``.
    log_interval : float
        Seconds between statistics log lines; 0 turns them off.
    metrics : bool
        Per-layer, per-set fidelity statistics (k~/k, dropped mass, V rows) and their
        Prometheus metrics; the drift guardrail needs them.
    guard_band : tuple of float
        ``(low, high)``: the guardrail warns when a layer's windowed k~/k leaves it.
    guard_window : int
        Decode steps the guardrail's k~/k is averaged over.
    dense_beyond : int
        Decode rows whose row id exceeds it are served dense; 0 turns it off.
    """

    mode: str = "topth"
    thresholds: Optional[str] = None
    threshold_set: Optional[int] = None
    vmc: bool = False
    sdc: str = "none"
    sdc_gamma: float = DEFAULT_SDC_GAMMA
    op_backend: Optional[str] = None
    stats_file: Optional[str] = None
    log_interval: float = 10.0
    metrics: bool = True
    guard_band: tuple = (0.8, 1.25)
    guard_window: int = 256
    dense_beyond: int = 0

    def validated(self) -> "VllmTopthSettings":
        """Check the values that need no file or model.

        Raises
        ------
        TopthConfigError
            Unknown mode or sdc, mode "topth" without a file, a negative log interval or
            a non-positive sdc_gamma.
        """
        if self.mode not in MODES:
            raise TopthConfigError(f"topth vLLM backend: mode must be one of {MODES}, got {self.mode!r} "
                                   f"({ENV['mode']} or additional_config['topth']['mode'])")
        if self.sdc not in SDC_MODES:
            raise TopthConfigError(f"topth vLLM backend: sdc must be one of {SDC_MODES}, got {self.sdc!r}")
        if self.mode == "topth" and not self.thresholds:
            raise TopthConfigError(
                "topth vLLM backend: mode 'topth' needs a threshold file: set "
                f"{ENV['thresholds']}=PATH (from `topth-ops calibrate`) or additional_config "
                "{'topth': {'thresholds': PATH}}; use mode 'dense' for the dense A/B run")
        if self.threshold_set is not None and self.threshold_set < 0:
            raise TopthConfigError(f"topth vLLM backend: threshold_set must be an index >= 0, got {self.threshold_set} "
                                   f"({ENV['threshold_set']} or additional_config['topth']['threshold_set'])")
        if not (self.log_interval >= 0):
            raise TopthConfigError(f"topth vLLM backend: log_interval must be >= 0 seconds, got {self.log_interval!r}")
        lo, hi = self.guard_band
        if not (0 <= lo < hi < float("inf")):
            raise TopthConfigError(f"topth vLLM backend: guard_band must be two numbers 0 <= low < high, got "
                                   f"{self.guard_band!r} ({ENV['guard_band']} or additional_config['topth']['guard_band'])")
        for key in ("guard_window", "dense_beyond"):
            v = getattr(self, key)
            if v < (1 if key == "guard_window" else 0):
                raise TopthConfigError(f"topth vLLM backend: {key} must be an integer >= "
                                       f"{1 if key == 'guard_window' else 0}, got {v!r} ({ENV[key]})")
        if not (0 < self.sdc_gamma < float("inf")):
            raise TopthConfigError(f"topth vLLM backend: sdc_gamma must be finite and > 0, got {self.sdc_gamma!r} "
                                   f"({ENV['sdc_gamma']} or additional_config['topth']['sdc_gamma'])")
        return self


def _parse_int(raw: Any, where: str, what: str) -> int:
    """``raw`` (int or decimal string, not bool) as an int; TopthConfigError naming ``where``."""
    if isinstance(raw, bool):
        raise TopthConfigError(f"topth vLLM backend: {where} must be {what}, got {raw!r}")
    try:
        return int(str(raw).strip())
    except ValueError:
        raise TopthConfigError(f"topth vLLM backend: {where} must be {what}, got {raw!r}") from None


def _parse(key: str, raw: Any, where: str) -> Any:
    kind = {f.name: f.type for f in fields(VllmTopthSettings)}[key]
    if key in ("vmc", "metrics"):
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
        raise TopthConfigError(f"topth vLLM backend: {where} must be 1/0 (true/false), got {raw!r}")
    if key == "guard_band":
        parts = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
        try:
            band = tuple(float(x) for x in parts)
        except (TypeError, ValueError):
            band = ()
        if len(band) != 2:
            raise TopthConfigError(f"topth vLLM backend: {where} must be two numbers 'low,high', got {raw!r}")
        return band
    if key in ("guard_window", "dense_beyond"):
        return _parse_int(raw, where, "an integer")
    if key == "threshold_set":
        if raw is None or (isinstance(raw, str) and raw.strip() == ""):
            return None
        return _parse_int(raw, where, "an integer index")
    if key in ("sdc_gamma", "log_interval"):
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise TopthConfigError(f"topth vLLM backend: {where} must be a number, got {raw!r}") from None
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        return None if "Optional" in str(kind) else raw
    if not isinstance(raw, (str, os.PathLike)):
        raise TopthConfigError(f"topth vLLM backend: {where} must be a string, got {type(raw).__name__} {raw!r}")
    return os.fspath(raw).strip()


def unknown_variables(environ: Mapping[str, str]) -> list:
    """``TOPTH_VLLM_*`` variables of ``environ`` that are not settings (misspelt names)."""
    return sorted(v for v in environ if v.startswith(ENV_PREFIX) and v not in ENV.values())


def _unknown_message(unknown: list) -> str:
    return (f"unknown environment variable{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
            f"not a known variable of the topth vLLM backend; known: {', '.join(ENV.values())}")


def is_active(environ: Optional[Mapping[str, str]] = None, additional_config: Optional[Mapping] = None) -> bool:
    """Whether the backend should replace vLLM's attention: TOPTH_VLLM_MODE or
    TOPTH_VLLM_THRESHOLDS set (non-empty), or ``additional_config["topth"]`` present.
    Unknown ``TOPTH_VLLM_*`` variables give a UserWarning (a misspelt name would
    otherwise leave vLLM's own attention running without notice)."""
    env = os.environ if environ is None else environ
    unknown = unknown_variables(env)
    if unknown:
        warnings.warn(f"topth vLLM backend: {_unknown_message(unknown)}", UserWarning, stacklevel=2)
    if env.get(ENV["mode"], "").strip() or env.get(ENV["thresholds"], "").strip():
        return True
    return bool(additional_config) and CONFIG_KEY in additional_config


def from_sources(environ: Optional[Mapping[str, str]] = None,
                 additional_config: Optional[Mapping] = None) -> VllmTopthSettings:
    """Settings from the environment, overridden by ``additional_config["topth"]``.

    Parameters
    ----------
    environ : mapping, optional
        Default ``os.environ``.
    additional_config : mapping, optional
        vLLM's ``additional_config`` (``--additional-config`` JSON); its ``"topth"`` entry
        is a dict with the keys of the module table.

    Returns
    -------
    VllmTopthSettings
        Validated (:meth:`VllmTopthSettings.validated`); mode defaults to "topth" when a
        file is given.

    Raises
    ------
    TopthConfigError
        Unknown keys, unparsable values, or invalid settings.
    """
    env = os.environ if environ is None else environ
    unknown = unknown_variables(env)
    if unknown:
        raise TopthConfigError(f"topth vLLM backend: {_unknown_message(unknown)}")
    values: dict[str, Any] = {}
    for key, var in ENV.items():
        if var in env and env[var].strip() != "":
            values[key] = _parse(key, env[var], var)
    extra = (additional_config or {}).get(CONFIG_KEY) if additional_config else None
    if extra is not None:
        if not isinstance(extra, Mapping):
            raise TopthConfigError("topth vLLM backend: additional_config['topth'] must be a dict, got "
                                   f"{type(extra).__name__}")
        unknown = sorted(set(extra) - set(ENV))
        if unknown:
            raise TopthConfigError(f"topth vLLM backend: unknown additional_config['topth'] keys {unknown}; "
                                   f"known: {sorted(ENV)}")
        for key, raw in extra.items():
            values[key] = _parse(key, raw, f"additional_config['topth'][{key!r}]")
    if "mode" not in values or values["mode"] is None:
        values["mode"] = "topth" if values.get("thresholds") else "dense"
    values["mode"] = str(values["mode"]).lower()
    if values.get("sdc") is None:
        values.pop("sdc", None)
    return replace(VllmTopthSettings(), **values).validated()


def model_name_of(hf_config: Any, model_path: Optional[str]) -> Optional[str]:
    """The served model's name for the threshold-file name check: ``topth_model_name`` of
    an export (``topth-ops export-hf``), else the last component of the model path."""
    name = getattr(hf_config, "topth_model_name", None)
    if name:
        return str(name)
    if model_path:
        return os.path.basename(str(model_path).rstrip("/\\")) or None
    return None


def load_for_model(settings: VllmTopthSettings, hf_config: Any, model_name: Optional[str],
                   tp_size: int) -> Optional[ThresholdSet]:
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
    ThresholdSet or None
        None in dense mode.

    Raises
    ------
    TopthConfigError
        TP size that does not divide the query heads.
    ThresholdFileError
        Missing, unreadable or corrupt file, a file for another model (layers, heads,
        head_dim differ; both are named), or an sdc mode the file cannot serve.
    """
    cfg = attention_config_of(hf_config)
    if tp_size < 1 or cfg["num_q_heads"] % tp_size:
        raise TopthConfigError(
            f"topth vLLM backend: tensor-parallel size {tp_size} does not divide the model's "
            f"{cfg['num_q_heads']} query heads, so the threshold rows cannot be split per rank")
    if settings.op_backend:
        _check_op_backend(settings.op_backend)
    if settings.mode == "dense":
        return None
    path = settings.thresholds
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "does not exist"
        raise ThresholdFileError(f"topth vLLM backend: threshold file {path!r} {what} "
                                 f"({ENV['thresholds']} / additional_config['topth']['thresholds'])")
    try:
        ts = load_thresholds(path, settings.threshold_set)
    except ThresholdFileError as e:
        raise ThresholdFileError(f"{e} (serving picks one set: {ENV['threshold_set']} / "
                                 "additional_config['topth']['threshold_set'] / `topth-ops serve --threshold-set`)") from None
    ts.check_model(hf_config, model_name, compare_name=model_name is not None)
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
    return ts


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
