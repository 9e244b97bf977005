"""Per-request sparsity: which threshold set of the engine's file (or dense attention)
each request's decode rows use.

A request chooses with ``SamplingParams(extra_args={"topth": ...})`` offline, or the
OpenAI server's ``vllm_xargs`` field (``{"vllm_xargs": {"topth": ...}}`` in the request
body; the OpenAI client passes it as ``extra_body``). Accepted values:

- ``i`` or ``"set=i"``: set ``i`` of the file (0-based, file order);
- ``"k=K"``: the set whose k is ``K`` (``ThresholdSet.k``; unique in the file);
- ``"dense"``: every row kept for this request (case and surrounding spaces ignored).

Offline, ``{"set": i}``, ``{"k": K}`` and ``{"dense": True}`` work too; the server's
``vllm_xargs`` holds only strings, numbers and lists, so there only the forms above. (vLLM
turns a JSON ``true`` / ``false`` there into 1 / 0 before this code sees it.)

Requests that choose nothing get the engine default (``TOPTH_VLLM_THRESHOLD_SET``).

Two pieces carry the choice from the request to the attention backend, both through
vLLM's logits-processor plugin interface (entry point group ``vllm.logits_processors``):

- :meth:`TopthRequests.validate_params` runs in the front end at admission: a malformed
  value, an unknown set or a k the file does not hold raises ``ValueError``, which vLLM
  turns into an HTTP 400 for that request alone (offline: the ``generate`` call raises);
- a :class:`TopthRequests` instance in the worker follows the persistent batch (requests
  added, removed, moved: the batch rows the attention metadata uses) and keeps each row's
  choice; the backend's metadata builder reads them per step with :func:`row_choices`.
  Its ``apply`` leaves the logits unchanged.

The front end checks against the file named by the ``TOPTH_VLLM_*`` environment (what
``topth-ops serve`` and :func:`topth_ops.vllm.enable` set). An engine configured only
through ``additional_config`` is checked in the worker: a choice that the file cannot
serve is then served dense (exact), with one warning naming the request's choice.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

logger = logging.getLogger("vllm.topth_ops")

#: The key of ``SamplingParams.extra_args`` / ``vllm_xargs``.
REQUEST_KEY = "topth"
_FIELDS = ("set", "k", "dense")
#: "set=N" / "k=K" (ASCII digits, spaces around "=" allowed).
_STRING_FORM = re.compile(r"(set|k)\s*=\s*([0-9]+)", re.ASCII)


class RequestChoiceError(ValueError):
    """A request's ``topth`` extra argument that cannot be served (HTTP 400)."""


@dataclass(frozen=True)
class Choice:
    """One request's choice: a set index, a k, or dense (exactly one is set)."""

    set: Optional[int] = None
    k: Optional[int] = None
    dense: bool = False

    def describe(self) -> str:
        return "dense" if self.dense else (f"set {self.set}" if self.set is not None else f"k {self.k}")


def _int_field(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise RequestChoiceError(f"extra_args['{REQUEST_KEY}']['{name}'] must be an integer >= 0, got {v!r}")
    return int(v)


def parse_choice(extra_args: Optional[Mapping[str, Any]]) -> Optional[Choice]:
    """The request's choice from its ``extra_args`` (None: the engine default).

    Raises
    ------
    RequestChoiceError
        A value that is not one of the forms of the module docstring.
    """
    if not extra_args or REQUEST_KEY not in extra_args:
        return None
    v = extra_args[REQUEST_KEY]
    forms = "a set index (0, 1, ...), \"set=N\", \"k=K\" or \"dense\""
    if isinstance(v, str):
        text = v.strip().lower()
        if text == "dense":
            return Choice(dense=True)
        m = _STRING_FORM.fullmatch(text)
        if m is None:
            raise RequestChoiceError(f"extra_args['{REQUEST_KEY}'] must be {forms}; got {v!r}")
        return Choice(**{m.group(1): int(m.group(2))})
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 0:
            raise RequestChoiceError(f"extra_args['{REQUEST_KEY}']: a set index must be >= 0, got {v}")
        return Choice(set=int(v))
    if not isinstance(v, Mapping):
        raise RequestChoiceError(f"extra_args['{REQUEST_KEY}'] must be {forms} (offline also an object with one of "
                                 f"{list(_FIELDS)}); got {v!r}")
    unknown = sorted(set(v) - set(_FIELDS))
    given = [f for f in _FIELDS if f in v]
    if unknown or len(given) != 1:
        raise RequestChoiceError(f"extra_args['{REQUEST_KEY}'] must hold exactly one of {list(_FIELDS)}; got keys "
                                 f"{sorted(v)}")
    if "dense" in v:
        if v["dense"] is not True:
            raise RequestChoiceError(f"extra_args['{REQUEST_KEY}']['dense'] must be true, got {v['dense']!r}")
        return Choice(dense=True)
    if "set" in v:
        return Choice(set=_int_field("set", v["set"]))
    return Choice(k=_int_field("k", v["k"]))


def resolve(choice: Optional[Choice], sets: Sequence, default: int, servable: Sequence[bool],
            dense_mode: bool = False) -> int:
    """The row of the engine's set table that serves ``choice``.

    Parameters
    ----------
    choice : Choice or None
        None: the engine default.
    sets : sequence of ThresholdSet
        The file's sets in file order (empty in dense mode).
    default : int
        The engine's default set (its index in ``sets``).
    servable : sequence of bool
        Per set: it can be served beside the default in one op call (same placement,
        selection and compensation tables).
    dense_mode : bool

    Returns
    -------
    int
        An index in ``[0, len(sets)]``; ``len(sets)`` is the dense row.

    Raises
    ------
    RequestChoiceError
        An index out of range, a k no set has, or a set that cannot be served beside the
        default.
    """
    n = len(sets)
    if choice is None:
        return n if dense_mode else default
    if choice.dense:
        return n
    if dense_mode:
        raise RequestChoiceError(f"extra_args['{REQUEST_KEY}']: this engine serves dense attention "
                                 "(TOPTH_VLLM_MODE=dense); it has no threshold sets to choose from")
    ks = [ts.k for ts in sets]
    if choice.set is not None:
        if choice.set >= n:
            raise RequestChoiceError(f"extra_args['{REQUEST_KEY}']: set {choice.set} does not exist; the engine's file "
                                     f"holds {n} set(s): {_listing(sets)}")
        idx = choice.set
    else:
        hits = [i for i, k in enumerate(ks) if k == choice.k]
        if len(hits) != 1:
            what = "no set" if not hits else f"{len(hits)} sets ({hits}; choose by index)"
            raise RequestChoiceError(f"extra_args['{REQUEST_KEY}']: k {choice.k}: {what} in the engine's file: "
                                     f"{_listing(sets)}")
        idx = hits[0]
    if not servable[idx]:
        d = sets[default]
        raise RequestChoiceError(f"extra_args['{REQUEST_KEY}']: set {idx} ({sets[idx].placement}, selection "
                                 f"{sets[idx].selection}) cannot be served beside the default set {default} "
                                 f"({d.placement}, selection {d.selection})")
    return idx


def _listing(sets: Sequence) -> str:
    return ", ".join(f"{i}: k={ts.k}" for i, ts in enumerate(sets)) or "none"


def servable_sets(sets: Sequence, default: int, sdc: str) -> list:
    """Per set: True when it shares the default's placement and selection (one op call
    takes one of each) and, with ``sdc="offline"``, has an SDC table."""
    d = sets[default]
    return [ts.placement == d.placement and ts.selection == d.selection
            and (sdc != "offline" or ts.sdc_table is not None) for ts in sets]


# ---------------------------------------------------------------------- front end

_FILE_CACHE: dict = {}


def _frontend_table(environ: Mapping[str, str]):
    """(sets, default, servable, dense_mode) of the engine configured by ``environ``, or
    None when the environment does not configure one (``additional_config`` engines)."""
    from .settings import from_sources, is_active
    from ..thresholds import load_threshold_sets

    if not is_active(environ):
        return None
    s = from_sources(environ)
    if s.mode != "topth":  # dense or calibrate: every request dense
        return (), 0, (), True
    st = os.stat(s.thresholds)
    key = (s.thresholds, st.st_mtime_ns, s.threshold_set, s.sdc)
    if key not in _FILE_CACHE:
        sets = load_threshold_sets(s.thresholds)
        default = s.threshold_set or 0
        _FILE_CACHE.clear()
        _FILE_CACHE[key] = (sets, default, servable_sets(sets, default, s.sdc), False)
    return _FILE_CACHE[key]


def validate(extra_args: Optional[Mapping[str, Any]], environ: Optional[Mapping[str, str]] = None) -> None:
    """Check one request's choice in the front end (see the module docstring).

    Raises
    ------
    RequestChoiceError
    """
    choice = parse_choice(extra_args)
    if choice is None:
        return
    table = _frontend_table(os.environ if environ is None else environ)
    if table is not None:
        resolve(choice, *table)


# ---------------------------------------------------------------------- worker

try:  # the plugin interface; without vLLM the parsing above still works
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
except ImportError:  # pragma: no cover - vLLM absent
    LogitsProcessor = object  # type: ignore[misc,assignment]
    BatchUpdate = MoveDirectionality = None  # type: ignore[misc,assignment]

_CURRENT: Optional["TopthRequests"] = None


class TopthRequests(LogitsProcessor):  # type: ignore[misc,valid-type]
    """Follows the persistent batch and keeps each row's :class:`Choice` (None: default).

    vLLM builds one per worker process (entry point ``vllm.logits_processors``); the
    attention backend reads the rows through :func:`row_choices`.
    """

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        validate(getattr(sampling_params, "extra_args", None))

    def __init__(self, vllm_config=None, device=None, is_pin_memory: bool = False) -> None:
        global _CURRENT
        self.rows: dict[int, Choice] = {}
        self.added = 0  # requests that entered the batch, ever (a preempted request again when resumed)
        self.size = 0   # requests in the batch now
        _CURRENT = self

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update) -> None:
        if batch_update is None:
            return
        rows = self.rows
        self.added += len(batch_update.added)  # removals are not all listed: vLLM reuses their slots
        self.size = int(batch_update.batch_size)
        for i in batch_update.removed:
            rows.pop(i, None)
        for i, params, _, _ in batch_update.added:
            try:
                c = parse_choice(getattr(params, "extra_args", None))
            except RequestChoiceError as e:  # validated at admission; defensive
                logger.warning("topth: %s; serving the request with the engine default", e)
                c = None
            if c is None:
                rows.pop(i, None)
            else:
                rows[i] = c
        for a, b, direction in batch_update.moved:
            ca, cb = rows.pop(a, None), rows.pop(b, None)
            if ca is not None:
                rows[b] = ca
            if direction == MoveDirectionality.SWAP and cb is not None:
                rows[a] = cb


def row_choices(num_rows: int) -> list:
    """The choices of batch rows ``[0, num_rows)`` this step (None: default); all None
    when no :class:`TopthRequests` runs in this process."""
    cur = _CURRENT
    if cur is None or not cur.rows:
        return [None] * num_rows
    return [cur.rows.get(i) for i in range(num_rows)]


def batch_counts() -> tuple:
    """``(requests that entered the batch so far, requests in the batch now)`` in this
    process, from the :class:`TopthRequests` processor ((0, 0) when none runs here)."""
    cur = _CURRENT
    return (0, 0) if cur is None else (cur.added, cur.size)
