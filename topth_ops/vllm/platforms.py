"""Registration of the backend with vLLM's attention registry, per platform.

========  ===========================================================  ==================
platform  how the backend is reached                                   verified
========  ===========================================================  ==================
CPU       ``CPU_ATTN`` is overridden by ``topth_ops.vllm.dispatch``:    vLLM 0.32 CPU
          ``cpu_backend`` (vLLM's CPU attention, thresholded decode    build (tests, docs)
          rows through the op) when the settings are active, vLLM's
          own CPU attention otherwise (vLLM's CPU platform always
          picks ``CPU_ATTN`` and ignores ``--attention-backend``)
CUDA      ``FLASH_ATTN`` and ``TRITON_ATTN`` are overridden the same   on the CPU only
          way: ``gpu_backend`` (the backend vLLM picks, or the one     (classes, split,
          ``--attention-backend`` names, with thresholded decode rows  no host sync);
          through the op) when the settings are active. ``CUSTOM``     never on a GPU
          is the generic ``backend`` (its own NHD cache, dense
          prefill in PyTorch) for other platforms and for comparison
          (not registered on Ascend, whose ``CUSTOM`` is its own)
Ascend    vLLM-Ascend's platform picks its attention class itself;    never run (no NPU);
          its ``get_attn_backend_cls`` is wrapped: when the settings   wiring on the CPU
          are active and it picks ``AscendAttentionBackend``, the      with a stand-in
          ``ascend_backend`` subclass (vLLM-Ascend's attention,
          thresholded decode rows of decode-only steps through the
          op); another class (MLA, ...) is refused
========  ===========================================================  ==================
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.topth_ops")

DISPATCH = "topth_ops.vllm.dispatch"
BACKEND = "topth_ops.vllm.backend.TopthAttentionBackend"
ASCEND_BACKEND = f"{DISPATCH}.ASCEND_ATTN"
#: vLLM-Ascend's attention class that ASCEND_BACKEND subclasses.
ASCEND_PLATFORM = "vllm_ascend.attention.attention_v1.AscendAttentionBackend"
_done = False


def register_for_platform() -> None:
    """Register the backend for the platform of this process (idempotent)."""
    global _done
    if _done:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if getattr(current_platform, "device_type", "") != "npu":  # vLLM-Ascend registers its own CUSTOM
        register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, f"{DISPATCH}.CPU_ATTN")
    elif current_platform.is_cuda():
        from .gpu_backend import PLATFORM_BACKENDS

        for name in PLATFORM_BACKENDS:
            register_backend(AttentionBackendEnum[name], f"{DISPATCH}.{name}")
        _wrap_platform(type(current_platform), _cuda_choice, "CUDA; never run on a GPU")
    elif getattr(current_platform, "device_type", "") == "npu":
        _wrap_ascend(type(current_platform))
    _done = True


def _wrap_platform(platform_cls, choose, what: str) -> None:
    """Wrap ``platform_cls.get_attn_backend_cls`` (idempotent): while the Top-Theta
    settings are active, the class path it returns goes through ``choose(path)``, which
    returns the path to use or raises."""
    original = platform_cls.get_attn_backend_cls
    if getattr(original, "_topth_wrapped", False):
        return

    def get_attn_backend_cls(cls, *args, **kwargs):
        from .dispatch import _additional_config
        from .settings import is_active

        path = original.__func__(cls, *args, **kwargs) if hasattr(original, "__func__") else original(*args, **kwargs)
        return choose(path) if is_active(additional_config=_additional_config()) else path

    get_attn_backend_cls._topth_wrapped = True
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    logger.info("topth: wrapped %s.get_attn_backend_cls (%s)", platform_cls.__name__, what)


def _cuda_choice(path: str) -> str:
    """vLLM's CUDA choice must be a backend the plugin splits (never a silent dense run)."""
    from .gpu_backend import PLATFORM_BACKENDS

    if path.startswith("topth_ops.vllm."):  # a split class (through dispatch) or the generic CUSTOM backend
        return path
    raise NotImplementedError(f"topth vLLM backend: vLLM picked {path} for this model; Top-Theta serves decode "
                              f"rows inside {', '.join(PLATFORM_BACKENDS)} (start vLLM with --attention-backend "
                              "FLASH_ATTN or TRITON_ATTN) or the generic CUSTOM backend")


def _ascend_choice(path: str) -> str:
    """vLLM-Ascend (never run: no NPU was available): ``AscendAttentionBackend`` becomes
    the subclass of :mod:`topth_ops.vllm.ascend_backend`; the others (MLA, sparse
    attention), whose caches the op does not read, are refused."""
    if path != ASCEND_PLATFORM:
        raise NotImplementedError(f"topth vLLM backend: vLLM-Ascend picks {path} for this model; Top-Theta "
                                  f"serves only models that {ASCEND_PLATFORM} serves")
    return ASCEND_BACKEND


def _wrap_ascend(platform_cls) -> None:
    _wrap_platform(platform_cls, _ascend_choice, "vLLM-Ascend; never run on an NPU")
