"""Calibration and evaluation texts (topth_ops.hf.texts): sources, disjointness, bad input."""

from types import SimpleNamespace

import pytest

from topth_ops.hf.calib_sources import STDLIB_SOURCE, calibration_documents
from topth_ops.hf.texts import stdlib_documents, token_samples


class CharTokenizer:
    """One token per character (ids = code points); no special tokens."""

    add_bos_token = False
    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[ord(c) for c in text])


def test_default_source_is_english_documentation():
    docs, desc = calibration_documents(None)
    assert "pydoc_data.topics" in desc and len(docs) > 10
    assert all(isinstance(d, str) and d.strip() for d in docs)
    from topth_ops.hf.calib_sources import PYDOC_SOURCE

    assert calibration_documents(PYDOC_SOURCE) == (docs, desc)  # its name, for a mix


def test_stdlib_source_is_code_and_leaves_the_long_documents_out():
    tok = CharTokenizer()
    long_docs = stdlib_documents(tok, 2, 2304, 3072)
    held = [name for name, _ in long_docs]
    docs, desc = calibration_documents(STDLIB_SOURCE, exclude=held)
    assert STDLIB_SOURCE in desc and all(h in desc for h in held)
    assert len(docs) > 10 and sum("def " in d for d in docs) > len(docs) // 2  # code, not prose
    starts = {d[:500] for d in docs}
    for _, ids in long_docs:
        head = "".join(map(chr, ids[:500].tolist()))
        assert head not in starts, "a long evaluation document is also calibration text"
    all_docs, _ = calibration_documents(STDLIB_SOURCE)
    assert len(all_docs) >= len(docs)


def test_bad_sources_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        calibration_documents(str(tmp_path / "missing.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 2"):
        calibration_documents(str(bad))
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"latin\.txt.*not UTF-8"):
        calibration_documents(str(latin))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty"):
        calibration_documents(str(empty))


def test_token_samples_cut_windows_in_order():
    tok = CharTokenizer()
    out = token_samples(tok, ["abcdefgh" * 10, "xyz" * 10], samples=3, max_tokens=20)
    assert [len(s) for s in out] == [20, 20, 20]
    joined = "".join(chr(int(i)) for s in out for i in s)
    assert joined == ("abcdefgh" * 10)[:60]
    with pytest.raises(ValueError, match="samples"):
        token_samples(tok, ["abc"], samples=0, max_tokens=20)
    with pytest.raises(ValueError, match="max_tokens"):
        token_samples(tok, ["abc"], samples=1, max_tokens=1)


def test_document_aligned_samples_start_at_document_starts():
    tok = CharTokenizer()
    docs = ["A" * 50, "b" * 8, "C" * 30, "d" * 5, "E" * 12]
    out = token_samples(tok, docs, samples=10, max_tokens=20, align="document")
    text = ["".join(chr(int(i)) for i in s) for s in out]
    # each window starts where a document starts (the first document not reached before);
    # a short document runs on into the next ones (joined by a blank line); the last window
    # is kept only with >= 16 tokens
    assert text == ["A" * 20, "b" * 8 + "\n\n" + "C" * 10, "d" * 5 + "\n\n" + "E" * 12]
    # the stream cut of the same text starts its second window inside the first document
    assert "".join(chr(int(i)) for i in token_samples(tok, docs, 2, 20)[1]) == "A" * 20
    assert len(token_samples(tok, docs, samples=1, max_tokens=20, align="document")) == 1
    with pytest.raises(ValueError, match="align"):
        token_samples(tok, docs, samples=1, max_tokens=20, align="documents")
    with pytest.raises(ValueError, match="no tokens"):
        token_samples(tok, ["", ""], samples=1, max_tokens=20, align="document")


@pytest.mark.parametrize("n", [18, 19])
def test_document_aligned_window_full_within_the_separator_skips_no_document(n):
    """A window that fills inside the blank line after a document has not reached the
    next document: that document starts the next window instead of being dropped."""
    tok = CharTokenizer()
    out = token_samples(tok, ["a" * n, "B" * 30, "c" * 20], samples=3, max_tokens=20, align="document")
    text = ["".join(chr(int(i)) for i in s) for s in out]
    assert text == [("a" * n + "\n\n")[:20], "B" * 20, "c" * 20]


def test_stdlib_exclude_bad_input_is_an_error_not_a_silent_no_op():
    import sysconfig
    from pathlib import Path

    # a single string would be read as its characters and leave nothing out
    with pytest.raises(TypeError, match="exclude"):
        calibration_documents(STDLIB_SOURCE, exclude="zipimport.py")
    for bad in ([Path("zipimport.py")], [1], None):
        with pytest.raises(TypeError, match="exclude"):
            calibration_documents(STDLIB_SOURCE, exclude=bad)
    # names that match no module would be recorded as left out while nothing was
    for bad in (["nosuch_module.py"], ["zipimport"]):
        with pytest.raises(ValueError, match=repr(bad[0])):
            calibration_documents(STDLIB_SOURCE, exclude=bad)
    every = [f.name for f in Path(sysconfig.get_paths()["stdlib"]).glob("*.py")]
    with pytest.raises(ValueError, match="exclude leaves out every"):
        calibration_documents(STDLIB_SOURCE, exclude=every)
    all_docs, all_desc = calibration_documents(STDLIB_SOURCE)
    first = all_desc.split("reverse name order from ")[1].split(")")[0]  # the first module taken
    docs, desc = calibration_documents(STDLIB_SOURCE, exclude=(first,))
    assert len(docs) == len(all_docs) - 1 and f"without {first}" in desc and docs[0] != all_docs[0]


def test_humaneval_source_is_held_out_problems_last_first():
    """``"humaneval"``: prompt + canonical solution per problem, from the end of the file,
    without the excluded task ids (evaluate leaves out the problems it evaluates)."""
    from topth_ops.hf.calib_sources import HUMANEVAL_SOURCE
    from topth_ops.hf.texts import humaneval_problems

    probs = humaneval_problems()
    docs, desc = calibration_documents(HUMANEVAL_SOURCE)
    assert docs == [q["prompt"] + q["canonical_solution"] for q in reversed(probs)]
    assert "reverse file order from HumanEval/163" in desc and "without" not in desc
    held = [q["task_id"] for q in probs[:32]] + ["HumanEval/40", "HumanEval/163"]
    docs, desc = calibration_documents(HUMANEVAL_SOURCE, exclude=held + ["argparse.py"])  # other kind: ignored
    evaluated = {q["prompt"] + q["canonical_solution"] for q in probs[:32]}
    assert len(docs) == len(probs) - 34 and not evaluated & set(docs)
    assert docs[0] == probs[162]["prompt"] + probs[162]["canonical_solution"]
    assert "from HumanEval/162, without HumanEval/0-31, 40, 163)" in desc
    # the stdlib text ignores task ids (one exclude list serves a mix)
    assert calibration_documents(STDLIB_SOURCE, exclude=["HumanEval/3"]) == calibration_documents(STDLIB_SOURCE)


def test_humaneval_exclude_bad_input_is_an_error():
    from topth_ops.hf.calib_sources import HUMANEVAL_SOURCE

    for bad in ("HumanEval/164", "HumanEval/x"):
        with pytest.raises(ValueError, match=f"{bad!r} is not a HumanEval task id"):
            calibration_documents(HUMANEVAL_SOURCE, exclude=[bad])
    with pytest.raises(ValueError, match="leaves out every HumanEval problem"):
        calibration_documents(HUMANEVAL_SOURCE, exclude=[f"HumanEval/{i}" for i in range(164)])


def test_mixed_samples_divide_the_samples_among_the_texts(tmp_path):
    from topth_ops.hf.calib_sources import calibration_texts, mixed_samples
    from topth_ops.hf.texts import describe_samples

    for c in "ab":  # five documents of 30 characters each
        (tmp_path / f"{c}.jsonl").write_text("".join(f'"{c}{i}{c * 28}"\n' for i in range(5)))
    tok = CharTokenizer()
    one = calibration_texts(str(tmp_path / "a.jsonl"))
    got, desc = mixed_samples(tok, one, 3, 20, align="stream")
    assert desc == describe_samples(one[0][1], 20, "stream")  # one text: described as before mixes existed
    assert [t.tolist() for t in got] == [t.tolist() for t in token_samples(tok, one[0][0], 3, 20)]
    two = calibration_texts([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    got, desc = mixed_samples(tok, two, 5, 20, align="document")
    text = [bytes(t.tolist()).decode() for t in got]
    assert [t[:2] for t in text] == ["a0", "a1", "a2", "b0", "b1"]  # 3 + 2, each text from its start
    assert desc.startswith(f"3 from {two[0][1]} + 2 from {two[1][1]}; samples of <= 20 tokens")
    assert desc.endswith("each from a document start")
    with pytest.raises(ValueError, match=r"samples must be >= the number of calibration texts \(2\), got 1"):
        mixed_samples(tok, two, 1, 20)
    with pytest.raises(ValueError, match="given more than once"):
        calibration_texts([str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl")])
    with pytest.raises(ValueError, match="at least one source"):
        calibration_texts([])


def test_one_text_spelled_twice_is_refused(tmp_path, monkeypatch):
    """A mix must not hold one text twice under two spellings (it would get twice the
    samples, silently): the default text by None and by name, one file by two paths, and a
    file inside a folder that is also given."""
    from topth_ops.hf.calib_sources import PYDOC_SOURCE, calibration_texts

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("some text\n")
    monkeypatch.chdir(tmp_path)
    for sources in ([None, PYDOC_SOURCE], ["d/a.txt", "./d/a.txt"], ["d/a.txt", str(tmp_path / "d" / "a.txt")],
                    ["d", "d/"], ["d", "d/a.txt"], ["d/a.txt", "d"]):
        with pytest.raises(ValueError, match="more than once|also in"):
            calibration_texts(sources)


def test_unknown_source_name_lists_the_built_in_texts():
    """A misspelt built-in name is not a path that exists: the error says which names are built in."""
    for name in ("HumanEval", "python_stdlib", "pydoc"):
        with pytest.raises(FileNotFoundError, match="pydoc-topics, python-stdlib, humaneval"):
            calibration_documents(name)


def test_exclude_type_error_names_both_kinds():
    from topth_ops.hf.calib_sources import HUMANEVAL_SOURCE

    with pytest.raises(TypeError, match=r"module file names or HumanEval task ids"):
        calibration_documents(HUMANEVAL_SOURCE, exclude="HumanEval/3")


def test_humaneval_overlap_reads_what_a_calibration_text_left_out():
    """Which evaluated problems a file's calibration text may have read, from its recorded
    description (written by the code under test; the expected sets are counted here)."""
    from topth_ops.hf.calib_sources import HUMANEVAL_SOURCE, humaneval_overlap

    ids = [f"HumanEval/{i}" for i in range(40)]
    _, none = calibration_documents(HUMANEVAL_SOURCE)  # every problem
    _, some = calibration_documents(HUMANEVAL_SOURCE, exclude=[f"HumanEval/{i}" for i in range(32)] + ["HumanEval/35"])
    assert humaneval_overlap(none, ids) == ids
    assert humaneval_overlap(some, ids) == [f"HumanEval/{i}" for i in (32, 33, 34, 36, 37, 38, 39)]
    assert humaneval_overlap(some, ids[:32]) == []
    assert humaneval_overlap(f"8 from python-stdlib (x) + 8 from {some[:-1]}); samples of <= 1024 tokens",
                             ids[30:34]) == ["HumanEval/32", "HumanEval/33"]
    assert humaneval_overlap("pydoc_data.topics (...); samples of <= 1024 tokens", ids) == []
