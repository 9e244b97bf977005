"""bench/vllm_check's equivalence part with fake engines: ``--dtype`` reaches both engines
(vLLM's own attention and the backend at -inf thresholds), float32 by default, is recorded
with that part's results, and is refused where that part does not run; the comparison of
their tokens is reported. (The real engines run it in tests/serving.)"""

import json

import pytest

from topth_ops.bench import vllm_check
from topth_ops.bench import vllm_common as vc


@pytest.fixture
def fake_engines(monkeypatch):
    calls = []

    def run_llm(model, ids, max_tokens, topth=None, **engine):
        calls.append({"topth": topth is not None, **engine})
        if topth is not None:
            with open(topth["stats_file"], "w") as f:
                json.dump({"v_rows_fraction": 1.0}, f)
        toks = [[1, 2, 3] if topth is None or i == 0 else [1, 2, 4] for i in range(len(ids))]
        top = [[[(t, -0.1), (t + 1, -0.1)] for t in seq] for seq in toks]
        return {"tokens": toks, "top": top, "load_s": 0.0, "gen_s": 0.0}

    monkeypatch.setattr(vc, "run_llm", run_llm)
    monkeypatch.setattr(vc, "write_threshold_file", lambda model, path, kind: path)
    monkeypatch.setattr(vc, "tokenize", lambda model, prompts: [[5, 6]] * len(prompts))
    monkeypatch.setattr(vc, "humaneval_prompts", lambda n: ["p"] * n)
    return calls


@pytest.mark.parametrize("argv, dtype", [([], "float32"), (["--dtype", "bfloat16"], "bfloat16")])
def test_equiv_runs_both_engines_in_the_dtype_asked(fake_engines, tmp_path, argv, dtype):
    out = tmp_path / "r.json"
    assert vllm_check.main(["--model", "m", "--prompts", "2", "--parts", "equiv", "--json", str(out)] + argv) == 0
    assert [c["dtype"] for c in fake_engines] == [dtype, dtype]
    assert [c["topth"] for c in fake_engines] == [False, True]
    res = json.loads(out.read_text())
    assert res["equiv"]["dtype"] == dtype and "dtype" not in res  # the file part runs float32
    cmp = res["equiv"]["compare_cpu_attn_vs_topth_neg_inf"]
    assert cmp["prompts"] == 2 and cmp["identical"] == 1, cmp


def test_dtype_outside_the_choices_is_refused(fake_engines, capsys):
    with pytest.raises(SystemExit):
        vllm_check.main(["--model", "m", "--parts", "equiv", "--dtype", "int8"])
    assert "--dtype" in capsys.readouterr().err


def test_dtype_without_the_equiv_part_is_refused(fake_engines, capsys):
    with pytest.raises(SystemExit):
        vllm_check.main(["--model", "m", "--parts", "file", "--thresholds", "t", "--dtype", "bfloat16"])
    assert "'equiv' part only" in capsys.readouterr().err
    assert fake_engines == []
