"""Calibration texts: the built-in sources, user files, and mixes of them.

Built-in sources (names a ``--text`` / ``--calib-text`` takes): ``"pydoc-topics"``
(Python's English documentation, the default), ``"python-stdlib"`` (standard-library
module sources, code like the evaluation's texts) and ``"humaneval"`` (HumanEval problems
from the last, held out from evaluation by task id); otherwise .txt / .jsonl files or
folders. Several sources mix (:func:`mixed_samples` divides the samples among them).
Nothing is downloaded; the evaluation texts themselves live in :mod:`topth_ops.hf.texts`.
"""

from __future__ import annotations

import json
import platform
import re
from pathlib import Path
from typing import Optional, Sequence

import torch

from .texts import describe_samples, humaneval_problems, stdlib_modules, token_samples

STDLIB_SOURCE = "python-stdlib"  # calibration_documents' name for standard-library code
PYDOC_SOURCE = "pydoc-topics"  # calibration_documents' name for the default English text (None)
HUMANEVAL_SOURCE = "humaneval"  # calibration_documents' name for held-out HumanEval problems
HUMANEVAL_ID = "HumanEval/"  # how a HumanEval task id starts (exclude tells the two kinds of names apart)
BUILT_IN_SOURCES = (PYDOC_SOURCE, STDLIB_SOURCE, HUMANEVAL_SOURCE)
_HUMANEVAL_DESC = f"{HUMANEVAL_SOURCE} (HumanEval prompts + canonical solutions"  # written and read back (overlap)


def calibration_documents(source: Optional[str] = None, exclude: Sequence[str] = ()) -> tuple[list[str], str]:
    """Calibration documents and a one-line description of where they came from.

    Parameters
    ----------
    source : str, optional
        None or ``"pydoc-topics"`` (:data:`PYDOC_SOURCE`, the name a mix needs): the
        English documentation topics that ship with Python (``pydoc_data.topics``).
        ``"python-stdlib"`` (:data:`STDLIB_SOURCE`): standard-library module sources of
        at least 20 kB in reverse name order (code, like HumanEval and the long
        documents). ``"humaneval"`` (:data:`HUMANEVAL_SOURCE`): HumanEval prompts +
        canonical solutions in reverse file order (HumanEval/163 first), one document
        per problem. Otherwise a .txt file (one document), a .jsonl file
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
        ``exclude`` that is not a standard-library module file or HumanEval task id, a
        file that is not UTF-8,
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
        stdlib, modules = stdlib_modules()
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
    desc = (f"{_HUMANEVAL_DESC}, reverse file order from {kept[0]['task_id']}"
            + (f", without HumanEval/{without}" if spans else "") + ")")
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
        One text: :func:`describe_samples` of its description;
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


def humaneval_overlap(description: str, task_ids: Sequence[str]) -> list[str]:
    """The task ids among ``task_ids`` that a calibration text may have used.

    Parameters
    ----------
    description : str
        A calibration text's description as threshold files record it
        (``ThresholdSet.calibration_text``).
    task_ids : sequence of str
        HumanEval task ids an evaluation uses (``"HumanEval/0"``).

    Returns
    -------
    list of str
        Empty when the description has no ``humaneval`` text; else the ids of
        ``task_ids`` that its "without HumanEval/..." list does not leave out (the
        problems calibration may have read, in the order given).
    """
    if _HUMANEVAL_DESC not in description:
        return []
    m = re.search(r"without HumanEval/([0-9, -]+)\)", description)
    held: set = set()
    for part in (m.group(1).split(",") if m else []):
        a, _, b = part.strip().partition("-")
        held.update(range(int(a), int(b or a) + 1))
    return [t for t in task_ids if int(t[len(HUMANEVAL_ID):]) not in held]
