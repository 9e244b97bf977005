"""Threshold file format: constants, the error type, and the attention shape a file is
made for (config, fingerprint, description). The format: docs/thresholds.md."""

from __future__ import annotations

import hashlib
import json
from typing import Any

FORMAT = "topth-thresholds"
FORMAT_VERSION = 2
ESTIMATORS = ("mean", "count")
#: Most row ids a threshold table may be extended to (``extend_to``): 2**20 covers every
#: context length of today's models; a table is num_layers x heads x this many float32.
MAX_ROW_IDS = 1 << 20


def default_extend_to(longest: int, context=None) -> int:
    """How far a calibrated table is extended by default: 8x the longest calibrated row
    id, capped at the model's context and at :data:`MAX_ROW_IDS`, never below the longest.

    Parameters
    ----------
    longest : int
        The longest calibrated row id (tokens of the longest sample or served row).
    context : int, optional
        The model's context length (``max_position_embeddings``); None: no cap but MAX_ROW_IDS.

    Returns
    -------
    int
        The table's row ids ``[1, extend_to]``.
    """
    return max(longest, min(8 * longest, context or MAX_ROW_IDS, MAX_ROW_IDS))


#: Key of the source model's name in a folder written by ``topth-ops export-hf``
#: (config.json), so that the transformers and vLLM paths name an export like the model its
#: threshold files were calibrated on.
MODEL_NAME_KEY = "topth_model_name"


def exported_model_name(value: Any) -> "str | None":
    """The model name recorded under :data:`MODEL_NAME_KEY` when it is usable (a non-empty
    string), else None (a folder that is not an export, or a damaged record)."""
    return value if isinstance(value, str) and value else None


_CONFIG_KEYS = ("model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim")


class ThresholdFileError(ValueError):
    """A threshold file that cannot be used: corrupt, truncated, inconsistent, or made
    for another model or placement."""


def attention_config_of(config: Any) -> dict:
    """The attention shape of a model, from a transformers config (or a dict).

    Parameters
    ----------
    config : transformers.PretrainedConfig or dict
        A config with ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads`` (default: num_attention_heads), ``head_dim`` (default:
        hidden_size // num_attention_heads) and ``model_type``; or a dict with the keys
        of the returned dict.

    Returns
    -------
    dict
        ``{"model_type", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"}``.

    Raises
    ------
    ValueError
        ``config`` is a dict that lacks one of those five keys (the message lists them),
        whose counts are not integers >= 1, or whose query heads are not a multiple of
        its KV heads.
    AttributeError
        ``config`` is an object without ``num_attention_heads`` or
        ``num_hidden_layers``, or without ``hidden_size`` when it has no ``head_dim``.
    """
    if isinstance(config, dict):
        missing = [k for k in _CONFIG_KEYS if k not in config]
        if missing:
            raise ValueError(f"attention config lacks {missing}")
        bad = [k for k in _CONFIG_KEYS[1:] if isinstance(config[k], bool) or not isinstance(config[k], int)
               or config[k] < 1]
        if bad or not isinstance(config["model_type"], str):
            raise ValueError(f"attention config: {bad or ['model_type']} must be "
                             f"{'integers >= 1' if bad else 'a string'}, got "
                             f"{ {k: config[k] for k in (bad or ['model_type'])} }")
        if config["num_q_heads"] % config["num_kv_heads"]:
            raise ValueError(f"attention config: num_q_heads ({config['num_q_heads']}) must be a multiple of "
                             f"num_kv_heads ({config['num_kv_heads']})")
        return {k: config[k] for k in _CONFIG_KEYS}
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return {
        "model_type": str(getattr(config, "model_type", "unknown")),
        "num_layers": int(config.num_hidden_layers),
        "num_q_heads": heads,
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
    }


def fingerprint(attention_config: dict) -> str:
    """sha256 prefix (16 hex digits) of the canonical JSON of an attention config."""
    blob = json.dumps({k: attention_config[k] for k in _CONFIG_KEYS}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def describe_config(c: dict) -> str:
    """One-line human description of an attention config, for error messages.

    Parameters
    ----------
    c : dict
        An attention config as returned by :func:`attention_config_of` (keys
        ``model_type``, ``num_layers``, ``num_q_heads``, ``num_kv_heads``, ``head_dim``).

    Returns
    -------
    str
        E.g. ``"llama, 30 layers, 9 query heads, 3 KV heads, head_dim 64"``.

    Raises
    ------
    KeyError
        One of those keys is missing.
    """
    return (f"{c['model_type']}, {c['num_layers']} layers, {c['num_q_heads']} query heads, "
            f"{c['num_kv_heads']} KV heads, head_dim {c['head_dim']}")
