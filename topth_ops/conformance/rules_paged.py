"""Conformance rules for paged KV caches (docs/semantics.md, "Paged caches").

A paged case is a random BNSD case copied into shuffled cache blocks
(:func:`topth_ops.conformance.cases.paged_case`); the oracle reads the paged tensors
itself, through the block table, so it shares no gather code with any backend.
"""

from __future__ import annotations

import torch

from ..paged import write_kv
from ..value_sum import PagedValueSum
from .cases import SHAPE_SETS, UNUSED_TABLE_FILL, Case, Shape, paged_case, random_case, vllm_vec_case
from .compare import exact_report, mismatch_report, to_numpy
from .harness import Harness, expect_errors, rule

BLOCK_SIZES = (16, 32, 64, 128)
# Block sizes that do not divide the usual kernel tiles (16 .. 128 rows): a backend
# computes them correctly or refuses them with a reason.
ODD_BLOCK_SIZES = (1, 8, 24, 48, 100)


def _compare_paths(h: Harness, name: str, paged, contiguous) -> None:
    """The paged result equals the backend's own contiguous result (out within the dtype
    tolerance, kept and v_rows exactly)."""
    rep, _ = mismatch_report(f"{name}: paged vs contiguous out", to_numpy(paged[0]),
                             to_numpy(contiguous[0]), **h.tol)
    problems = [rep]
    for field in ("kept", "v_rows"):
        problems.append(exact_report(f"stats.{field} paged vs contiguous",
                                     to_numpy(getattr(paged[1], field)),
                                     to_numpy(getattr(contiguous[1], field))))
    for p in problems:
        if p:
            h.fail(name, p)


@rule("paged_equivalence", "paged NHD/HND caches (block sizes 16-128, shuffled blocks, partial last blocks; HND with K transposed per block as in vLLM's vector-ISA CPU cache) equal the oracle and the contiguous path")
def _paged_equivalence(h: Harness) -> None:
    for i, shape in enumerate(h.shapes):
        placement = "pre_softmax" if i % 2 else "post_softmax"
        sdc = "exp_threshold" if placement == "pre_softmax" else "none"
        base = random_case("paged", shape, h.dtype, placement=placement, sdc=sdc, vmc=True,
                           seed=h.seed("paged", shape.id))
        contiguous = h.forward(base)
        for j, layout in enumerate(("NHD", "HND")):
            bs = BLOCK_SIZES[(i + 2 * j) % len(BLOCK_SIZES)]
            case = paged_case(base, bs, layout, seed=h.seed("paged", shape.id, layout))
            cases = [case] + ([vllm_vec_case(case)] if layout == "HND" else [])
            for c in cases:
                res = h.check(c)
                if res is not None and contiguous is not None:
                    _compare_paths(h, c.name, res, contiguous)


@rule("paged_unused_blocks", "paged: NaN in unallocated blocks and past n, -1 / huge ids in unused table slots, prefix blocks shared by sequences: never read")
def _paged_unused(h: Harness) -> None:
    bs, prefix = 16, 48
    shape = Shape((prefix + 37, prefix + 5, prefix, 3, 0), 9, 3, 64, 4 * 16 + 32)

    def share_prefix(q, k, v):  # sequences 1 and 2 start with sequence 0's first 48 rows
        for b in (1, 2):
            k[b, :, :prefix] = k[0, :, :prefix]
            v[b, :, :prefix] = v[0, :, :prefix]

    for layout in ("NHD", "HND"):
        for placement in ("pre_softmax", "post_softmax"):
            base = random_case(f"paged_shared_{placement}", shape, h.dtype, placement=placement,
                               vmc=True, mutate=share_prefix,
                               seed=h.seed("pagedshared", layout, placement))
            case = paged_case(base, bs, layout, seed=h.seed("pagedshared", layout), spare_blocks=6)
            kw = case.kwargs
            table = kw["block_table"]
            orphans = table[1:3, : prefix // bs].flatten().tolist()
            table[1:3, : prefix // bs] = table[0, : prefix // bs]  # share sequence 0's blocks
            for blk in orphans:  # the blocks no longer named by any table: NaN, never read
                kw["key_cache"][blk] = float("nan")
                kw["value_cache"][blk] = float("nan")
            h.check(Case(case.name + " shared prefix", kw))


def _garbage_rows(count: int, heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Rows an earlier user of a block may leave: random, with NaN, +-inf and huge values."""
    rows = torch.randn(count, heads, dim, generator=gen) * 1e4
    rows[0, 0, 0] = float("nan")
    rows[-1, -1, -1] = float("inf")
    rows[count // 2, 0, -1] = float("-inf")
    return rows


def reused_block_case(base: Case, block_size: int, kv_layout: str, *, seed: int,
                      value_sum=PagedValueSum) -> Case:
    """``base`` (BNSD, vmc) served as an engine serves it, VMC's per-block V sum in the loop.

    The pool starts as NaN (never-written memory); an earlier request fills half of its
    blocks, partly, with NaN / inf rows and is freed. The sequences of ``base`` then get
    blocks of that pool (reused ones first, the rest never written), write their rows
    through ``value_sum.update`` then :func:`topth_ops.paged.write_kv` (update-then-write,
    as the vLLM backend does): a prefill call in which one slot first receives a NaN row,
    a second call that rewrites that slot in place with the real row, one decode-step call,
    and two rejected rows past the end (speculative tokens: written, then not counted in n).
    ``value_mean`` is the sum's mean, read with the value cache."""
    kw = dict(base.kwargs)
    k, v, lens = kw["key_cache"], kw["value_cache"], kw["seq_lens"]
    B, Hkv, S, D = k.shape
    bs = block_size
    per_seq = [-(-(int(n) + 2) // bs) for n in lens.tolist()]
    nb = sum(per_seq) + 4
    dims = (nb, bs, Hkv, D) if kv_layout == "NHD" else (nb, Hkv, bs, D)
    pool_k = torch.full(dims, float("nan"), dtype=k.dtype)
    pool_v = torch.full(dims, float("nan"), dtype=v.dtype)
    vs = value_sum(nb, bs, Hkv, D, kv_layout=kv_layout)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(nb, generator=gen)
    earlier = perm[: nb // 2]
    for i, blk in enumerate(earlier.tolist()):
        rows = _garbage_rows(1 + (7 * i) % bs, Hkv, D, gen)
        slots = blk * bs + torch.arange(rows.shape[0])
        vs.update(pool_v, rows, slots)
        write_kv(pool_k, pool_v, rows, rows, slots, kv_layout)
    M = -(-(S + 2) // bs)
    table = torch.full((B, M), -1, dtype=torch.int32)
    fills = torch.tensor(UNUSED_TABLE_FILL, dtype=torch.int32)
    table[:] = fills[torch.arange(B * M) % len(fills)].view(B, M)
    free = perm.tolist()  # the earlier request's blocks are handed out first
    for b, n in enumerate(lens.tolist()):
        blocks = [free.pop(0) for _ in range(per_seq[b])]
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slot = torch.tensor([blocks[j // bs] * bs + j % bs for j in range(n + 2)], dtype=torch.int64)
        kr, vr = k[b, :, :n].transpose(0, 1), v[b, :, :n].transpose(0, 1)  # [n, Hkv, D]
        rejected = _garbage_rows(2, Hkv, D, gen)

        def put(rows_k, rows_v, at):
            vs.update(pool_v, rows_v, slot[at])
            write_kv(pool_k, pool_v, rows_k, rows_v, slot[at], kv_layout)

        if n >= 2:
            first = vr[: n - 1].clone()
            first[n - 2] = float("nan")  # overwritten in place by the next call
            put(kr[: n - 1], first, torch.arange(n - 1))
            put(kr[n - 2: n - 1], vr[n - 2: n - 1], torch.tensor([n - 2]))
        if n >= 1:
            put(kr[n - 1: n], vr[n - 1: n], torch.tensor([n - 1]))
            put(rejected, rejected, torch.tensor([n, n + 1]))
    kw.update(key_cache=pool_k, value_cache=pool_v, block_table=table, kv_layout=kv_layout,
              value_mean=vs.mean(table, lens, pool_v))
    return Case(f"{base.name}[reused blocks {kv_layout} bs{bs}]", kw)


@rule("paged_reused_blocks", "paged + VMC's per-block V sum: blocks reused from a request that left NaN / inf rows, never-written NaN memory, a slot rewritten in place, rows past n: out is that of the sequence's own rows")
def _paged_reused(h: Harness) -> None:
    shape = Shape((37, 16, 0, 53, 1), 9, 3, 64, 64)
    for i, layout in enumerate(("NHD", "HND")):
        for placement in ("pre_softmax", "post_softmax"):
            base = random_case(f"paged_reused_{placement}", shape, h.dtype, placement=placement, vmc=True,
                               seed=h.seed("pagedreused", layout, placement))
            case = reused_block_case(base, (16, 32)[i], layout, seed=h.seed("pagedreused", layout),
                                     value_sum=PagedValueSum)
            own = dict(case.kwargs, value_mean=None)  # the mean of the sequence's own cache rows
            h.check(case, expected_out=Case(case.name, own).oracle().out)


@rule("paged_block_sizes", "paged with block sizes that do not divide a kernel tile (1, 8, 24, 48, 100): correct, or refused with a reason")
def _paged_odd(h: Harness) -> None:
    shape = SHAPE_SETS["quick"][1]
    base = random_case("paged_odd", shape, h.dtype, placement="pre_softmax", sdc="exact",
                       vmc=True, seed=h.seed("pagedodd"))
    h.check(paged_case(base, 16, "NHD", seed=h.seed("pagedodd", 16)))  # the anchor
    for i, bs in enumerate(ODD_BLOCK_SIZES):
        layout = ("NHD", "HND")[i % 2]
        h.check(paged_case(base, bs, layout, seed=h.seed("pagedodd", bs)))


def _paged_kwargs(h: Harness) -> dict:
    shape = Shape((37, 16, 0), 9, 3, 64, 48)
    base = random_case("paged_errors", shape, h.dtype, placement="pre_softmax",
                       seed=h.seed("pagederrors"))
    return paged_case(base, 16, "NHD", seed=h.seed("pagederrors")).to(h.device).kwargs


def _paged_error_cases(kw: dict) -> list:
    q, k, table, lens, th = (kw[n] for n in ("query", "key_cache", "block_table", "seq_lens", "thresholds"))
    hnd = k.transpose(1, 2)
    cases = [
        ("block_table int64", dict(block_table=table.long()), TypeError, "block_table"),
        ("block_table float", dict(block_table=table.float()), TypeError, "block_table"),
        ("block_table not a tensor", dict(block_table=table.tolist()), TypeError, "block_table"),
        ("block_table of rank 1", dict(block_table=table[:, 0]), ValueError, "block_table"),
        ("block_table batch mismatch", dict(block_table=table[:2]), ValueError, "block_table"),
        ("block_table on another device", dict(block_table=table.to("meta")), ValueError, "block_table"),
        ("block_table with no column", dict(block_table=table[:, :0]), ValueError, "block_table"),
        ("kv_layout unknown", dict(kv_layout="BHSD"), ValueError, "kv_layout"),
        ("kv_layout BNSD with a block table", dict(kv_layout="BNSD"), ValueError, "kv_layout"),
        ("paged layout without a block table", dict(block_table=None), ValueError, "kv_layout"),
        ("paged cache of rank 3", dict(key_cache=k[0], value_cache=kw["value_cache"][0]), ValueError, "key_cache"),
        ("value_cache layout differs", dict(value_cache=kw["value_cache"].transpose(1, 2)), ValueError, "value_cache"),
        ("HND cache passed as NHD", dict(key_cache=hnd, value_cache=kw["value_cache"].transpose(1, 2)),
         ValueError, "num_q_heads"),
        ("selection unknown", dict(selection="kv"), ValueError, "selection"),
        ("group selection with per-head thresholds", dict(selection="group"), ValueError, "thresholds"),
        ("threshold_set with 2-D thresholds", dict(threshold_set=torch.zeros_like(lens)), ValueError, "threshold_set"),
        ("3-D thresholds without threshold_set", dict(thresholds=th[None]), ValueError, "threshold_set"),
        ("threshold_set float", dict(thresholds=th[None], threshold_set=lens.float()), TypeError, "threshold_set"),
        ("threshold_set shape", dict(thresholds=th[None], threshold_set=lens[:2]), ValueError, "threshold_set"),
        ("sdc_table without the set dim", dict(thresholds=th[None], threshold_set=torch.zeros_like(lens),
                                               sdc="offline", sdc_table=torch.ones_like(th)), ValueError, "sdc_table"),
    ]
    if lens.device.type == "cpu":  # value checks need no device sync only on the CPU
        bad_neg, bad_big, short = table.clone(), table.clone(), lens.clone()
        bad_neg[0, 1] = -3
        bad_big[1, 0] = k.shape[0]
        short[0] = table.shape[1] * k.shape[1] + 1
        cases += [
            ("used block_table entry negative", dict(block_table=bad_neg), ValueError, "block_table"),
            ("used block_table entry past num_blocks", dict(block_table=bad_big), ValueError, "block_table"),
            ("block_table too short for seq_lens", dict(seq_lens=short), ValueError, "seq_lens"),
            ("threshold_set out of range", dict(thresholds=th[None], threshold_set=torch.ones_like(lens)),
             ValueError, "threshold_set"),
        ]
    return cases


@rule("paged_errors", "invalid block tables, layouts, selections and threshold sets raise TypeError/ValueError naming the argument, before the backend runs")
def _paged_errors(h: Harness) -> None:
    kw = _paged_kwargs(h)
    expect_errors(h, kw, _paged_error_cases(kw))


# vLLM's AMX cache: (head_dim, block size, selection, placement); GQA groups of 1, 4 and 16
VLLM_AMX_CASES = ((64, 32, "head", "pre_softmax", (8, 2)), (128, 128, "group", "post_softmax", (16, 1)),
                  (64, 64, "group", "pre_softmax", (9, 9)), (128, 32, "head", "post_softmax", (8, 2)))


@rule("vllm_amx_layout", "vLLM's AMX cache (kv_layout='VLLM_AMX': bfloat16 blocks packed for tiles) equals the oracle and the contiguous path; other dtypes, block sizes, head_dims and strides are refused naming the argument")
def _vllm_amx_layout(h: Harness) -> None:
    base = None
    if h.dtype == torch.bfloat16:
        for i, (d, bs, selection, placement, (hq, hkv)) in enumerate(VLLM_AMX_CASES):
            shape = Shape((150, 33, 0, 97 + 16 * i), hq, hkv, d, 160)
            base = random_case("vllm_amx", shape, h.dtype, placement=placement, selection=selection, vmc=True,
                               sdc="exact" if placement == "pre_softmax" else "none",
                               seed=h.seed("vllmamx", i))
            contiguous = h.forward(base)
            case = paged_case(base, bs, "VLLM_AMX", seed=h.seed("vllmamx", bs))
            res = h.check(case)
            if res is not None and contiguous is not None:
                _compare_paths(h, case.name, res, contiguous)
    # refusals, built from a bfloat16 case whatever the rule's dtype
    ref = random_case("vllm_amx_errors", Shape((40, 7), 4, 2, 64, 64), torch.bfloat16, placement="pre_softmax",
                      seed=h.seed("vllmamxerr"))
    kw = paged_case(ref, 32, "VLLM_AMX", seed=h.seed("vllmamxerr")).to(h.device).kwargs
    k, v = kw["key_cache"], kw["value_cache"]
    other = torch.float16 if h.dtype == torch.bfloat16 else h.dtype
    nb, hkv = k.shape[0], k.shape[1]
    cases = [
        ("another dtype", dict(query=kw["query"].to(other), key_cache=k.to(other), value_cache=v.to(other)),
         TypeError, "VLLM_AMX"),
        ("block size 16", dict(key_cache=k.reshape(2 * nb, hkv, 16, 64), value_cache=v.reshape(2 * nb, hkv, 16, 64),
                               block_table=torch.cat([kw["block_table"], kw["block_table"]], 1)),
         ValueError, "block_size"),
        ("head dim not a multiple of 32", dict(query=kw["query"][..., :48], key_cache=k[..., :48],
                                              value_cache=v[..., :48]), ValueError, "head_dim"),
        ("region not contiguous", dict(key_cache=k.transpose(0, 1).contiguous().transpose(0, 1)[:, :, :, :],
                                      value_cache=torch.cat([v, v], 3)[..., :64]), ValueError, "value_cache"),
    ]
    expect_errors(h, kw, cases)
