"""Class paths the plugin registers with vLLM, resolved when vLLM asks for the class.

vLLM loads general plugins before the engine's configuration exists, so the plugin
cannot tell yet whether Top-Theta is wanted (``additional_config`` arrives later). It
registers ``topth_ops.vllm.dispatch.CPU_ATTN`` in place of vLLM's CPU attention (and, on
CUDA, ``.FLASH_ATTN`` / ``.TRITON_ATTN`` in place of those); vLLM resolves the name with
``getattr`` while it builds the model, with the configuration current, and this module's
``__getattr__`` then answers: the Top-Theta subclass when the settings make it active
(:func:`topth_ops.vllm.settings.is_active`; :mod:`topth_ops.vllm.cpu_backend`,
:mod:`topth_ops.vllm.gpu_backend`: the platform's attention with thresholded decode rows),
else vLLM's own class, unchanged.
"""

from __future__ import annotations


def _additional_config():
    from vllm.config import get_current_vllm_config_or_none

    cfg = get_current_vllm_config_or_none()
    return getattr(cfg, "additional_config", None) if cfg is not None else None


def __getattr__(name: str):
    if name == "CPU_ATTN":
        from .settings import is_active

        if is_active(additional_config=_additional_config()):
            from .cpu_backend import TopthCpuAttentionBackend

            return TopthCpuAttentionBackend
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    if name == "ASCEND_ATTN":  # returned by vLLM-Ascend's wrapped platform while the settings are active
        from .ascend_backend import split_backend

        return split_backend()
    from .gpu_backend import PLATFORM_BACKENDS

    if name in PLATFORM_BACKENDS:
        from .settings import is_active

        if is_active(additional_config=_additional_config()):
            from .gpu_backend import split_backend

            return split_backend(name)
        from vllm.utils.import_utils import resolve_obj_by_qualname

        return resolve_obj_by_qualname(PLATFORM_BACKENDS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
