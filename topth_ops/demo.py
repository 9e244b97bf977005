"""``topth-ops demo``: a synthetic decode step, thresholded vs dense attention.

Random GQA caches whose keys have a few strongly attended positions; thresholds set per
query head as the (k+1)-th largest post-softmax probability, averaged over a calibration
batch (paper section 3.1, algorithm 1, without the std term); then a fresh batch is
decoded with every variant and compared with dense attention. Synthetic data only: the
real-model job is ``topth-ops calibrate`` / ``evaluate``.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--k", type=int, default=64, help="target kept elements per row")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--seed", type=int, default=0)


def _inputs(args, gen, dtype):
    import torch

    B, Hq, Hkv, S, D = args.batch, args.q_heads, args.kv_heads, args.seq_len, args.head_dim
    k = torch.randn(B, Hkv, S, D, generator=gen)
    # a few "heavy hitter" keys per KV head that the queries align with
    hot = torch.randint(0, S, (B, Hkv, 16), generator=gen)
    direction = torch.randn(B, Hkv, 1, D, generator=gen)
    k.scatter_add_(2, hot[..., None].expand(-1, -1, -1, D), 1.0 * direction.expand(-1, -1, 16, -1))
    q = torch.randn(B, Hq, D, generator=gen) + 1.5 * direction[:, :, 0].repeat_interleave(Hq // Hkv, 1)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    lens = torch.full((B,), S, dtype=torch.int64)
    return q.to(dtype), k.to(dtype), v.to(dtype), lens


def _check(args) -> None:
    from .cli import CliError
    from .registry import get_backend

    for name in ("batch", "seq_len", "q_heads", "kv_heads", "head_dim", "k"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.q_heads % args.kv_heads:
        raise CliError(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.k >= args.seq_len:
        raise CliError(f"--k must be < --seq-len ({args.seq_len}), got {args.k}")
    if args.backend is not None:
        try:
            get_backend(args.backend)
        except ValueError as e:
            raise CliError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    import torch

    from . import decode_attention

    _check(args)

    gen = torch.Generator().manual_seed(args.seed)
    dtype = torch.float32
    S, D, Hq, Hkv = args.seq_len, args.head_dim, args.q_heads, args.kv_heads
    # calibration: the (k+1)-th largest probability of each row, averaged per head
    q, k, v, lens = _inputs(args, gen, dtype)
    a = torch.einsum("bhd,bhsd->bhs", q.float(), k.float().repeat_interleave(Hq // Hkv, 1)) / D ** 0.5
    probs = a.softmax(-1)
    kth = probs.topk(args.k + 1, dim=-1).values[..., -1]  # [B, Hq]
    theta_post = kth.mean(0)[:, None].expand(Hq, S).contiguous()
    kth_logit = a.topk(args.k + 1, dim=-1).values[..., -1]
    theta_pre = kth_logit.mean(0)[:, None].expand(Hq, S).contiguous()

    q, k, v, lens = _inputs(args, gen, dtype)
    dense = decode_attention(q, k, v, lens, torch.full((Hq, 1), float("-inf")), backend=args.backend)
    variants = [
        ("post_softmax", "none", False, theta_post),
        ("post_softmax", "none", True, theta_post),
        ("pre_softmax", "none", False, theta_pre),
        ("pre_softmax", "exact", False, theta_pre),
        ("pre_softmax", "exp_threshold", True, theta_pre),
    ]
    print(f"synthetic decode: batch {args.batch}, seq_len {S}, {Hq} q / {Hkv} kv heads, "
          f"head_dim {D}, target k = {args.k}")
    print(f"{'placement':<13} {'sdc':<14} {'vmc':<5} {'rel. L2 error':>13} {'k~/k':>6} {'V rows read':>12}")
    for placement, sdc, vmc, th in variants:
        out, st = decode_attention(q, k, v, lens, th, placement=placement, sdc=sdc, vmc=vmc,
                                   return_stats=True, backend=args.backend)
        err = ((out - dense).norm() / dense.norm()).item()
        k_ratio = st.kept.float().mean().item() / args.k
        v_frac = st.v_rows.float().mean().item() / S
        print(f"{placement:<13} {sdc:<14} {str(vmc):<5} {err:>13.4f} {k_ratio:>6.2f} {v_frac:>11.1%}")
    print("V rows read: union over each GQA group's query heads, as a fraction of dense.")
    return 0
