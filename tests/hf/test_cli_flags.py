"""Command-line checks of ``topth-ops evaluate`` and ``topth-ops calibrate`` (topth_ops.hf.cli_*):
bad or contradictory flags are refused with one-line errors before the model loads (the model
loader is replaced by one that fails)."""

import pytest

from topth_ops.cli import build_parser, main


@pytest.mark.parametrize("variants, needle", [
    (["topth-post-vmc", "topth-post"], "variant topth-post runs post_softmax with sdc=none, vmc=False"),
    (["topth-pre-vmc", "topth-pre-offline-vmc"], "variant topth-pre-vmc runs pre_softmax with sdc=none, vmc=True"),
    (["topth-pre-exp-vmc"], "variant topth-pre-exp-vmc runs pre_softmax with sdc=exp_threshold"),
])
def test_evaluate_layerwise_refuses_variants_of_another_rule(variants, needle, tmp_path, capsys, monkeypatch):
    """evaluate --layerwise-calibration calibrates one (placement, selection) pair once,
    propagating with VMC (and, pre_softmax, the offline SDC when a variant uses it): a
    variant that runs another rule would get thresholds calibrated on activations it never
    produces, and which ones would depend on the other variants listed. Refused before the
    model loads."""
    import topth_ops.hf.model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(topth_ops.hf.model, "load_model", no_model)
    argv = ["evaluate", "--json", str(tmp_path / "e.json"), "--layerwise-calibration", "--variants", *variants]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, needle", [(["--long-min-row", "0"], "--long-min-row must be >= 1, got 0"),
                                           (["--long-tokens", "-1"], "--long-tokens must be >= 0, got -1"),
                                           (["--problems", "100000"], "--problems 100000: HumanEval has 164 problems"),
                                           (["--long-dense-prefix", "-1"], "--long-dense-prefix must be >= 0, got -1"),
                                           (["--long-dense-prefix", "64", "--long-docs", "0"],
                                            "--long-dense-prefix applies to the long documents"),
                                           (["--long-dense-prefix", "3071"], "--long-tokens must exceed 3072")])
def test_evaluate_refuses_bad_long_document_flags_before_the_model_loads(flags, needle, tmp_path, capsys,
                                                                         monkeypatch):
    import topth_ops.hf.model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(topth_ops.hf.model, "load_model", no_model)
    assert main(["evaluate", "--json", str(tmp_path / "e.json"), *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_layerwise_flag_where_nothing_is_calibrated_is_refused(tmp_path, capsys, monkeypatch):
    """--layerwise-calibration (or --calib-align / --align / --calib-text) with evaluate --thresholds or
    calibrate --import-reference would be silently ignored: both are refused before the model (or config) loads;
    so are fewer calibration samples than calibration texts and a text given twice."""
    import topth_ops.hf.model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(topth_ops.hf.model, "load_model", no_model)
    monkeypatch.setattr(topth_ops.hf.model, "load_config", no_model)
    (tmp_path / "th.txt").write_text("1 2 3\n")
    for argv, needle in (
        (["evaluate", "--thresholds", str(tmp_path / "x.safetensors"), "--json", str(tmp_path / "e.json"),
          "--layerwise-calibration"], "--layerwise-calibration applies when evaluate calibrates"),
        (["calibrate", "--import-reference", str(tmp_path / "th.txt"), "--placement", "post_softmax",
          "--out", str(tmp_path / "o.safetensors"), "--layerwise-calibration"], "--import-reference only converts"),
        (["evaluate", "--thresholds", str(tmp_path / "x.safetensors"), "--json", str(tmp_path / "e.json"),
          "--calib-align", "document"], "--calib-align applies when evaluate calibrates"),
        (["calibrate", "--import-reference", str(tmp_path / "th.txt"), "--placement", "post_softmax",
          "--out", str(tmp_path / "o.safetensors"), "--align", "document"], "--align chooses calibration samples"),
        (["evaluate", "--thresholds", str(tmp_path / "x.safetensors"), "--json", str(tmp_path / "e.json"),
          "--calib-text", "humaneval"], "--calib-text applies when evaluate calibrates"),
        (["evaluate", "--json", str(tmp_path / "e.json"), "--calib-text", "python-stdlib", "humaneval",
          "--calib-samples", "1"], "--calib-samples must be >= the number of --calib-text sources (2), got 1"),
        (["calibrate", "--k", "16", "--out", str(tmp_path / "o.safetensors"), "--text", "python-stdlib",
          "humaneval", "--samples", "1"], "--samples must be >= the number of --text sources (2), got 1"),
        (["calibrate", "--k", "16", "--out", str(tmp_path / "o.safetensors"), "--text", "humaneval",
          "humaneval"], "humaneval given more than once"),
        (["evaluate", "--json", str(tmp_path / "e.json"), "--calib-text", "humaneval", "humaneval"],
         "humaneval given more than once"),
        (["evaluate", "--json", str(tmp_path / "e.json"), "--calib-text", str(tmp_path / "missing.txt")],
         "missing.txt' does not exist"),
        (["evaluate", "--json", str(tmp_path / "e.json"), "--calib-text", "humaneval", "--problems", "164"],
         "--problems 164 takes all 164: give fewer --problems"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_evaluate_refuses_a_file_calibrated_on_the_problems_it_evaluates(tmp_path, capsys, monkeypatch):
    """A threshold file whose calibration text read HumanEval problems that evaluate --thresholds
    would score is refused before the model loads, naming the file; one that left them out is not."""
    import torch

    import topth_ops.hf.model
    from topth_ops.thresholds import DENSE, ThresholdSet, save_threshold_sets

    def no_model(*args, **kwargs):
        raise RuntimeError("model loading reached")

    monkeypatch.setattr(topth_ops.hf.model, "load_model", no_model)
    cfg = dict(model_type="llama", num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=8)
    text = ("8 from humaneval (HumanEval prompts + canonical solutions, reverse file order from HumanEval/163, "
            "without HumanEval/0-3); samples of <= 1024 tokens")
    path = tmp_path / "th.safetensors"
    th = torch.full((2, 2, 6), 0.1)
    th[0] = -torch.inf
    th[1, :, :2] = -torch.inf  # rows with n <= k keep every key
    save_threshold_sets(path, [ThresholdSet(thresholds=th, counts=torch.full((2, 2, 6), 2), layer_k=[DENSE, 2],
                                            placement="post_softmax", model_name="tiny", attention_config=cfg,
                                            alpha=0.0, estimator="count", calibration_text=text)])
    argv = ["evaluate", "--thresholds", str(path), "--json", str(tmp_path / "e.json"), "--variants", "topth-post-vmc"]
    assert main(argv + ["--problems", "6"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "calibrated on HumanEval problems this evaluation uses (HumanEval/4 and 1 more)" in err
    with pytest.raises(RuntimeError, match="model loading reached"):  # problems 0-3 were left out: accepted
        main(argv + ["--problems", "4"])


def test_calibrate_takes_evaluates_calibration_flag_spelling(tmp_path, capsys, monkeypatch):
    """calibrate's --samples / --max-tokens / --align / --text also answer to evaluate's
    --calib-* names (one spelling carried from one command to the other must not be an
    unrecognized argument); they reach the same checks, before the model loads."""
    import topth_ops.hf.model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(topth_ops.hf.model, "load_model", no_model)
    out = str(tmp_path / "th.safetensors")
    assert main(["calibrate", "--k", "16", "--out", out, "--calib-max-tokens", "1"]) == 2
    assert "--max-tokens must be >= 2, got 1" in capsys.readouterr().err
    assert main(["calibrate", "--k", "16", "--out", out, "--calib-samples", "0"]) == 2
    assert "--samples must be >= 1, got 0" in capsys.readouterr().err
    args = build_parser().parse_args(["calibrate", "--k", "16", "--out", out, "--calib-align", "document",
                                      "--calib-text", "python-stdlib"])
    assert args.align == "document" and args.text == ["python-stdlib"]


@pytest.mark.parametrize("argv, needle", [
    (["calibrate", "--k", "16", "--extend-to", "-5"], "--extend-to must be from --max-tokens (1024: the calibrated row "
                                                      "ids) to 1048576, got -5"),
    (["calibrate", "--k", "16", "--max-tokens", "512", "--extend-to", "100"], "from --max-tokens (512"),
    (["evaluate", "--extend-to", str(2 ** 21)], "--extend-to must be from --calib-max-tokens (1024"),
    (["evaluate", "--thresholds", "t.safetensors", "--k", "99"], "--k applies when evaluate calibrates"),
    (["evaluate", "--thresholds", "t.safetensors", "--extend-to", "4096"], "--extend-to applies when evaluate"),
    (["calibrate", "--k", "16", "--model", ""], "--model is empty: give one of smollm2-135m, gemma3-270m"),
    (["calibrate", "--import-reference", "th.txt", "--placement", "pre_softmax", "--extend-to", "4096"],
     "--extend-to sets the length model's reach; --import-reference only converts a file")])
def test_extend_to_k_and_model_flags_are_checked_before_the_model_loads(argv, needle, tmp_path, capsys,
                                                                        monkeypatch):
    # --extend-to -5 used to calibrate and write a file without a length model (silently the sample length)
    import topth_ops.hf.model

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    if "--model" not in argv:
        monkeypatch.setattr(topth_ops.hf.model, "load_model", no_model)
    out = ["--out", str(tmp_path / "th.safetensors")] if argv[0] == "calibrate" else ["--json", str(tmp_path / "e.json")]
    assert main(argv + out) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_calibrate_second_round_refusals(tmp_path, capsys, monkeypatch):
    """--second-round needs one set of the file matching --k, --placement and --selection, and
    --no-sdc-table for pre_softmax; refused before the model loads, naming what the file holds."""
    import torch

    import topth_ops.hf.model
    from topth_ops.thresholds import DENSE, ThresholdSet, save_threshold_sets

    def no_model(*args, **kwargs):
        raise RuntimeError("model loading reached")

    monkeypatch.setattr(topth_ops.hf.model, "load_model", no_model)
    cfg = dict(model_type="llama", num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=8)
    path = tmp_path / "th.safetensors"
    th = torch.full((2, 2, 6), 0.5)
    th[0] = -torch.inf
    th[1, :, :2] = -torch.inf
    save_threshold_sets(path, [ThresholdSet(thresholds=th, counts=torch.full((2, 2, 6), 2), layer_k=[DENSE, 2],
                                            placement="pre_softmax", model_name="tiny", attention_config=cfg,
                                            alpha=None, estimator="count")])
    base = ["calibrate", "--out", str(tmp_path / "o.safetensors"), "--second-round", str(path)]
    for extra, needle in (
        (["--k", "2", "4", "--placement", "pre_softmax", "--no-sdc-table"], "give one --k"),
        (["--k", "2", "--placement", "both", "--no-sdc-table"], "give one --k"),
        (["--k", "2", "--placement", "pre_softmax"], "add --no-sdc-table"),
        (["--k", "4", "--placement", "pre_softmax", "--no-sdc-table"], "holds k=2 pre_softmax head"),
        (["--k", "2", "--placement", "post_softmax"], "needs one set with k=2, post_softmax, head selection"),
        (["--k", "2", "--placement", "pre_softmax", "--no-sdc-table", "--layerwise-calibration"],
         "--second-round replaces --layerwise-calibration"),
        (["--k", "2", "--placement", "pre_softmax", "--no-sdc-table", "--estimator", "mean"],
         "--second-round needs the kept-count estimator"),
    ):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, err
    with pytest.raises(RuntimeError, match="model loading reached"):
        main(base + ["--k", "2", "--placement", "pre_softmax", "--no-sdc-table"])
    (tmp_path / "th.txt").write_text("1 2 3\n")
    assert main(["calibrate", "--import-reference", str(tmp_path / "th.txt"), "--placement", "pre_softmax",
                 "--out", str(tmp_path / "i.safetensors"), "--second-round", str(path)]) == 2
    assert "--second-round calibrates; --import-reference only converts" in capsys.readouterr().err
