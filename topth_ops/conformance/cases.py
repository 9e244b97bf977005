"""Shapes and input generation for the conformance suite.

Thresholding is discontinuous, so generated thresholds sit in the middle of a gap between
consecutive scores (or log-probabilities, for post_softmax) of every sequence that reads
them: every valid score is at least :data:`MIN_GUARD` away from its threshold, so the kept
set is the same in float64 and in any correct float32 evaluation. Ties are tested
separately with exactly representable values. Cache tails (positions >= n) are filled
with NaN unless a rule asks otherwise.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from .oracle import keep_values, oracle_decode

# Smallest allowed distance between a valid score and its threshold (score units for
# pre_softmax, log-probability units for post_softmax). float32 scores of this suite's
# inputs (|a| < 20, head_dim <= 256) are accurate to ~1e-5.
MIN_GUARD = 2e-4


@dataclass(frozen=True)
class Shape:
    """One batch layout: per-sequence lengths, heads and cache size."""

    seq_lens: tuple
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int

    @property
    def id(self) -> str:
        lens = "-".join(str(n) for n in self.seq_lens)
        return (f"h{self.num_q_heads}x{self.num_kv_heads}_d{self.head_dim}"
                f"_s{self.max_seq_len}_n{lens}")


def _S(lens, hq, hkv, d, s):
    return Shape(tuple(lens), hq, hkv, d, s)


# The contract's shapes on purpose: n in {0, 1, 2, 7, 54, 97, 128, 1000, 4097}, head_dim in
# {64, 80, 96, 128, 256}, (q, kv) heads in {(1,1), (8,8), (9,3), (10,2), (32,2), (32,8)},
# batches with mixed lengths and cache tails beyond n. "full" covers every value of every
# dimension; "quick" (for slow backends, e.g. the Triton interpreter) covers each head
# configuration class and the odd head dims with short sequences.
SHAPE_SETS: dict[str, list[Shape]] = {
    "full": [
        _S((1, 97, 0, 2), 1, 1, 80, 128),
        _S((54, 7, 128), 8, 8, 64, 130),
        _S((4097, 1000), 9, 3, 64, 4100),
        _S((1000, 0, 54), 10, 2, 96, 1003),
        _S((128, 97, 1, 2, 7), 32, 2, 128, 131),
        _S((1000, 54), 32, 8, 256, 1024),
        _S((4097,), 32, 8, 128, 4097),
        _S((2, 128), 9, 3, 256, 130),
    ],
    "quick": [
        _S((1, 97, 0), 1, 1, 80, 100),
        _S((54, 7, 128, 2), 9, 3, 64, 130),
        _S((300, 0), 10, 2, 96, 333),
        _S((97,), 32, 8, 256, 128),
    ],
}


def seed_of(*parts) -> int:
    """Deterministic seed from strings/numbers (Python's hash() is salted per process)."""
    return zlib.crc32("/".join(str(p) for p in parts).encode())


@dataclass
class Case:
    """One call: keyword arguments of decode_attention (minus backend/return_stats)."""

    name: str
    kwargs: dict = field(default_factory=dict)

    def oracle(self):
        return oracle_decode(**self.kwargs)

    def to(self, device: torch.device) -> "Case":
        """The same call on ``device``, every tensor keeping its exact strides."""
        kw = {k: (_move(v, device) if isinstance(v, torch.Tensor) else v) for k, v in self.kwargs.items()}
        return Case(self.name, kw)


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == torch.device(device) or t.is_contiguous():
        return t.to(device)
    return move_strided(t, device)


def move_strided(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device`` with the same shape, strides and storage offset.

    The storage span the view can reach is moved as one flat copy and viewed again, so
    views whose elements share memory (stride-0 expands) keep sharing it; allocating the
    strided destination and ``copy_`` into it is refused for such views.
    """
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    flat = t.as_strided((t.storage_offset() + span,), (1,), 0)
    return flat.to(device).as_strided(t.shape, t.stride(), t.storage_offset())


def random_tensors(shape: Shape, dtype: torch.dtype, rng: np.random.Generator, *,
                   q_scale_range=(0.5, 3.0), tail: Optional[float] = float("nan")):
    """Random q, k, v (rounded to ``dtype``) and seq_lens for ``shape``.

    Each query head gets its own magnitude from ``q_scale_range`` so that some heads are
    flat and some peaked. Cache positions >= n are set to ``tail`` (NaN by default;
    None keeps the random values).
    """
    B = len(shape.seq_lens)
    Hq, Hkv, D, S = shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.max_seq_len
    q = rng.standard_normal((B, Hq, D)) * rng.uniform(*q_scale_range, size=(1, Hq, 1))
    k = rng.standard_normal((B, Hkv, S, D))
    v = rng.standard_normal((B, Hkv, S, D))
    to = lambda x: torch.from_numpy(x).to(torch.float32).to(dtype)  # noqa: E731
    q, k, v = to(q), to(k), to(v)
    if tail is not None:
        for b, n in enumerate(shape.seq_lens):
            k[b, :, n:] = tail
            v[b, :, n:] = tail
    lens = torch.tensor(shape.seq_lens, dtype=torch.int64 if B % 2 else torch.int32)
    return q, k, v, lens


def _score_rows(q, k, lens, scale, placement):
    """float64 scores (pre) or log-probabilities (post) per (b, h): list of lists of arrays."""
    qd, kd = q.double().numpy(), k.double().numpy()
    B, Hq, _ = qd.shape
    group = Hq // kd.shape[1]
    rows = []
    with np.errstate(invalid="ignore", over="ignore"):  # injected NaN / inf are intended
        for b in range(B):
            rows.append(_score_row(qd, kd, b, int(lens[b]), Hq, group, scale, placement))
    return rows


def _score_row(qd, kd, b, n, Hq, group, scale, placement):
    per_head = []
    for h in range(Hq):
        a = scale * (kd[b, h // group, :n] @ qd[b, h])
        per_head.append(keep_values(a, placement) if n else a)  # what the oracle compares
    return per_head


def _pick_threshold(values: np.ndarray, keep_frac: float) -> float:
    """Midpoint of the widest gap between sorted ``values`` near the (1 - keep_frac) quantile;
    the result keeps roughly ``keep_frac`` of the values and lies >= MIN_GUARD from all."""
    s = np.sort(values[np.isfinite(values)])
    if s.size == 0:
        return 0.0
    ext = np.concatenate([[s[0] - 2.0], s, [s[-1] + 2.0]])
    gaps = np.diff(ext)  # gap i lies between ext[i] and ext[i+1]; keeping len(s) - i values
    target = int(round((1.0 - keep_frac) * len(s)))
    for half_window in (max(2, len(s) // 20), max(4, len(s) // 5), len(s) + 2):
        lo, hi = max(0, target - half_window), min(len(gaps), target + half_window + 1)
        i = lo + int(np.argmax(gaps[lo:hi]))
        if gaps[i] >= 4 * MIN_GUARD:
            return float((ext[i] + ext[i + 1]) / 2)
    return float(s[0] - 1.0)  # every value tied: keep them all


def _group_max(rows_b: list, group: int) -> list:
    """Per KV head: the elementwise maximum over its query heads' score rows."""
    return [np.max(rows_b[g * group:(g + 1) * group], axis=0) for g in range(len(rows_b) // group)]


def guarded_thresholds(q, k, lens, *, scale, placement, max_row_id, rng,
                       keep_range=(0.05, 0.95), selection="head", sets=None,
                       num_sets=1) -> torch.Tensor:
    """float32 thresholds with a guard band around every score.

    ``[H, max_row_id]``, or ``[num_sets, H, max_row_id]`` when ``sets`` (one set index per
    sequence) is given; H = num_q_heads, or num_kv_heads with ``selection="group"``,
    where the band is kept around the group maximum of the scores (what group selection
    compares). Columns that no sequence reads are NaN, so reading a wrong column (or a
    wrong set) keeps nothing and shows up as a mismatch. Each (set, head, column) gets
    its own target kept fraction drawn from ``keep_range``. ``k`` is a BNSD cache.
    """
    rows = _score_rows(q, k, lens, scale, placement)
    group = q.shape[1] // k.shape[1]
    if selection == "group":
        rows = [_group_max(r, group) for r in rows]
    H = len(rows[0])
    th = np.full((num_sets, H, max_row_id), np.nan)
    users: dict[tuple, list[int]] = {}
    for b, n in enumerate(lens.tolist()):
        if n > 0:
            s = int(sets[b]) if sets is not None else 0
            users.setdefault((s, min(n, max_row_id) - 1), []).append(b)
    for (s, col), bs in users.items():
        for h in range(H):
            vals = np.concatenate([rows[b][h] for b in bs])
            t = _pick_threshold(vals, rng.uniform(*keep_range))
            th[s, h, col] = np.exp(t) if placement == "post_softmax" else t
    th = torch.from_numpy(th).to(torch.float32)
    return th if sets is not None else th[0]


def random_case(name: str, shape: Shape, dtype: torch.dtype, *, placement: str,
                sdc: str = "none", sdc_gamma: float = 0.05, vmc: bool = False,
                value_mean: bool = False, scale: Optional[float] = None,
                max_row_id: Optional[int] = None, keep_range=(0.05, 0.95),
                tail: Optional[float] = float("nan"), seed: int = 0,
                mutate: Optional[Callable] = None, selection: str = "head",
                num_sets: Optional[int] = None) -> Case:
    """A random call with guard-banded thresholds (see module docstring).

    ``mutate(q, k, v)``, if given, edits the tensors in place before the thresholds are
    chosen (used to inject NaN / inf). ``selection="group"`` makes one threshold per KV
    head; ``num_sets`` makes 3-D thresholds (and sdc_table) with a random
    ``threshold_set`` per sequence.
    """
    rng = np.random.default_rng(seed)
    q, k, v, lens = random_tensors(shape, dtype, rng, tail=tail)
    if mutate is not None:
        mutate(q, k, v)
    R = max_row_id or shape.max_seq_len
    eff_scale = scale if scale is not None else 1.0 / np.sqrt(shape.head_dim)
    sets = None
    if num_sets is not None:
        sets = torch.from_numpy(rng.integers(0, num_sets, size=len(shape.seq_lens)))
    th = guarded_thresholds(q, k, lens, scale=eff_scale, placement=placement, max_row_id=R,
                            rng=rng, keep_range=keep_range, selection=selection, sets=sets,
                            num_sets=num_sets or 1)
    kw = dict(query=q, key_cache=k, value_cache=v, seq_lens=lens, thresholds=th, scale=scale,
              placement=placement, sdc=sdc, sdc_gamma=sdc_gamma, vmc=vmc)
    if selection != "head":
        kw["selection"] = selection
    if sets is not None:
        kw["threshold_set"] = sets.to(torch.int32 if num_sets % 2 else torch.int64)
    if sdc == "offline":
        table_shape = (*th.shape[:-2], shape.num_q_heads, R)
        kw["sdc_table"] = torch.from_numpy(rng.uniform(0.05, 5.0, size=table_shape)).to(torch.float32)
    if value_mean:
        vm = rng.standard_normal((len(shape.seq_lens), shape.num_kv_heads, shape.head_dim))
        kw["value_mean"] = torch.from_numpy(vm).to(torch.float32)
    return Case(f"{name}[{shape.id}]", kw)


# Values that unused block-table slots hold in paged cases: padding (-1), ids past the pool,
# the largest int32: a backend that follows one of them reads out of bounds or NaN blocks.
UNUSED_TABLE_FILL = (-1, 1 << 30, 2**31 - 1)


def paged_case(case: Case, block_size: int, kv_layout: str, *, seed: int = 0,
               spare_blocks: int = 3) -> Case:
    """The same call with paged caches: shuffled blocks, partial last blocks.

    Unallocated blocks (``spare_blocks`` of them in the pool) and slots past n are NaN;
    table slots past a sequence's blocks hold :data:`UNUSED_TABLE_FILL` values.
    """
    from ..paged import to_paged

    kw = dict(case.kwargs)
    lens = kw["seq_lens"]
    need = sum(-(-int(n) // block_size) for n in lens.tolist())
    gen = torch.Generator().manual_seed(seed)
    k, v, table = to_paged(kw["key_cache"], kw["value_cache"], lens, block_size, kv_layout=kv_layout,
                           num_blocks=need + spare_blocks, generator=gen, fill=float("nan"))
    unused = table < 0
    fills = torch.tensor(UNUSED_TABLE_FILL, dtype=torch.int32)
    table[unused] = fills[torch.arange(int(unused.sum())) % len(fills)]
    kw.update(key_cache=k, value_cache=v, block_table=table, kv_layout=kv_layout)
    return Case(f"{case.name}[paged {kv_layout} bs{block_size}]", kw)


def vllm_vec_case(case: Case) -> Case:
    """An ``"HND"`` paged case re-laid as vLLM's CPU cache for its vector ISAs: per block and
    KV head one region of ``2 * block_size * head_dim`` elements, K transposed first
    (``[head_dim, block_size]``: slot stride 1, dim stride ``block_size``), then V as rows.
    The caches passed are ``"HND"`` views into that one buffer (docs/semantics.md)."""
    kw = dict(case.kwargs)
    if kw.get("kv_layout") != "HND":
        raise ValueError(f"vllm_vec_case: expected an HND paged case, got kv_layout={kw.get('kv_layout')!r}")
    k, v = kw["key_cache"], kw["value_cache"]
    nb, hkv, bs, d = k.shape
    buf = torch.full((nb, hkv, 2, d * bs), float("nan"), dtype=k.dtype)
    kt = buf[:, :, 0].view(nb, hkv, d, bs)
    kt.copy_(k.transpose(2, 3))
    vv = buf[:, :, 1].view(nb, hkv, bs, d)
    vv.copy_(v)
    kw.update(key_cache=kt.transpose(2, 3), value_cache=vv)
    return Case(case.name.replace("paged HND", "vLLM vec cache"), kw)
