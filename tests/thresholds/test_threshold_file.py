"""Threshold files: round trips, validation, atomic writes, reference-format import."""

import json
import os

import numpy as np
import pytest
import torch

from topth_ops.thresholds import (
    DENSE,
    ThresholdFileError,
    ThresholdSet,
    fingerprint,
    import_reference_text,
    load_thresholds,
)

CFG = dict(model_type="llama", num_layers=3, num_q_heads=2, num_kv_heads=1, head_dim=8)


def _set(placement="pre_softmax", sdc=True, R=6):
    g = torch.Generator().manual_seed(0)
    th = torch.rand(3, 2, R, generator=g) * (0.1 if placement == "post_softmax" else 3.0)
    layer_k = [DENSE, 2, 3]
    th[0] = -torch.inf
    th[1, :, :2] = -torch.inf
    th[2, :, :3] = -torch.inf
    counts = torch.randint(0, 5, (3, 2, R), generator=g)
    table = torch.rand(3, 2, R, generator=g) if sdc else None
    return ThresholdSet(thresholds=th, counts=counts, layer_k=layer_k, placement=placement, model_name="tiny",
                        attention_config=dict(CFG), alpha=0.25, sdc_table=table, calibration_text="unit test",
                        calibration_samples=7, calibration_tokens=700, topk_at_calibration=True)


def test_round_trip_keeps_tensors_and_metadata(tmp_path):
    ts = _set()
    path = ts.save(tmp_path / "sub" / "t.safetensors")
    back = load_thresholds(path)
    assert torch.equal(back.thresholds, ts.thresholds)
    assert torch.equal(back.counts, ts.counts)
    assert torch.equal(back.sdc_table, ts.sdc_table)
    for f in ("layer_k", "placement", "model_name", "attention_config", "alpha", "calibration_text",
              "calibration_samples", "calibration_tokens", "topk_at_calibration"):
        assert getattr(back, f) == getattr(ts, f), f
    assert back.fingerprint == fingerprint(CFG)
    assert back.k == 2 or back.k == 3
    assert back.max_calibrated_row_id == int(torch.nonzero(ts.counts.sum((0, 1))).max()) + 1


def test_layerwise_flag_round_trip_and_absent_in_older_files(tmp_path):
    """``layerwise`` survives a save and load; a set entry without the key (files written
    before layer-wise calibration) loads as False."""
    import dataclasses

    from safetensors import safe_open

    ts = dataclasses.replace(_set(), topk_at_calibration=False, layerwise=True)
    path = ts.save(tmp_path / "lw.safetensors")
    back = load_thresholds(path)
    assert back.layerwise is True and "layer-wise" in back.summary()
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    sets = json.loads(meta["sets"])
    assert sets[0].pop("layerwise") is True
    _resave(tmp_path / "old.safetensors", tensors, dict(meta, sets=json.dumps(sets)))
    old = load_thresholds(tmp_path / "old.safetensors")
    assert old.layerwise is False and "layer-wise" not in old.summary()


def test_post_softmax_round_trip_without_sdc(tmp_path):
    ts = _set("post_softmax", sdc=False)
    back = load_thresholds(ts.save(tmp_path / "p.safetensors"))
    assert back.sdc_table is None and back.placement == "post_softmax"


def test_truncated_and_garbage_files_are_clear_errors(tmp_path):
    path = _set().save(tmp_path / "t.safetensors")
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ThresholdFileError, match="corrupt or truncated"):
        load_thresholds(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00\x01not a safetensors file at all")
    with pytest.raises(ThresholdFileError, match="corrupt or truncated"):
        load_thresholds(junk)
    with pytest.raises(FileNotFoundError):
        load_thresholds(tmp_path / "missing.safetensors")


def _resave(path, tensors, meta):
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=meta)


def test_inconsistent_contents_are_rejected(tmp_path):
    from safetensors import safe_open

    path = _set().save(tmp_path / "t.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    bad = dict(tensors, **{"set0.thresholds": tensors["set0.thresholds"].clone()})
    bad["set0.thresholds"][1, 0, 4] = float("nan")
    _resave(tmp_path / "nan.safetensors", bad, meta)
    with pytest.raises(ThresholdFileError, match="NaN"):
        load_thresholds(tmp_path / "nan.safetensors")
    bad = dict(tensors, **{"set0.thresholds": tensors["set0.thresholds"].clone()})
    bad["set0.thresholds"][2, 1, 0] = 1.0  # row n=1 <= k=3 must stay dense
    _resave(tmp_path / "dense.safetensors", bad, meta)
    with pytest.raises(ThresholdFileError, match="layer 2: rows with n <= k=3 must hold -inf"):
        load_thresholds(tmp_path / "dense.safetensors")
    _resave(tmp_path / "fmt.safetensors", tensors, dict(meta, format="other"))
    with pytest.raises(ThresholdFileError, match="not a topth-ops thresholds file"):
        load_thresholds(tmp_path / "fmt.safetensors")
    _resave(tmp_path / "ver.safetensors", tensors, dict(meta, format_version="99"))
    with pytest.raises(ThresholdFileError, match="format_version 99"):
        load_thresholds(tmp_path / "ver.safetensors")
    _resave(tmp_path / "fp.safetensors", tensors, dict(meta, attention_config=json.dumps(dict(CFG, num_layers=4))))
    with pytest.raises(ThresholdFileError, match="fingerprint"):
        load_thresholds(tmp_path / "fp.safetensors")
    _resave(tmp_path / "shape.safetensors", dict(tensors, **{"set0.sample_counts": tensors["set0.sample_counts"][:, :1].contiguous()}), meta)
    with pytest.raises(ThresholdFileError, match="sample_counts"):
        load_thresholds(tmp_path / "shape.safetensors")
    post = _set("post_softmax", sdc=False)
    post.thresholds[1, 0, 5] = 1.5
    with pytest.raises(ThresholdFileError, match=r"\[0, 1\]"):
        post.save(tmp_path / "post.safetensors")


def test_check_model_names_both_sides():
    ts = _set()
    ts.check_model(dict(CFG), "tiny", "pre_softmax")  # fits
    with pytest.raises(ThresholdFileError) as e:
        ts.check_model(dict(CFG, num_layers=30, num_q_heads=9), "SmolLM2")
    msg = str(e.value)
    assert "'tiny'" in msg and "'SmolLM2'" in msg and "3 layers" in msg and "30 layers" in msg
    assert "num_q_heads: file 2 vs model 9" in msg
    with pytest.raises(ThresholdFileError, match="holds pre_softmax thresholds .* placement='post_softmax'"):
        ts.check_model(dict(CFG), "tiny", "post_softmax")


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    import safetensors.torch as st

    target = tmp_path / "t.safetensors"
    good = _set().save(target)
    before = good.read_bytes()

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of writing

    monkeypatch.setattr(st, "save_file", broken)
    with pytest.raises(KeyboardInterrupt):
        _set(R=9).save(target)
    assert target.read_bytes() == before  # the old file is untouched
    assert sorted(os.listdir(tmp_path)) == ["t.safetensors"]  # no temp file left behind


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reference_text_import(tmp_path):
    # layer 0: no lines (dense); layer 1: K=2, rows 3, 5, 8 sampled; layer 2: K=1, row 2..3
    th = _write(tmp_path / "th.txt", [
        "L1_H0:3 0.5 4 2", "L1_H0:5 0.7 2 2", "L1_H0:8 0.9 1 2",
        "L1_H1:3 -0.5 4 2", "L1_H1:8 -0.25 1 2",
        "L2_H0:2 1.5 3 1", "L2_H0:3 1.25 3 1", "L2_H1:2 2.5 3 1",
    ])
    sdc = _write(tmp_path / "sdc.txt", ["L1_H0:3 0.125 4", "L1_H0:8 0.5 1", "L1_H1:5 0.25 2", "L2_H0:3 1.0 3", "L2_H1:2 2.0 3"])
    ts = import_reference_text(th, sdc, placement="pre_softmax", attention_config=CFG, model_name="tiny")
    t = ts.thresholds.numpy()
    assert ts.layer_k == [DENSE, 2, 1] and ts.max_row_id == 8 and ts.alpha is None
    assert np.all(np.isneginf(t[0]))
    inf = -np.inf
    # nearest sampled row id, ties -> the smaller: n=4 (3 and 5 both 1 away) -> 3; n=6 -> 5; n=7 -> 8
    assert list(t[1, 0]) == [inf, inf, 0.5, 0.5, 0.7, 0.7, 0.9, 0.9]
    # head 1 sampled at 3 and 8: n=5 -> 3 (2 vs 3 away), n=6 -> 8 (3 vs 2 away)
    assert list(t[1, 1]) == [inf, inf, -0.5, -0.5, -0.5, -0.25, -0.25, -0.25]
    assert list(t[2, 0]) == [inf, 1.5, 1.25, 1.25, 1.25, 1.25, 1.25, 1.25]
    assert list(t[2, 1]) == [inf, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5, 2.5]
    assert int(ts.counts[1, 0, 2]) == 4 and int(ts.counts[1, 0, 3]) == 0
    s = ts.sdc_table.numpy()
    assert list(s[1, 0]) == pytest.approx([0, 0, 0.125, 0.125, 0.125, 0.5, 0.5, 0.5])
    assert list(s[1, 1]) == pytest.approx([0, 0, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25])
    assert np.all(s[0] == 0)
    back = load_thresholds(ts.save(tmp_path / "imp.safetensors"))
    assert torch.equal(back.thresholds, ts.thresholds) and back.source == "reference-text"


def test_reference_text_errors(tmp_path):
    kw = dict(placement="pre_softmax", attention_config=CFG, model_name="tiny")
    bad = _write(tmp_path / "bad.txt", ["L1_H0:3 0.5 4 2", "L1_H1 0.5 4 2"])
    with pytest.raises(ThresholdFileError, match="line 2: expected 'L{layer}_H{head}:{seq_len} {theta} {num_samples} {K}'"):
        import_reference_text(bad, **kw)
    twok = _write(tmp_path / "twok.txt", ["L1_H0:3 0.5 4 2", "L1_H1:5 0.5 4 4"])
    with pytest.raises(ThresholdFileError, match="layer 1 has several K values"):
        import_reference_text(twok, **kw)
    far = _write(tmp_path / "far.txt", ["L7_H0:3 0.5 4 2"])
    with pytest.raises(ThresholdFileError, match="layer 7 head 0, outside model 'tiny'"):
        import_reference_text(far, **kw)
    head = _write(tmp_path / "head.txt", ["L1_H0:3 0.5 4 2"])
    with pytest.raises(ThresholdFileError, match="no lines for heads \\[1\\]"):
        import_reference_text(head, **kw)
    empty = _write(tmp_path / "empty.txt", [""])
    with pytest.raises(ThresholdFileError, match="holds no lines"):
        import_reference_text(empty, **kw)


def test_saved_file_follows_the_umask_and_bad_paths_name_the_file(tmp_path):
    old = os.umask(0o022)
    try:
        p = _set().save(tmp_path / "perm.safetensors")
    finally:
        os.umask(old)
    assert (os.stat(p).st_mode & 0o777) == 0o644  # readable by others, as open() would make it
    with pytest.raises(ValueError, match="names a directory"):
        _set().save(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError, match="cannot write threshold file .*afile/t.safetensors"):
        _set().save(tmp_path / "afile" / "t.safetensors")


def test_same_shape_other_model_name_warns():
    ts = _set()
    with pytest.warns(UserWarning, match="calibrated on model 'tiny' and is used with model 'other'"):
        ts.check_model(dict(CFG), "other")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ts.check_model(dict(CFG), "tiny")
        ts.check_model(dict(CFG), "other", compare_name=False)
