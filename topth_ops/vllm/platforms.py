"""Registration of the backend with vLLM's attention registry, per platform.

========  ===========================================================  ==================
platform  how the backend is reached                                   verified
========  ===========================================================  ==================
CPU       ``CPU_ATTN`` is overridden by ``topth_ops.vllm.dispatch``:    vLLM 0.32 CPU
          ``cpu_backend`` (vLLM's CPU attention, thresholded decode    build (tests, docs)
          rows through the op) when the settings are active, vLLM's
          own CPU attention otherwise (vLLM's CPU platform always
          picks ``CPU_ATTN`` and ignores ``--attention-backend``)
CUDA      ``CUSTOM`` (the generic ``backend``): start vLLM with        untested (no GPU)
          ``--attention-backend CUSTOM`` and the ``TOPTH_VLLM_*``
          settings
Ascend    vLLM-Ascend's platform picks its attention class itself;    untested (no NPU)
          its ``get_attn_backend_cls`` is wrapped to return the
          backend when the settings are active
========  ===========================================================  ==================
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.topth_ops")

DISPATCH = "topth_ops.vllm.dispatch"
BACKEND = "topth_ops.vllm.backend.TopthAttentionBackend"
_done = False


def register_for_platform() -> None:
    """Register the backend for the platform of this process (idempotent)."""
    global _done
    if _done:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, f"{DISPATCH}.CPU_ATTN")
    elif getattr(current_platform, "device_type", "") == "npu":
        _wrap_ascend(type(current_platform))
    _done = True


def _wrap_ascend(platform_cls) -> None:
    """vLLM-Ascend (UNTESTED: no NPU was available): its NPUPlatform returns its own
    attention class path; return ours instead while the Top-Theta settings are active."""
    original = platform_cls.get_attn_backend_cls
    if getattr(original, "_topth_wrapped", False):
        return

    def get_attn_backend_cls(cls, *args, **kwargs):
        from .dispatch import _additional_config
        from .settings import is_active

        if is_active(additional_config=_additional_config()):
            return BACKEND
        return original.__func__(cls, *args, **kwargs) if hasattr(original, "__func__") else original(*args, **kwargs)

    get_attn_backend_cls._topth_wrapped = True
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    logger.info("topth: wrapped %s.get_attn_backend_cls (vLLM-Ascend; untested path)", platform_cls.__name__)
