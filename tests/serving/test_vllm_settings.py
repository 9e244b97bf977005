"""Settings, model checks and TP slicing of the vLLM backend (no engine needed)."""

import os
import subprocess
import sys

import pytest
import torch

from topth_ops.thresholds import ThresholdFileError
from topth_ops.vllm import enable
from topth_ops.vllm.model_check import load_for_model, model_name_of
from topth_ops.vllm.settings import ENV, TopthConfigError, from_sources, is_active
from topth_ops.vllm.tp import rank_rows

pytestmark = pytest.mark.vllm


def test_import_topth_ops_never_imports_vllm():
    code = ("import sys, topth_ops, topth_ops.vllm, topth_ops.vllm.settings, topth_ops.vllm.stats, "
            "topth_ops.vllm.paged_ops; print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_activation_and_defaults():
    assert not is_active({}, None)
    assert not is_active({ENV["mode"]: " "}, {"other": 1})
    assert is_active({ENV["thresholds"]: "x.safetensors"}, None)
    assert is_active({}, {"topth": {"mode": "dense"}})
    s = from_sources({ENV["thresholds"]: "x.safetensors"})
    assert (s.mode, s.thresholds, s.vmc, s.sdc) == ("topth", "x.safetensors", False, "none")
    assert from_sources({ENV["mode"]: "dense"}).mode == "dense"
    assert from_sources({}, {"topth": {}}).mode == "dense"


def test_additional_config_overrides_env():
    env = {ENV["thresholds"]: "a.safetensors", ENV["vmc"]: "0", ENV["log_interval"]: "3"}
    s = from_sources(env, {"topth": {"thresholds": "b.safetensors", "vmc": True, "stats_file": "r.json"}})
    assert (s.thresholds, s.vmc, s.stats_file, s.log_interval) == ("b.safetensors", True, "r.json", 3.0)
    assert from_sources({ENV["vmc"]: "YES", ENV["mode"]: "dense"}).vmc is True


@pytest.mark.parametrize("env,extra,match", [
    ({ENV["mode"]: "sparse"}, None, "mode must be one of"),
    ({ENV["mode"]: "topth"}, None, "needs a threshold file"),
    ({ENV["mode"]: "dense", ENV["vmc"]: "maybe"}, None, "must be 1/0"),
    ({ENV["mode"]: "dense", ENV["sdc"]: "approx"}, None, "sdc must be one of"),
    ({ENV["mode"]: "dense", ENV["log_interval"]: "-1"}, None, "log_interval"),
    ({ENV["mode"]: "dense", ENV["sdc_gamma"]: "abc"}, None, "must be a number"),
    ({}, {"topth": {"threshold": "x"}}, "unknown additional_config"),
    ({}, {"topth": ["x"]}, "must be a dict"),
])
def test_bad_settings_raise(env, extra, match):
    with pytest.raises(TopthConfigError, match=match):
        from_sources(env, extra)


def test_rank_rows_slices_each_ranks_heads():
    L, H, R = 3, 6, 5
    table = torch.arange(L * H * R, dtype=torch.float32).reshape(L, H, R)
    for tp in (1, 2, 3, 6):
        local = H // tp
        parts = [rank_rows(table, 2, r, local) for r in range(tp)]
        assert all(p.shape == (local, R) and p.is_contiguous() for p in parts)
        assert torch.equal(torch.cat(parts), table[2])  # ranks together cover every head once, in order
    assert torch.equal(rank_rows(table, 1, 1, 3), table[1, 3:6])
    with pytest.raises(ValueError, match="layer 3 out of range"):
        rank_rows(table, 3, 0, 6)
    with pytest.raises(ValueError, match="needs query heads"):
        rank_rows(table, 0, 2, 3)


def test_load_for_model_accepts_matching_file(tmp_path, make_cfg, make_threshold_set):
    cfg = make_cfg(name="tiny")
    p = make_threshold_set(cfg).save(tmp_path / "th.safetensors")
    ts = load_for_model(from_sources({ENV["thresholds"]: str(p)}), cfg, "tiny", tp_size=2)
    assert ts.thresholds.shape == (4, 4, 64)
    assert load_for_model(from_sources({ENV["mode"]: "dense"}), cfg, "tiny", tp_size=4) is None


def test_wrong_model_file_names_both_models(tmp_path, make_threshold_set, make_cfg):
    p = make_threshold_set(make_cfg(heads=8, kv_heads=2), name="other-model").save(tmp_path / "th.safetensors")
    with pytest.raises(ThresholdFileError, match=r"other-model.*8 query heads.*'tiny'.*4 query heads"):
        load_for_model(from_sources({ENV["thresholds"]: str(p)}), make_cfg(), "tiny", tp_size=1)


def test_wrong_model_file_of_several_sets_is_named_before_the_set_choice(tmp_path, make_threshold_set, make_cfg):
    from topth_ops.thresholds.save import save_threshold_sets

    other = make_cfg(heads=8, kv_heads=2)
    p = tmp_path / "two.safetensors"
    save_threshold_sets(p, [make_threshold_set(other, name="other-model", k=k) for k in (4, 8)])
    with pytest.raises(ThresholdFileError, match=r"other-model.*'tiny'"):  # not "choose one of 2 sets"
        load_for_model(from_sources({ENV["thresholds"]: str(p)}), make_cfg(), "tiny", tp_size=1)
    with pytest.raises(ThresholdFileError, match="holds 2 threshold sets"):  # the right model: choose a set
        save_threshold_sets(p, [make_threshold_set(make_cfg(), name="tiny", k=k) for k in (4, 8)])
        load_for_model(from_sources({ENV["thresholds"]: str(p)}), make_cfg(), "tiny", tp_size=1)


def test_a_second_round_set_served_with_another_compensation_warns(tmp_path, make_threshold_set, make_cfg):
    import dataclasses
    import warnings

    ts = dataclasses.replace(make_threshold_set(make_cfg(), placement="pre_softmax"),
                             layerwise_rule={"sdc": "none", "vmc": True})  # as a second round with VMC writes it
    p = ts.save(tmp_path / "r2.safetensors")
    with pytest.warns(UserWarning, match=r"calibrated in a second round with sdc=none, vmc=True.*vmc=False"):
        load_for_model(from_sources({ENV["thresholds"]: str(p)}), make_cfg(), "tiny", tp_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # served with its rule: no warning
        load_for_model(from_sources({ENV["thresholds"]: str(p), ENV["vmc"]: "1"}), make_cfg(), "tiny", tp_size=1)


def test_same_shape_other_name_warns(tmp_path, make_threshold_set, make_cfg):
    p = make_threshold_set(make_cfg(), name="base-model").save(tmp_path / "th.safetensors")
    with pytest.warns(UserWarning, match="base-model"):
        load_for_model(from_sources({ENV["thresholds"]: str(p)}), make_cfg(), "instruct-model", tp_size=1)


def test_tp_not_dividing_heads(tmp_path, make_threshold_set, make_cfg):
    p = make_threshold_set(make_cfg(heads=6, kv_heads=2)).save(tmp_path / "th.safetensors")
    with pytest.raises(TopthConfigError, match="tensor-parallel size 4 does not divide the model's 6 query heads"):
        load_for_model(from_sources({ENV["thresholds"]: str(p)}), make_cfg(heads=6, kv_heads=2), "tiny", tp_size=4)


def test_missing_and_corrupt_files(tmp_path, make_cfg, make_threshold_set):
    with pytest.raises(ThresholdFileError, match="does not exist"):
        load_for_model(from_sources({ENV["thresholds"]: str(tmp_path / "nope.safetensors")}), make_cfg(), "t", 1)
    bad = tmp_path / "bad.safetensors"
    good = make_threshold_set(make_cfg()).save(tmp_path / "good.safetensors")
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # truncated
    with pytest.raises(ThresholdFileError):
        load_for_model(from_sources({ENV["thresholds"]: str(bad)}), make_cfg(), "t", 1)
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ThresholdFileError):
        load_for_model(from_sources({ENV["thresholds"]: str(bad)}), make_cfg(), "t", 1)


def test_sdc_needs_pre_softmax_and_table(tmp_path, make_threshold_set, make_cfg):
    post = make_threshold_set(make_cfg()).save(tmp_path / "post.safetensors")
    with pytest.raises(ThresholdFileError, match="needs pre_softmax"):
        load_for_model(from_sources({ENV["thresholds"]: str(post), ENV["sdc"]: "exact"}), make_cfg(), "tiny", 1)
    pre = make_threshold_set(make_cfg(), placement="pre_softmax", value=-2.0).save(tmp_path / "pre.safetensors")
    with pytest.raises(ThresholdFileError, match="needs an sdc_table"):
        load_for_model(from_sources({ENV["thresholds"]: str(pre), ENV["sdc"]: "offline"}), make_cfg(), "tiny", 1)


def test_model_name_of(make_cfg):
    assert model_name_of(make_cfg(name="SmolLM2-135M-Instruct.Q4_1"), "/x/smol-hf") == "SmolLM2-135M-Instruct.Q4_1"
    assert model_name_of(make_cfg(), "/x/smol-hf/") == "smol-hf"
    assert model_name_of(make_cfg(), None) is None


def test_enable_sets_env_and_refuses_bad_settings(monkeypatch):
    for var in ENV.values():
        # setenv first so that monkeypatch records the original state and removes what
        # enable() sets (delenv of an absent variable records nothing: enable()'s variables
        # leaked into every later test of the session)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    s = enable("th.safetensors", vmc=True, stats_file="r.json")
    assert (s.mode, s.vmc) == ("topth", True)
    assert os.environ[ENV["thresholds"]] == os.path.abspath("th.safetensors") and os.environ[ENV["vmc"]] == "1"
    before = {v: os.environ.get(v) for v in ENV.values()}
    with pytest.raises(TopthConfigError):
        enable(mode="topth")  # no file
    assert {v: os.environ.get(v) for v in ENV.values()} == before


def test_serve_checks_before_starting(tmp_path, capsys, make_threshold_set, make_cfg):
    from transformers import LlamaConfig

    from topth_ops.cli import main

    model = tmp_path / "m"
    LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                head_dim=16).save_pretrained(model)
    good = make_threshold_set(make_cfg(layers=4, heads=4, kv_heads=2, head_dim=16),
                              name="m").save(tmp_path / "good.safetensors")
    other = make_threshold_set(make_cfg(layers=4, heads=8, kv_heads=2, head_dim=16),
                               name="x").save(tmp_path / "bad.safetensors")
    assert main(["serve", str(model), "--thresholds", str(good), "--vmc", "--dry-run", "--",
                 "--max-num-seqs", "8"]) == 0
    err = capsys.readouterr().err
    assert f"TOPTH_VLLM_THRESHOLDS={good}" in err and "TOPTH_VLLM_VMC=1" in err
    assert "-m vllm.entrypoints.openai.api_server --model" in err and err.rstrip().endswith("--max-num-seqs 8")
    assert main(["serve", str(model), "--thresholds", str(other), "--dry-run"]) == 2
    assert "was calibrated for model 'x'" in capsys.readouterr().err
    assert main(["serve", str(model), "--thresholds", str(good), "--dry-run", "--", "-tp", "3"]) == 2
    assert "tensor-parallel size 3 does not divide" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "nowhere"), "--mode", "dense", "--dry-run"]) == 2
    assert main(["serve", str(model), "--mode", "vllm", "--dry-run"]) == 0
    assert "TOPTH_VLLM" not in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--tensor-parallel-size=3"], ["-tp=3"], ["--tensor_parallel_size", "3"],
                                   ["--tensor_parallel_size=3"], ["--max-num-seqs", "8", "-tp", "3"]])
def test_serve_reads_every_spelling_of_the_tp_flag(tmp_path, capsys, flags, make_threshold_set, make_cfg):
    """vLLM's parser accepts `--flag=value` and underscores; the pre-check must see them too."""
    from transformers import LlamaConfig

    from topth_ops.cli import main

    model = tmp_path / "m"
    LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                head_dim=16).save_pretrained(model)
    good = make_threshold_set(make_cfg(layers=4, heads=4, kv_heads=2, head_dim=16),
                              name="m").save(tmp_path / "g.safetensors")
    assert main(["serve", str(model), "--thresholds", str(good), "--dry-run", "--"] + flags) == 2
    assert "tensor-parallel size 3 does not divide" in capsys.readouterr().err


@pytest.mark.parametrize("flags,msg", [(["-tp"], "-tp needs a value"),
                                       (["--tensor-parallel-size", "x"], "--tensor-parallel-size must be an integer >= 1, got 'x'"),
                                       (["--tensor-parallel-size=0"], "--tensor-parallel-size must be an integer >= 1, got '0'")])
def test_serve_bad_tp_value_names_the_flag(tmp_path, capsys, flags, msg):
    from transformers import LlamaConfig

    from topth_ops.cli import main

    model = tmp_path / "m"
    LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                head_dim=16).save_pretrained(model)
    assert main(["serve", str(model), "--mode", "dense", "--dry-run", "--"] + flags) == 2
    assert msg in capsys.readouterr().err


def test_unknown_env_variable_is_named():
    """A misspelt TOPTH_VLLM_* variable must not be ignored silently (additional_config keys
    already raise): with the backend active it raises, alone it warns that vLLM's own
    attention runs."""
    with pytest.raises(TopthConfigError, match=r"unknown environment variable TOPTH_VLLM_VMCC.*TOPTH_VLLM_VMC"):
        from_sources({ENV["thresholds"]: "x.safetensors", "TOPTH_VLLM_VMCC": "1"})
    with pytest.warns(UserWarning, match=r"TOPTH_VLLM_THRESHOLD: not a known variable.*TOPTH_VLLM_THRESHOLDS"):
        assert not is_active({"TOPTH_VLLM_THRESHOLD": "x.safetensors"}, None)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0"])
def test_sdc_gamma_must_be_finite_and_positive(value):
    # the op refuses a non-finite sdc_gamma; the engine must not start and fail at the first decode
    with pytest.raises(TopthConfigError, match="sdc_gamma must be finite and > 0"):
        from_sources({ENV["mode"]: "dense", ENV["sdc_gamma"]: value})


def test_unknown_op_backend_refused_at_start(tmp_path, make_cfg, make_threshold_set):
    cfg = make_cfg()
    path = make_threshold_set(cfg, name="tiny").save(tmp_path / "t.safetensors")
    s = from_sources({ENV["thresholds"]: str(path), ENV["op_backend"]: "cpux"})
    with pytest.raises(TopthConfigError, match=r"TOPTH_VLLM_OP_BACKEND.*'cpux'.*torch"):
        load_for_model(s, cfg, "tiny", 1)
    s = from_sources({ENV["mode"]: "dense", ENV["op_backend"]: "cpux"})
    with pytest.raises(TopthConfigError, match="TOPTH_VLLM_OP_BACKEND"):
        load_for_model(s, cfg, "tiny", 1)


def test_serve_op_backend_and_sdc_gamma_options_and_ignored_env(tmp_path, capsys, monkeypatch):
    """serve replaces the TOPTH_VLLM_* environment with its own options: it has options for
    the op backend and gamma, and says which inherited variables it drops."""
    from transformers import LlamaConfig

    from topth_ops.cli import main

    model = tmp_path / "m"
    LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                head_dim=16).save_pretrained(model)
    monkeypatch.setenv(ENV["op_backend"], "torch")
    assert main(["serve", str(model), "--mode", "dense", "--op-backend", "cpu", "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "TOPTH_VLLM_OP_BACKEND=cpu" in err
    assert "ignoring TOPTH_VLLM_OP_BACKEND=torch from the environment" in err
    assert main(["serve", str(model), "--mode", "dense", "--op-backend", "cpux", "--dry-run"]) == 2
    assert "'cpux' is not a registered backend" in capsys.readouterr().err


def test_threshold_set_picks_one_set_of_a_multi_set_file(tmp_path, make_cfg, make_threshold_set):
    from topth_ops.thresholds import save_threshold_sets

    cfg = make_cfg(name="tiny")
    sets = [make_threshold_set(cfg, k=k, seed=k) for k in (2, 4, 8)]
    p = save_threshold_sets(tmp_path / "sets.safetensors", sets)
    for i, k in enumerate((2, 4, 8)):
        ts = load_for_model(from_sources({ENV["thresholds"]: str(p), ENV["threshold_set"]: str(i)}), cfg, "tiny", 1)
        assert ts.k == k and torch.equal(ts.thresholds, sets[i].thresholds)
    ts = load_for_model(from_sources({}, {"topth": {"thresholds": str(p), "threshold_set": 1}}), cfg, "tiny", 1)
    assert ts.k == 4
    with pytest.raises(ThresholdFileError, match=r"3 threshold sets.*TOPTH_VLLM_THRESHOLD_SET"):
        load_for_model(from_sources({ENV["thresholds"]: str(p)}), cfg, "tiny", 1)
    with pytest.raises(ThresholdFileError, match="TOPTH_VLLM_THRESHOLD_SET"):
        load_for_model(from_sources({ENV["thresholds"]: str(p), ENV["threshold_set"]: "3"}), cfg, "tiny", 1)
    for bad, match in (("x", "must be an integer index"), ("-1", "index >= 0"), ("1.5", "must be an integer index")):
        with pytest.raises(TopthConfigError, match=match):
            from_sources({ENV["thresholds"]: str(p), ENV["threshold_set"]: bad})
    with pytest.raises(ThresholdFileError, match="is a directory"):
        load_for_model(from_sources({ENV["thresholds"]: str(tmp_path)}), cfg, "tiny", 1)


def test_serve_threshold_set_option(tmp_path, capsys, make_threshold_set):
    from transformers import LlamaConfig

    from topth_ops.cli import main
    from topth_ops.thresholds import save_threshold_sets

    model = tmp_path / "m"
    LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                head_dim=16).save_pretrained(model)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    p = save_threshold_sets(tmp_path / "sets.safetensors", [make_threshold_set(cfg, name="m", k=k) for k in (2, 4)])
    assert main(["serve", str(model), "--thresholds", str(p), "--threshold-set", "1", "--dry-run"]) == 0
    assert "TOPTH_VLLM_THRESHOLD_SET=1" in capsys.readouterr().err
    assert main(["serve", str(model), "--thresholds", str(p), "--dry-run"]) == 2
    assert "--threshold-set" in capsys.readouterr().err


def test_serving_control_settings_parse_and_refuse_bad_values():
    s = from_sources({"TOPTH_VLLM_MODE": "dense", "TOPTH_VLLM_METRICS": "0", "TOPTH_VLLM_GUARD_BAND": "0.7, 1.4",
                      "TOPTH_VLLM_GUARD_WINDOW": "64", "TOPTH_VLLM_DENSE_BEYOND": "8192"})
    assert (s.metrics, s.guard_band, s.guard_window, s.dense_beyond) == (False, (0.7, 1.4), 64, 8192)
    d = from_sources({"TOPTH_VLLM_MODE": "dense"})
    assert (d.metrics, d.guard_band, d.guard_window, d.dense_beyond) == (True, (0.8, 1.25), 256, 0)
    for var, value, match in [("TOPTH_VLLM_GUARD_BAND", "1.3,0.7", "0 <= low < high"),
                              ("TOPTH_VLLM_GUARD_BAND", "0.8", "two numbers"),
                              ("TOPTH_VLLM_GUARD_WINDOW", "0", "guard_window must be an integer >= 1"),
                              ("TOPTH_VLLM_DENSE_BEYOND", "-1", "dense_beyond must be an integer >= 0"),
                              ("TOPTH_VLLM_DENSE_BEYOND", "lots", "must be an integer"),
                              ("TOPTH_VLLM_METRICS", "maybe", "1/0")]:
        with pytest.raises(TopthConfigError, match=match):
            from_sources({"TOPTH_VLLM_MODE": "dense", var: value})


def test_serve_mode_vllm_refuses_backend_flags_and_dry_run_names_the_metrics_folder(tmp_path, capsys, monkeypatch):
    from transformers import LlamaConfig

    from topth_ops.cli import main

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    model = tmp_path / "m"
    LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                head_dim=16).save_pretrained(model)
    assert main(["serve", str(model), "--mode", "vllm", "--vmc", "--stats", "s.json", "--dry-run"]) == 2
    assert "--vmc, --stats have no effect there" in capsys.readouterr().err
    assert main(["serve", str(model), "--mode", "dense", "--dry-run"]) == 0
    assert "would create PROMETHEUS_MULTIPROC_DIR" in capsys.readouterr().err
    assert main(["serve", str(model), "--mode", "dense", "--no-metrics", "--dry-run"]) == 0
    assert "PROMETHEUS_MULTIPROC_DIR" not in capsys.readouterr().err


def test_benchmark_server_commands_are_accepted_by_serve(tmp_path, monkeypatch, make_threshold_set, make_cfg):
    """The servers the vLLM benchmarks start (every configuration) pass serve's checks: a flag
    that serve refuses in a mode (``--log-interval`` with ``--mode vllm``) fails here, not
    after a benchmark has loaded its prompts."""
    from transformers import LlamaConfig

    from topth_ops.bench import vllm_request_sets, vllm_serve_load
    from topth_ops.cli import main

    model = tmp_path / "m"
    LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                head_dim=16).save_pretrained(model)
    th = make_threshold_set(make_cfg(layers=4, heads=4, kv_heads=2, head_dim=16), name="m").save(
        tmp_path / "th.safetensors")
    cmds = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: cmds.append(cmd))
    for mode in ("vllm", "dense", "topth"):
        vllm_serve_load.start_server(str(model), mode, str(th), True, str(tmp_path / "s.json"),
                                     str(tmp_path / "log"), 8765)
    vllm_request_sets.serve(str(model), str(th), 0, str(tmp_path / "log"), 8779, "0.8,1.25", vmc=True)
    assert len(cmds) == 4
    for cmd in cmds:
        i, j = cmd.index("serve"), cmd.index("--")
        assert main(cmd[i:j] + ["--dry-run"] + cmd[j:]) == 0, cmd
