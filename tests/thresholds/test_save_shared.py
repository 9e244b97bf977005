"""Sets made from one another (dataclasses.replace) share tensors; the file still saves."""

import dataclasses

import torch

from topth_ops.thresholds import ThresholdSet, load_threshold_sets, save_threshold_sets


def test_sets_sharing_a_tensor_save_and_load(tmp_path):
    ac = {"model_type": "llama", "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    th = torch.rand(2, 4, 64) * 0.05
    th[:, :, :4] = float("-inf")
    a = ThresholdSet(th, torch.ones(2, 4, 64, dtype=torch.int64), [4, 4], "post_softmax", "tiny", ac)
    th2 = th * 0.5
    th2[:, :, :8] = float("-inf")
    b = dataclasses.replace(a, thresholds=th2, layer_k=[8, 8])  # shares `counts` with a
    path = tmp_path / "two.safetensors"
    save_threshold_sets(path, [a, b])
    got = load_threshold_sets(path)
    assert [x.k for x in got] == [4, 8]
    assert torch.equal(got[1].thresholds[:, :, :64], th2) and torch.equal(got[0].counts, a.counts)
