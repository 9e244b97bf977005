"""The name a local model folder gets (messages, threshold files, the file's name check): an
export from ``topth-ops export-hf`` is named after its source model, as vLLM's name check
names it, so its threshold files load on the transformers path without a name warning;
any other folder is named by its directory."""

from __future__ import annotations

import json

import pytest

from topth_ops.hf import model as model_mod
from topth_ops.thresholds import MODEL_NAME_KEY

pytest.importorskip("transformers")


def _folder(tmp_path, name, **extra):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", **extra}))
    return d


def test_export_is_named_after_its_source_model(tmp_path):
    d = _folder(tmp_path, "gemma-hf", **{MODEL_NAME_KEY: "gemma-3-270m-q4_k_m"})
    cfg, name = model_mod.load_config(str(d))
    assert name == "gemma-3-270m-q4_k_m"
    assert cfg.topth_model_name == "gemma-3-270m-q4_k_m"


def test_vllm_and_transformers_paths_agree_on_the_name(tmp_path):
    from topth_ops.vllm.model_check import model_name_of

    d = _folder(tmp_path, "smol-hf", **{MODEL_NAME_KEY: "SmolLM2-135M-Instruct.Q4_1"})
    cfg, name = model_mod.load_config(str(d))
    assert name == model_name_of(cfg, str(d))
    plain = _folder(tmp_path, "plain")
    cfg, name = model_mod.load_config(str(plain))
    assert name == "plain" == model_name_of(cfg, str(plain))


@pytest.mark.parametrize("text", ["{not json", json.dumps(["a list"]), json.dumps({MODEL_NAME_KEY: 3}),
                                  json.dumps({MODEL_NAME_KEY: ""})])
def test_unusable_recorded_name_falls_back_to_the_directory(tmp_path, text):
    d = tmp_path / "folder"
    d.mkdir()
    (d / "config.json").write_text(text)
    assert model_mod._exported_name(d / "config.json") is None


def test_paths_agree_on_an_unusable_recorded_name(tmp_path):
    from topth_ops.vllm.model_check import model_name_of

    d = _folder(tmp_path, "odd", **{MODEL_NAME_KEY: 3})
    cfg, name = model_mod.load_config(str(d))
    assert name == "odd" == model_name_of(cfg, str(d))
