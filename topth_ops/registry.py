"""Backend descriptors, the registry, and backend selection.

A backend is one :class:`Backend` object: static facts (name, device type, dtypes, head
dims), :meth:`Backend.unavailable_reasons` for the machine, :meth:`Backend.input_reasons`
for one call, and :meth:`Backend.forward`, which writes the output (and stats) into
buffers the caller allocated. Descriptor modules are imported lazily, on first use of
the registry, and must not import Triton, CANN or a device runtime at module level: the
heavy imports happen inside ``forward`` (or inside an availability probe that catches
ImportError).

Selection (pattern of xformers' fmha dispatch and vLLM's attention selector):
- an explicit name (``backend=`` argument, else the ``TOPTH_BACKEND`` environment
  variable) must be able to run the inputs, else NotImplementedError with its reasons;
- otherwise the priority list of the inputs' device type is walked and the first backend
  with no reasons wins; skipping a backend is logged (once per distinct message);
- when nothing qualifies, the error lists the inputs and every backend's reasons.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Iterable, Optional, Sequence

import torch

from .contract import DecodeInputs, DecodeStats
from .validation import dtype_str

logger = logging.getLogger("topth_ops")

ENV_BACKEND = "TOPTH_BACKEND"

# Modules that define the built-in backends; each exposes ``BACKENDS`` (a list of Backend).
_BUILTIN_MODULES: tuple[str, ...] = (
    "topth_ops.backends.cpu",
    "topth_ops.backends.torch_ref",
    "topth_ops.backends.triton.backend",
    "topth_ops.backends.ascendc",
)

# Automatic choice, per device type, highest priority first. Backends that are only for
# explicit choice (a CPU model of an accelerator kernel, an interpreter) are not listed.
_PRIORITY: dict[str, list[str]] = {
    "cuda": ["triton", "torch"],
    "npu": ["ascendc", "torch"],
    "cpu": ["cpu", "torch"],
}
_DEFAULT_PRIORITY = ["torch"]


class Backend:
    """Descriptor of one backend. Subclasses set the class attributes and override
    :meth:`forward`, and :meth:`unavailable_reasons` / :meth:`input_reasons` as needed.

    Attributes
    ----------
    name : str
        Registry name, e.g. ``"torch"``, ``"triton"``, ``"ascendc"``.
    device_type : str
        torch device type it runs on (``"cpu"``, ``"cuda"``, ``"npu"``), or ``"any"``.
    dtypes : tuple of torch.dtype
        Input dtypes it accepts.
    head_dims : tuple of int or None
        head_dim values it accepts; None means any.
    head_dims_note : str
        With ``head_dims`` None: a limit that depends on other shapes (checked by
        :meth:`input_reasons`), shown by ``topth-ops info`` instead of "any".
    description : str
        One line for ``topth-ops info``.
    features : frozenset of str
        Optional parts of the contract it implements: ``"paged"`` (block_table, NHD/HND
        caches), ``"group_selection"`` (``selection="group"``), ``"threshold_sets"``
        (3-D thresholds with threshold_set). Inputs that use a missing one are refused
        with a reason, never computed wrongly.
    """

    name: str = ""
    device_type: str = "any"
    dtypes: tuple = (torch.float16, torch.bfloat16, torch.float32)
    head_dims: Optional[tuple] = None
    head_dims_note: str = ""
    description: str = ""
    features: frozenset = frozenset()

    def unavailable_reasons(self) -> list[str]:
        """Why this backend cannot run on this machine at all (empty list: available)."""
        return []

    def is_available(self) -> bool:
        return not self.unavailable_reasons()

    def devices(self) -> list[torch.device]:
        """Devices of this machine on which the backend runs (used by tests and benches)."""
        if self.device_type in ("any", "cpu"):
            return [torch.device("cpu")]
        return [torch.device(self.device_type)]

    def input_reasons(self, inputs: DecodeInputs) -> list[str]:
        """Backend-specific reasons why these (valid) inputs cannot run; override to add."""
        return []

    def not_supported_reasons(self, inputs: DecodeInputs) -> list[str]:
        """Every reason this backend cannot run ``inputs`` here; empty means it can."""
        reasons = list(self.unavailable_reasons())
        if self.device_type != "any" and inputs.device.type != self.device_type:
            reasons.append(f"needs {self.device_type} tensors, got {inputs.device.type}")
        if inputs.dtype not in self.dtypes:
            names = ", ".join(dtype_str(d) for d in self.dtypes)
            reasons.append(f"dtype {dtype_str(inputs.dtype)} not supported (supports {names})")
        if self.head_dims is not None and inputs.head_dim not in self.head_dims:
            reasons.append(f"head_dim {inputs.head_dim} not supported (supports {list(self.head_dims)})")
        reasons.extend(self.feature_reasons(inputs))
        if not reasons:
            reasons.extend(self.input_reasons(inputs))
        return reasons

    def feature_reasons(self, inputs: DecodeInputs) -> list[str]:
        """Reasons for inputs that use an optional part of the contract not in :attr:`features`."""
        used = []  # built only for the features the inputs use (this runs on every call)
        if inputs.block_table is not None:
            used.append(("paged", f"paged KV caches (block_table, kv_layout={inputs.kv_layout})"))
            if inputs.kv_layout == "VLLM_AMX":
                used.append(("vllm_amx", "vLLM's AMX cache layout (kv_layout='VLLM_AMX')"))
        if inputs.selection == "group":
            used.append(("group_selection", "selection='group'"))
        if inputs.threshold_set is not None:
            used.append(("threshold_sets", "threshold sets (3-D thresholds)"))
        return [f"{what} not implemented by this backend" for feat, what in used if feat not in self.features]

    def supports(self, inputs: DecodeInputs) -> bool:
        return not self.not_supported_reasons(inputs)

    def forward(self, inputs: DecodeInputs, out: torch.Tensor, stats: Optional[DecodeStats]) -> None:
        """Compute the op into ``out`` (``[batch, num_q_heads, head_dim]``, input dtype) and,
        when ``stats`` is given, into its three tensors. Every element must be written."""
        raise NotImplementedError(f"backend {self.name!r} has no forward")

    def __repr__(self) -> str:
        return f"<Backend {self.name} ({self.device_type})>"


_lock = threading.Lock()
_backends: dict[str, Backend] = {}
_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        for mod in _BUILTIN_MODULES:
            for b in importlib.import_module(mod).BACKENDS:
                _backends.setdefault(b.name, b)
        _loaded = True


def register_backend(backend: Backend, *, priority: Optional[int] = None) -> None:
    """Add a backend (a new hardware port, say) to the registry.

    Parameters
    ----------
    backend : Backend
        The descriptor; its name must be new.
    priority : int, optional
        Position in the automatic-selection list of ``backend.device_type`` (0 = first;
        a backend of device type "any" joins the list of every device type). None
        registers it for explicit choice only.

    Raises
    ------
    ValueError
        The name is empty or already registered.
    """
    _ensure_loaded()
    if not backend.name:
        raise ValueError("backend.name must be a non-empty string")
    with _lock:
        if backend.name in _backends:
            raise ValueError(f"backend name {backend.name!r} is already registered")
        _backends[backend.name] = backend
        if priority is not None:
            if backend.device_type == "any":  # joins every device type's order
                orders = list(_PRIORITY.values()) + [_DEFAULT_PRIORITY]
            else:
                orders = [_PRIORITY.setdefault(backend.device_type, list(_DEFAULT_PRIORITY))]
            for order in orders:
                order.insert(priority, backend.name)


def unregister_backend(name: str) -> None:
    """Remove a backend registered with :func:`register_backend` (built-ins included).

    Raises
    ------
    ValueError
        Unknown name.
    """
    get_backend(name)
    with _lock:
        del _backends[name]
        for order in list(_PRIORITY.values()) + [_DEFAULT_PRIORITY]:
            if name in order:
                order.remove(name)


def list_backends() -> list[Backend]:
    """Every registered backend, available on this machine or not."""
    _ensure_loaded()
    return list(_backends.values())


def get_backend(name: str) -> Backend:
    """The backend called ``name``.

    Raises
    ------
    ValueError
        Unknown name; the message lists the registered names.
    """
    _ensure_loaded()
    if not isinstance(name, str) or name not in _backends:
        known = ", ".join(sorted(_backends))
        raise ValueError(f"backend must be one of: {known}; got {name!r}")
    return _backends[name]


def priority(device_type: str) -> list[str]:
    """Automatic-selection order for a device type, highest priority first."""
    _ensure_loaded()
    return list(_PRIORITY.get(device_type, _DEFAULT_PRIORITY))


_logged: set[str] = set()


def log_once(msg: str) -> None:
    """Log ``msg`` as a warning on the "topth_ops" logger, once per process (decode loops
    call the op thousands of times)."""
    if msg not in _logged:
        _logged.add(msg)
        logger.warning(msg)


def _reason_lines(items: Iterable[tuple[str, Sequence[str]]]) -> str:
    return "\n".join(f"  {name}: {'; '.join(reasons) or 'ok'}" for name, reasons in items)


def select_backend(inputs: DecodeInputs, requested: Optional[str] = None) -> Backend:
    """Choose the backend that runs ``inputs``.

    Parameters
    ----------
    inputs : DecodeInputs
    requested : str, optional
        Explicit backend name. When None, the ``TOPTH_BACKEND`` environment variable is
        used if set and non-empty; else the priority list of the inputs' device type.

    Returns
    -------
    Backend

    Raises
    ------
    ValueError
        An explicit name that is not registered.
    NotImplementedError
        An explicit backend that cannot run the inputs (with its reasons), or no backend
        that can (with the inputs and every backend's reasons).
    """
    name = requested if requested else os.environ.get(ENV_BACKEND, "") or None
    if name:
        source = "backend=" if requested else f"{ENV_BACKEND}="
        try:
            b = get_backend(name)
        except ValueError as e:
            if requested:
                raise
            raise ValueError(f"the environment variable {ENV_BACKEND}={name!r} names no backend: {e}") from None
        reasons = b.not_supported_reasons(inputs)
        if reasons:
            raise NotImplementedError(
                f"{source}{name!r} cannot run these inputs: {'; '.join(reasons)}\n"
                f"inputs: {inputs.describe()}"
            )
        return b
    skipped: list[tuple[str, list[str]]] = []
    for cand in priority(inputs.device.type):
        b = _backends[cand]
        reasons = b.not_supported_reasons(inputs)
        if not reasons:
            if skipped:
                log_once(
                    f"topth_ops: using backend {b.name!r} for {inputs.device.type} inputs; skipped:\n"
                    + _reason_lines(skipped)
                )
            return b
        skipped.append((cand, reasons))
    every = [(b.name, b.not_supported_reasons(inputs)) for b in list_backends()]
    raise NotImplementedError(
        f"no backend can run these inputs: {inputs.describe()}\n" + _reason_lines(every)
    )
