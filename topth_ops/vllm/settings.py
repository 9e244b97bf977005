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
TOPTH_VLLM_METRICS_EVERY  [metrics_every]     statistics of one decode step in N (default 4;
                                              1: every step); step and token counts stay exact
TOPTH_VLLM_GUARD_BAND     [guard_band]        k~/k band of the drift guardrail (``0.8,1.25``)
TOPTH_VLLM_GUARD_WINDOW   [guard_window]      measured decode steps of the guardrail's window (256)
TOPTH_VLLM_DENSE_BEYOND   [dense_beyond]      rows longer than this row id are served dense
                                              (0: off)
TOPTH_VLLM_CALIBRATE_*    [calibrate_*]       mode ``calibrate`` (serve dense, write a threshold
                                              file from the served rows): ``OUT`` (file, with
                                              ``{placement}`` / ``{selection}`` / ``{k}`` as
                                              ``topth-ops calibrate --out``), ``K`` (``16,32``),
                                              ``LAYER_K`` (``0:256,1:256``), ``PLACEMENT``,
                                              ``SELECTION`` (or ``both``), ``REQUESTS`` (write
                                              after this many requests; 0: at shutdown or on
                                              SIGUSR1), ``PREFILL`` (1/0: prompt rows too);
                                              with a threshold file, a second round (every
                                              row thresholded by it while rows are recorded)
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

MODES = ("topth", "dense", "calibrate")
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
    "metrics_every": "TOPTH_VLLM_METRICS_EVERY",
    "guard_band": "TOPTH_VLLM_GUARD_BAND",
    "guard_window": "TOPTH_VLLM_GUARD_WINDOW",
    "dense_beyond": "TOPTH_VLLM_DENSE_BEYOND",
    **{f"calibrate_{k}": f"TOPTH_VLLM_CALIBRATE_{k.upper()}"
       for k in ("out", "k", "layer_k", "placement", "selection", "requests", "prefill")},
}
CALIBRATE_CHOICES = {"placement": ("post_softmax", "pre_softmax", "both"), "selection": ("head", "group", "both")}
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
    mode : {"topth", "dense", "calibrate"}
        ``calibrate``: every row dense (vLLM's own attention) while the served rows are
        recorded for a threshold file (:mod:`topth_ops.vllm.calibration`); with
        ``thresholds`` a second round: every row of the file's thresholded layers,
        prompt rows included, goes through the op with that file while the rows are
        recorded (answers are Top-Theta's).
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
    metrics_every : int
        The op's statistics, the fidelity sums and the JSON report's V rows cover one
        decode step in this many (>= 1); decode steps, tokens and rows per set are counted
        on every step.
    guard_band : tuple of float
        ``(low, high)``: the guardrail warns when a layer's windowed k~/k leaves it.
    guard_window : int
        Decode steps the guardrail's k~/k is averaged over.
    dense_beyond : int
        Decode rows whose row id exceeds it are served dense; 0 turns it off.
    calibrate_out, calibrate_k, calibrate_layer_k, calibrate_placement, calibrate_selection : str
        Mode ``calibrate``: output file template, the k list, the layer-k overrides, and
        which placements / selections to write (as ``topth-ops calibrate``). Unset
        (None): layer-k ``0:256,1:256``, post_softmax and head, or in a second round the
        served set's own k per layer, placement and selection ("" for the layer-k map:
        no overrides).
    calibrate_requests : int
        Write the file once this many requests have finished (0: at shutdown / SIGUSR1).
    calibrate_prefill : bool
        Record prompt rows (prefill and chunked prefill) besides decode rows.
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
    metrics_every: int = 4
    guard_band: tuple = (0.8, 1.25)
    guard_window: int = 256
    dense_beyond: int = 0
    calibrate_out: Optional[str] = None
    calibrate_k: Optional[str] = None
    calibrate_layer_k: Optional[str] = None
    calibrate_placement: Optional[str] = None
    calibrate_selection: Optional[str] = None
    calibrate_requests: int = 0
    calibrate_prefill: bool = True

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
        for key in ("guard_window", "dense_beyond", "metrics_every"):
            v, least = getattr(self, key), 0 if key == "dense_beyond" else 1
            if v < least:
                raise TopthConfigError(f"topth vLLM backend: {key} must be an integer >= {least}, got {v!r} "
                                       f"({ENV[key]}, additional_config['topth']['{key}'] or "
                                       f"--{key.replace('_', '-')})")
        if self.mode == "calibrate":
            self._check_calibrate()
        elif self.calibrate_out:
            raise TopthConfigError(f"topth vLLM backend: calibrate_out is set but mode is {self.mode!r}: calibration "
                                   "runs in mode 'calibrate' only (drop the mode to calibrate, or calibrate_out to "
                                   "serve)")
        if not (0 < self.sdc_gamma < float("inf")):
            raise TopthConfigError(f"topth vLLM backend: sdc_gamma must be finite and > 0, got {self.sdc_gamma!r} "
                                   f"({ENV['sdc_gamma']} or additional_config['topth']['sdc_gamma'])")
        return self


    def _check_calibrate(self) -> None:
        where = "(TOPTH_VLLM_CALIBRATE_* or additional_config['topth']['calibrate_*'])"
        if not self.calibrate_out:
            raise TopthConfigError(f"topth vLLM backend: mode 'calibrate' needs an output file: calibrate_out {where}")
        if self.thresholds:  # a second round: every row of the file's thresholded layers through the op
            if self.dense_beyond:
                raise TopthConfigError("topth vLLM backend: dense_beyond does not apply to a second calibration round "
                                       "(mode 'calibrate' with a threshold file thresholds every row; drop it)")
        else:
            decode_only = [k for k, dflt in (("threshold_set", None), ("vmc", False), ("sdc", "none"),
                                             ("dense_beyond", 0)) if getattr(self, k) != dflt]
            if decode_only:
                raise TopthConfigError(f"topth vLLM backend: {', '.join(decode_only)} "
                                       f"{'applies' if len(decode_only) == 1 else 'apply'} to Top-Theta decode; mode "
                                       "'calibrate' without a threshold file serves every row dense (drop it, or give "
                                       "the threshold file of a second round)")
        if self.calibrate_k or not self.thresholds:  # a second round takes the k of its file
            self.calibrate_ks()
        for key, choices in CALIBRATE_CHOICES.items():
            v = getattr(self, f"calibrate_{key}")
            if v is not None and v not in choices:
                raise TopthConfigError(f"topth vLLM backend: calibrate_{key} must be one of {choices}, got {v!r} {where}")
        if self.calibrate_requests < 0:
            raise TopthConfigError(f"topth vLLM backend: calibrate_requests must be an integer >= 0, got "
                                   f"{self.calibrate_requests!r} {where}")
        from ..thresholds import layer_k_overrides

        try:
            layer_k_overrides(self.calibrate_layer_k)
        except ValueError as e:
            raise TopthConfigError(f"topth vLLM backend: calibrate_layer_k: {e}") from None

    def calibrate_ks(self) -> list:
        """The k list of mode ``calibrate`` (``"16,32"`` -> [16, 32], order kept, no repeats)."""
        out = []
        for part in str(self.calibrate_k or "").replace(",", " ").split():
            k = int(part) if part.isascii() and part.isdigit() else 0
            if k < 1:
                raise TopthConfigError(f"topth vLLM backend: calibrate_k must be integers >= 1 ('16,32,64'), got "
                                       f"{self.calibrate_k!r}")
            out += [k] if k not in out else []
        if not out:
            raise TopthConfigError("topth vLLM backend: mode 'calibrate' needs the k list: calibrate_k, e.g. '16,32,64'")
        return out


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
    if key in ("vmc", "metrics", "calibrate_prefill"):
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
    if key in ("guard_window", "dense_beyond", "calibrate_requests", "metrics_every"):
        return _parse_int(raw, where, "an integer")
    if key == "threshold_set":
        if raw is None or (isinstance(raw, str) and raw.strip() == ""):
            return None
        return _parse_int(raw, where, "an integer index")
    if key == "calibrate_layer_k" and isinstance(raw, str) and raw.strip() == "":
        return ""  # no overrides (None: the default map)
    if key == "calibrate_k" and isinstance(raw, (int, list, tuple)) and not isinstance(raw, bool):
        return ",".join(str(x) for x in (raw if isinstance(raw, (list, tuple)) else [raw]))
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
    """Whether the backend should replace vLLM's attention: TOPTH_VLLM_MODE,
    TOPTH_VLLM_THRESHOLDS or TOPTH_VLLM_CALIBRATE_OUT set (non-empty), or
    ``additional_config["topth"]`` present.
    Unknown ``TOPTH_VLLM_*`` variables give a UserWarning (a misspelt name would
    otherwise leave vLLM's own attention running without notice)."""
    env = os.environ if environ is None else environ
    unknown = unknown_variables(env)
    if unknown:
        warnings.warn(f"topth vLLM backend: {_unknown_message(unknown)}", UserWarning, stacklevel=2)
    if any(env.get(ENV[k], "").strip() for k in ("mode", "thresholds", "calibrate_out")):
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
        values["mode"] = "calibrate" if values.get("calibrate_out") else "topth" if values.get("thresholds") else "dense"
    values["mode"] = str(values["mode"]).lower()
    if values.get("sdc") is None:
        values.pop("sdc", None)
    return replace(VllmTopthSettings(), **values).validated()
