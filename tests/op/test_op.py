"""The torch.library custom op: opcheck, torch.compile, fake tensors, direct path."""

import pytest
import torch
from torch.library import opcheck

import topth_ops
from topth_ops.contract import make_inputs
from topth_ops.op import run


def _args(dtype=torch.float32, return_stats=True, vmc=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 32, generator=g).to(dtype)
    k = torch.randn(3, 2, 20, 32, generator=g).to(dtype)
    v = torch.randn(3, 2, 20, 32, generator=g).to(dtype)
    lens = torch.tensor([20, 0, 7])
    th = torch.full((6, 20), 0.05)
    return (q, k, v, lens, th, None, "post_softmax", "none", 0.05, None, vmc, None, return_stats, "")


@pytest.mark.parametrize("return_stats", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck(dtype, return_stats):
    opcheck(torch.ops.topth.decode_attention.default, _args(dtype, return_stats, vmc=True))


def test_opcheck_pre_softmax_offline():
    a = list(_args())
    a[6], a[7], a[9] = "pre_softmax", "offline", torch.rand(6, 20)
    a[4] = torch.zeros(6, 20)
    opcheck(torch.ops.topth.decode_attention.default, tuple(a))


def test_torch_compile_matches_eager():
    q, k, v, lens, th = _args()[:5]

    def f(q, k, v, lens, th):
        return topth_ops.decode_attention(q, k, v, lens, th, vmc=True) * 2.0

    eager = f(q, k, v, lens, th)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=False)(q, k, v, lens, th)
    torch.testing.assert_close(compiled, eager)


def test_fake_tensor_shapes_and_validation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 64)
        k = torch.empty(2, 4, 100, 64)
        out, kept, v_rows, dropped = torch.ops.topth.decode_attention(
            q, k, k, torch.empty(2, dtype=torch.int64), torch.empty(8, 100), None,
            "post_softmax", "none", 0.05, None, False, None, True, "")
        assert out.shape == (2, 8, 64) and kept.shape == (2, 8) and v_rows.shape == (2, 4)
        assert kept.dtype == torch.int32 and dropped.dtype == torch.float32
        with pytest.raises(ValueError, match="num_q_heads"):
            torch.ops.topth.decode_attention(
                torch.empty(2, 7, 64), k, k, torch.empty(2, dtype=torch.int64), torch.empty(7, 100),
                None, "post_softmax", "none", 0.05, None, False, None, False, "")


def test_direct_path_equals_custom_op():
    a = _args()
    inputs = make_inputs(*a[:5], placement="post_softmax", return_stats=True)
    out, stats = run(inputs, "torch")
    out2, st2 = topth_ops.decode_attention(*a[:5], return_stats=True, backend="torch")
    assert torch.equal(out, out2)
    assert all(torch.equal(x, y) for x, y in zip(stats, st2))


def test_op_called_directly_validates():
    a = list(_args())
    a[3] = torch.tensor([21, 0, 7])  # beyond max_seq_len = 20
    with pytest.raises(ValueError, match="seq_lens values must lie in"):
        torch.ops.topth.decode_attention(*a)


def _counting(monkeypatch, module):
    """Count the make_inputs calls made through ``module``'s own name for it."""
    calls = []
    real = module.make_inputs

    def counted(*a, **kw):
        calls.append(kw.get("check_values", True))
        return real(*a, **kw)

    monkeypatch.setattr(module, "make_inputs", counted)
    return calls


def test_api_validates_once_per_call_and_the_op_validates_its_own(monkeypatch):
    """Eager decode_attention builds DecodeInputs once and runs the direct path on them (the
    op's implementation is not called); a direct call of the public op validates its own
    arguments, once."""
    import topth_ops.api as api_mod
    import topth_ops.op as op_mod

    q, k, v, lens, th, *_ = _args()
    api_calls, op_calls = _counting(monkeypatch, api_mod), _counting(monkeypatch, op_mod)
    out, stats = topth_ops.decode_attention(q, k, v, lens, th, return_stats=True, backend="torch")
    assert (len(api_calls), len(op_calls)) == (1, 0)
    want, want_stats = run(make_inputs(q, k, v, lens, th, return_stats=True), "torch")
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert torch.equal(stats.kept, want_stats.kept)
    got = torch.ops.topth.decode_attention(*_args())
    assert len(op_calls) == 1  # a direct call of the op validates its own arguments
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)  # automatic backend vs torch


def test_the_public_op_validates_every_call():
    """The public op never trusts earlier inputs: calls with other tensors or scalars give
    their own results, and bad arguments are refused by the op itself."""
    from topth_ops.op import decode_attention_op

    a = list(_args(return_stats=False))
    b = list(a)
    b[3] = torch.tensor([5, 20, 1])  # other seq_lens
    c = list(a)
    c[5] = 0.5  # other scale
    for other in (a, b, c):
        got = decode_attention_op(*other)[0]
        kw = {"scale": other[5]} if other[5] is not None else {}
        want, _ = run(make_inputs(*other[:5], **kw), "torch")
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    bad = list(a)
    bad[3] = torch.tensor([5, 20, 10**6])  # a length past the cache
    with pytest.raises(ValueError, match="seq_lens values must lie in"):
        decode_attention_op(*bad)
