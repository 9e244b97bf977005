"""The CPU backend (vLLM's own CPU attention, thresholded decode rows through the op) on a
hand-built mixed batch (decodes + a fresh prompt + a chunked prefill) written by vLLM's own
cache writer, against the float64 oracle (decode rows) and float64 causal attention
(every other row, served by vLLM's kernel). No engine is started: the per-process runtime
is replaced by one built here, and vLLM's metadata is built with its own scheduler op."""

import math

import numpy as np
import pytest
import torch

from topth_ops.conformance.oracle import oracle_decode
from topth_ops.vllm.settings import VllmTopthSettings

from .cpu_engine import CB, SP, ISAS, LAYER, Engine, make_impl, ops

pytestmark = pytest.mark.vllm
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402


def _causal(q, k, v, ctx, scale, window=-1):
    """float64 causal attention of new token i (position ctx + i) over its keys."""
    L, Hq, D = q.shape
    G = Hq // k.shape[1]
    out = np.zeros((L, Hq, D))
    for i in range(L):
        hi = ctx + i + 1
        lo = max(0, hi - window) if window > 0 else 0
        for h in range(Hq):
            a = k[lo:hi, h // G] @ q[i, h] * scale
            w = np.exp(a - a.max())
            out[i, h] = (w / w.sum()) @ v[lo:hi, h // G]
    return out


def _tol(dtype):
    return 2e-2 if dtype == torch.bfloat16 else 2e-5


def _run_three_steps(eng):
    eng.step([("A", 70), ("B", 12)])                  # two prompts
    eng.step([("A", 1), ("B", 1), ("C", 40)])         # decodes + C's first chunk
    return eng.step([("A", 1), ("B", 1), ("D", 9), ("C", 25)])  # + a fresh prompt, chunk 2 of C


@pytest.mark.parametrize("isa,dtype", ISAS)
@pytest.mark.parametrize("vmc,dense_layer", [(True, False), (False, False), (False, True)])
def test_mixed_batch_on_vllms_cache(monkeypatch, isa, dtype, vmc, dense_layer, make_cfg, make_threshold_set):
    Hq, Hkv, D = 8, 2, 64
    cfg = make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D)
    ts = make_threshold_set(cfg, rows=128, k=4, seed=1)
    if dense_layer:
        ts.layer_k[LAYER] = 0
    impl, stats = make_impl(monkeypatch, ts, VllmTopthSettings(metrics_every=1, mode="topth", thresholds="unused", vmc=vmc), Hq, Hkv, D)
    eng = Engine(impl, isa, dtype, Hq, H=Hkv, D=D)
    q, out, bt, lens, qsl = _run_three_steps(eng)
    assert not torch.isnan(out.float()).any()
    scale = 1 / math.sqrt(D)
    if not dense_layer:
        # decode rows: the float64 oracle on the rows each sequence wrote (BNSD, independent of the
        # backend's reading of vLLM's packing)
        S = int(lens[:2].max())
        kb = torch.zeros(2, Hkv, S, D, dtype=dtype)
        vb = torch.zeros(2, Hkv, S, D, dtype=dtype)
        for b, seq in enumerate(["A", "B"]):
            kk, vv = eng.rows[seq]
            kb[b, :, :kk.shape[0]], vb[b, :, :vv.shape[0]] = kk.transpose(0, 1), vv.transpose(0, 1)
        want = oracle_decode(q[:2], kb, vb, lens[:2], ts.thresholds[LAYER], scale=scale, placement="post_softmax",
                             vmc=vmc)
        np.testing.assert_allclose(out[:2].double().numpy(), want.out, rtol=_tol(dtype), atol=_tol(dtype))
        rep = stats.report()["last_steps"][-1]
        assert rep["v_rows_read"] == int(want.v_rows.sum()) < rep["v_rows_dense"]
    # every other row (and every row of a dense layer): vLLM's kernel = dense causal attention
    seqs = ["A", "B", "D", "C"]
    for i, (lo, hi) in enumerate(zip(qsl[:-1], qsl[1:])):
        if i < 2 and not dense_layer:
            continue
        kk, vv = (t.double().numpy() for t in eng.rows[seqs[i]])
        ref = _causal(q[lo:hi].double().numpy(), kk, vv, int(lens[i]) - (hi - lo), scale)
        np.testing.assert_allclose(out[lo:hi].double().numpy(), ref, rtol=_tol(dtype), atol=_tol(dtype))
    assert stats.report()["prefill_tokens_dense"] == 70 + 12 + 40 + 34


@pytest.mark.parametrize("isa,dtype", ISAS)
@pytest.mark.parametrize("beyond", [0, 60])
def test_requests_at_different_sets_share_one_op_call(monkeypatch, isa, dtype, beyond, make_cfg, make_threshold_set):
    """Per-request sparsity: decode rows of one batch at set 1, dense, and the default set 0
    (one op call), each against the float64 oracle with its own thresholds; with
    dense_beyond=60 the longer row (A, 72 positions) is dense whatever it chose."""
    from topth_ops.vllm import requests as R

    Hq, Hkv, D = 8, 2, 64
    cfg = make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D)
    sets = [make_threshold_set(cfg, rows=128, k=k, seed=k) for k in (4, 8, 16)]
    sets[2].thresholds[LAYER] = 0.02  # a set that drops more
    settings = VllmTopthSettings(metrics_every=1, mode="topth", thresholds="unused", dense_beyond=beyond)
    impl, stats = make_impl(monkeypatch, sets[0], settings, Hq, Hkv, D, sets=sets)
    eng = Engine(impl, isa, dtype, Hq, H=Hkv, D=D)
    eng.step([("A", 70), ("B", 12), ("E", 30)])
    eng.step([("A", 1), ("B", 1), ("E", 1)])
    choices = [R.Choice(set=2), R.Choice(dense=True), None]
    monkeypatch.setattr(R, "row_choices", lambda n: choices[:n])
    q, out, bt, lens, qsl = eng.step([("A", 1), ("B", 1), ("E", 1), ("C", 20)])
    rows = [sets[2].thresholds[LAYER], torch.full((Hq, 128), float("-inf")), sets[0].thresholds[LAYER]]
    if beyond:
        rows[0] = rows[1]
    reads = 0
    for b, seq in enumerate(["A", "B", "E"]):
        kk, vv = eng.rows[seq]
        want = oracle_decode(q[b:b + 1], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None], lens[b:b + 1],
                             rows[b], scale=1 / math.sqrt(D), placement="post_softmax")
        np.testing.assert_allclose(out[b:b + 1].double().numpy(), want.out, rtol=_tol(dtype), atol=_tol(dtype))
        reads += int(want.v_rows.sum())
        if b == 1 or (b == 0 and beyond):
            assert int(want.v_rows.sum()) == Hkv * int(lens[b])
    assert stats.report()["last_steps"][-1]["v_rows_read"] == reads
    per_set = impl.rt.fidelity.report()["sets"]
    assert set(per_set) == ({"dense", "0"} if beyond else {"dense", "0", "2"})
    assert per_set["dense"]["v_rows_fraction"] == 1.0 and per_set["0"]["v_rows_fraction"] < 1


@pytest.mark.parametrize("isa,dtype", ISAS[1:2])
def test_sliding_window_layer_is_served_by_vllm(monkeypatch, isa, dtype, make_cfg, make_threshold_set):
    Hq, Hkv, D = 4, 2, 64
    ts = make_threshold_set(make_cfg(layers=4, heads=Hq, kv_heads=Hkv, head_dim=D), rows=128, k=4)
    impl, stats = make_impl(monkeypatch, ts, VllmTopthSettings(metrics_every=1, mode="topth", thresholds="unused"), Hq, Hkv, D,
                        sliding_window=16)
    eng = Engine(impl, isa, dtype, Hq, H=Hkv, D=D, window=16)
    q, out, bt, lens, qsl = _run_three_steps(eng)
    assert not impl.rule.thresholded
    for i, seq in enumerate(["A", "B", "D", "C"]):
        lo, hi = qsl[i], qsl[i + 1]
        kk, vv = (t.double().numpy() for t in eng.rows[seq])
        ref = _causal(q[lo:hi].double().numpy(), kk, vv, int(lens[i]) - (hi - lo), 1 / math.sqrt(D), window=16)
        np.testing.assert_allclose(out[lo:hi].double().numpy(), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("isa,dtype", ISAS)
def test_cache_views_are_vllms_packing(isa, dtype):
    """The views hold, at [block, head, slot], the rows vLLM's own writer stored at that slot."""
    nb, H, bs, D = 3, 2, 32, 64
    kv = torch.zeros(nb, H, bs, 2 * D, dtype=dtype)
    k, v = torch.randn(2, nb * bs, H, D).to(dtype)
    kc, vc = kv.view(nb, H, 2 * bs, D).chunk(2, dim=2)
    slots = torch.randperm(nb * bs)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    kr, vr, lay = CB.cache_views(kv, isa)
    if lay == "VLLM_AMX":
        from topth_ops import packed
        kr, vr = packed.unpack(kr, "key"), packed.unpack(vr, "value")
    assert torch.equal(kr[slots // bs, :, slots % bs], k) and torch.equal(vr[slots // bs, :, slots % bs], v)


def test_cache_views_refuse_an_unknown_isa():
    with pytest.raises(NotImplementedError, match="ISA 'neon'"):
        CB.cache_views(torch.zeros(2, 1, 32, 128), "neon")


def test_prefill_part_rebases_tokens_and_requests():
    qt = torch.tensor([0, 1, 2, 12, 15], dtype=torch.int32)
    lens = torch.tensor([40, 9, 10, 20], dtype=torch.int32)
    bt = torch.arange(16, dtype=torch.int32).view(4, 4)
    cm = CommonAttentionMetadata(query_start_loc=qt, query_start_loc_cpu=qt, seq_lens=lens, num_reqs=4,
                                 num_actual_tokens=15, max_query_len=10, max_seq_len=40, block_table_tensor=bt,
                                 slot_mapping=torch.arange(15))
    p = SP.prefill_part(cm, 2, 2)
    assert p.query_start_loc.tolist() == [0, 10, 13] and p.num_reqs == 2 and p.num_actual_tokens == 13
    assert p.seq_lens.tolist() == [10, 20] and p.max_query_len == 10
    assert torch.equal(p.block_table_tensor, bt[2:]) and p.slot_mapping.tolist() == list(range(2, 15))


def test_one_token_prompt_tails_stay_with_vllm():
    """A request with one new token that is still in its prompt (vLLM's is_prefilling: the last
    prompt token recomputed after a full prefix-cache hit) is not a decode row; without
    is_prefilling every one-token request is. Encoder-only / cross groups get no decode rows."""
    qt = torch.tensor([0, 1, 2, 3, 13], dtype=torch.int32)
    lens = torch.tensor([40, 33, 50, 20], dtype=torch.int32)
    bt = torch.arange(16, dtype=torch.int32).view(4, 4)

    def cm(prefilling):
        return CommonAttentionMetadata(query_start_loc=qt, query_start_loc_cpu=qt, seq_lens=lens, num_reqs=4,
                                       num_actual_tokens=13, max_query_len=10, max_seq_len=50,
                                       block_table_tensor=bt, slot_mapping=torch.arange(13),
                                       is_prefilling=prefilling)

    built = []
    build = lambda c: built.append(c) or c  # noqa: E731 - records what vLLM's builder would get
    m = SP.split_metadata(build, cm(torch.tensor([False, False, True, True])), 32)
    assert m.num_decodes == 2 and m.prefill.num_reqs == 2 and m.prefill.seq_lens.tolist() == [50, 20]
    assert SP.split_metadata(build, cm(None), 32).num_decodes == 3
    whole = SP.split_metadata(build, cm(None), 32, split=False)
    assert whole.num_decodes == 0 and whole.prefill is None and whole.full.num_reqs == 4
