"""Class paths the plugin registers with vLLM, resolved when vLLM asks for the class.

vLLM loads general plugins before the engine's configuration exists, so the plugin
cannot tell yet whether Top-Theta is wanted (``additional_config`` arrives later). It
registers ``topth_ops.vllm.dispatch.CPU_ATTN`` in place of vLLM's CPU attention; vLLM
resolves that name with ``getattr`` while it builds the model, with the configuration
current, and this module's ``__getattr__`` then answers: the Top-Theta backend when the
settings make it active (:func:`topth_ops.vllm.settings.is_active`; the CPU backend of
:mod:`topth_ops.vllm.cpu_backend`, vLLM's own attention with thresholded decode rows), else
vLLM's own ``CPUAttentionBackend``, unchanged.
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
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
