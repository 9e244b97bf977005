"""bench/studies/arrival_order.py: the comparison of two outputs and the argument checks
(the engine runs themselves are a study, recorded in docs/vllm.md)."""

import json

import pytest

from topth_ops.bench.studies import arrival_order as ao


def _out(tokens, top):
    return {"tokens": tokens, "top": top}


def test_compare_reports_first_logprob_difference_even_when_tokens_agree():
    a = _out([[5, 6], [7, 8]], [[[(5, -0.1), (9, -2.0)], [(6, -0.2), (1, -3.0)]],
                                [[(7, -0.5), (2, -1.0)], [(8, -0.3), (3, -1.5)]]])
    b = _out([[5, 6], [7, 4]], [[[(5, -0.1), (9, -2.0)], [(6, -0.2), (1, -3.0)]],
                                [[(7, -0.5), (2, -1.0001)], [(4, -0.3), (8, -0.3)]]])
    r = ao.compare(a, b)
    assert r["identical"] == 1 and r["prompts"] == 2
    assert r["first_logprob_difference"] == [None, 0]


def test_compare_cli(tmp_path, capsys):
    a = _out([[1]], [[[(1, -0.5), (2, -1.0)]]])
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(a))
    assert ao.main(["--compare", str(pa), str(pb)]) == 0
    assert json.loads(capsys.readouterr().out) == {"identical": 1, "prompts": 1, "first_logprob_difference": [None]}


def test_compare_refuses_other_workloads_and_foreign_files(tmp_path, capsys):
    a = {"args": {"model": "m", "prompts": 1}, **_out([[1]], [[[(1, -0.5), (2, -1.0)]]])}
    b = {**a, "args": {"model": "m", "prompts": 2}}
    with pytest.raises(ValueError, match="different workloads"):
        ao.compare(a, b)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps({"x": 1}))
    for argv in ([str(pa), str(pb)], [str(pa), str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit):
            ao.main(["--compare", *argv])
        assert "--compare:" in capsys.readouterr().err


@pytest.mark.parametrize("extra, msg", [
    (["--stagger", "-1"], "--stagger must be a finite number >= 0"),
    (["--stagger", "nan"], "--stagger must be a finite number >= 0"),
    (["--stagger", "inf"], "--stagger must be a finite number >= 0"),
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be >= 1"),
    (["--new-tokens", "0"], "--new-tokens must be >= 1"),
    (["--batched-tokens", "0"], "--batched-tokens must be >= 1"),
])
def test_bad_arguments(tmp_path, extra, msg, capsys):
    with pytest.raises(SystemExit):
        ao.main(["--model", str(tmp_path), "--out", str(tmp_path / "o.json"), *extra])
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [
    (["--config", "vllm"], "--model and --out are required"),
    (["--model", "no/such/folder", "--out", "o.json"], "is not a model folder"),
])
def test_missing_or_bad_model(argv, msg, capsys):
    with pytest.raises(SystemExit):
        ao.main(argv)
    assert msg in capsys.readouterr().err
