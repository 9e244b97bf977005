"""The cold-cache layout benchmark (bench/cpu_cold.py) on a tiny shape: every layout and
variant runs, is checked against the torch reference, and reports the bytes it read."""

import pytest
import torch

from topth_ops.bench import cold_layouts, cpu_cold


@pytest.mark.parametrize("placement", ["post_softmax", "pre_softmax"])
def test_every_layout_runs_checked_on_a_tiny_shape(monkeypatch, placement):
    monkeypatch.setitem(cpu_cold.SHAPES, "tiny", (2, 4, 2, 64, 512, torch.bfloat16))
    monkeypatch.setattr(cpu_cold, "MAX_POOL_BYTES", 4 << 20)
    monkeypatch.setattr(cpu_cold, "PROBE_BYTES", 1 << 20)
    mach = cpu_cold.Machine("test", [], 1, 1 << 20)
    rows = cpu_cold.run_shape("tiny", [1], mach, rounds=1, placement=placement)
    ours = [r for r in rows if r.variant in ("dense", "f=0.1", "f=0.3")]
    assert {r.layout for r in ours} == set(cpu_cold.LAYOUTS)
    for r in ours:
        assert r.ms_per_layer > 0 and r.gbps > 0 and r.layers >= 3
        want = {"dense": 1.0, "f=0.1": 0.1, "f=0.3": 0.3}[r.variant]
        assert abs(r.v_rows_frac - want) < 0.03, r
    assert any(r.variant == "sdpa" for r in rows) and any(r.variant == "vllm-kernel" for r in rows)
    kread = {r.layout: r for r in rows if r.variant == "K read"}
    assert set(kread) == set(cpu_cold.LAYOUTS) and all(r.gbps > 0 for r in kread.values())
    assert kread["BNSD"].gb_read * 1e9 == 2 * 2 * 512 * 64 * 2  # exactly the K bytes
    probe = [r for r in rows if r.variant == "read probe"]
    assert len(probe) == 1 and probe[0].gbps > 0 and all(r.probe_gbps == probe[0].gbps for r in ours)
    assert "read probe" in cpu_cold.format_rows(rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", cpu_cold.LAYOUTS)
def test_k_regions_cover_the_k_bytes_and_no_v_byte(layout, dtype):
    gen = torch.Generator().manual_seed(1)
    B, H, S, D = 2, 2, 300, 64
    k = torch.randn(B, H, S, D, generator=gen).to(dtype)
    v = torch.full((B, H, S, D), 4096.0).to(dtype)  # far outside K's values
    kc, vc, _ = cold_layouts.layer_caches(layout, k, v, torch.tensor([300, 170]), gen)
    r = cold_layouts.k_regions(kc)
    assert r is not None and r.dtype == torch.float32
    assert r.numel() * 4 == kc.numel() * kc.element_size()
    mine = r.reshape(-1).view(dtype) if r.is_contiguous() else r.contiguous().view(dtype)
    assert torch.equal(mine.reshape(-1).sort().values, kc.reshape(-1).sort().values)  # the same elements
    assert float(mine.float().abs().max()) < 100.0  # none of V's


def test_k_regions_refuses_unknown_strides():
    x = torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16)
    assert cold_layouts.k_regions(x.transpose(1, 2)) is None  # NHD seen as HND: heads interleaved
    assert cold_layouts.k_regions(x[:, :, :, 1:]) is None  # rows with gaps
    assert cold_layouts.k_regions(torch.zeros(3, dtype=torch.float64)) is None
    y = torch.zeros(64 * 16 * 8 * 2, dtype=torch.bfloat16)
    assert cold_layouts.k_regions(y.as_strided((4, 2, 16, 8), (256, 64, 8, 1))) is None  # regions of 128 overlap
    assert cold_layouts.k_regions(y.as_strided((4, 2, 16, 8), (256, 128, 8, 1))) is not None


def test_a_wrong_kernel_result_stops_the_benchmark(monkeypatch):
    monkeypatch.setitem(cpu_cold.SHAPES, "tiny", (1, 2, 1, 64, 256, torch.float32))
    monkeypatch.setattr(cpu_cold, "MAX_POOL_BYTES", 2 << 20)
    real = cpu_cold.decode_attention

    def wrong(*a, **kw):
        res = real(*a, **kw)
        if kw.get("backend") == "cpu" and kw.get("return_stats"):
            return res[0] + 1.0, res[1]
        return res

    monkeypatch.setattr(cpu_cold, "decode_attention", wrong)
    try:
        cpu_cold.run_shape("tiny", [1], cpu_cold.Machine("test", [], 1, 1 << 20), rounds=1, layouts=("BNSD",))
    except RuntimeError as e:
        assert "differs from the torch reference" in str(e)
    else:
        raise AssertionError("a wrong output was timed")


def test_gap_threshold_keeps_clear_of_every_score():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 20000, generator=g)
    scores[1, :5000] = 0.25  # a block of tied scores, away from the 90th percentile
    th = cpu_cold.gap_threshold(scores, 0.9)
    assert th.shape == (3, 1) and th.dtype == torch.float32
    for h in range(3):
        s, _ = scores[h].sort()
        above = int((s > th[h]).sum())
        assert abs(above / s.numel() - 0.1) < 64 / s.numel() + 1e-9  # within the search window
        nearest = float((s - th[h]).abs().min())
        gaps = (s[1:] - s[:-1])[int(0.9 * 19999) - 64:int(0.9 * 19999) + 64]
        assert nearest >= float(gaps.max()) / 2 - 1e-7  # the midpoint of the widest nearby gap


def test_gap_threshold_leaves_ties_at_the_quantile():
    scores = torch.arange(1000, dtype=torch.float32).repeat(2, 1)
    scores[:, 800:950] = 850.0  # the 90th percentile falls inside 150 tied scores
    th = cpu_cold.gap_threshold(scores, 0.9)
    assert bool((th != 850.0).all())
    for h in range(2):
        assert float((scores[h] - th[h]).abs().min()) >= 0.5  # half of a gap of at least 1
