"""Launcher and heuristics: tile sizes per head_dim and group size, split count from the
compiled kernel's occupancy, candidate capacity of post_softmax, and
:func:`decode_attn_fwd`, which launches the kernels of :mod:`topth_ops.cuda_kernels`
(:mod:`~topth_ops.cuda_kernels.attn_pre` or :mod:`~topth_ops.cuda_kernels.attn_post`, then
:mod:`~topth_ops.cuda_kernels.combine`)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

import torch

from ...codes import MAX_POSITIONS, Sdc
from ...cuda_kernels.attn_post import post_scores_kernel, post_select_kernel
from ...cuda_kernels.attn_pre import pre_kernel
from ...cuda_kernels.combine import combine_kernel
from ...env import interpreter_enabled
from ...validation import cache_dims, cache_strides
from . import occupancy

logger = logging.getLogger("topth_ops")

MAX_SPLITS = 64


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and split count of one call (see :func:`choose_config`).

    Attributes
    ----------
    block_n : int
        KV positions per tile (power of two, >= 16).
    num_splits : int
        Splits of the KV sequence (flash-decoding); partials are merged by LSE.
    num_warps, num_stages : int
        Triton launch parameters of the main kernels (``num_stages``: depth of the
        software pipeline of the K loads).
    tile_skip : bool
        Branch around the V load and product of a tile no head keeps (helps only when kept
        rows are clustered; off by default, the V load is then issued a tile early).
    post_capacity : int or None
        post_softmax: candidate positions kept per split (None: :func:`post_capacity`).
    """

    block_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 4
    tile_skip: bool = False
    post_capacity: Optional[int] = None


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def group_pad(group: int) -> int:
    """Rows of the head tile: the next power of two >= 16 (tensor-core products need 16
    rows; also for one query head per KV head, see :func:`topth_ops.cuda_kernels.tiles.dot_qk`)."""
    return max(16, next_pow2(group))


def gpu_tiles(head_dim: int, group: int, elem_bytes: int = 2, placement: str = "pre_softmax") -> tuple[int, int]:
    """(block_n, num_warps) on a GPU, chosen from the sm_90 compilation (``topth-ops bench
    --compile-report``: no spill, registers within budget, fewest issue cycles per byte;
    docs/triton.md): an 8 KiB K tile per pipeline stage (``block_n x D_PAD = 4096``
    elements in 16-bit, 2048 in fp32) and 4 warps; head tiles of 64+ rows use 8 warps,
    with half the tile for post_softmax (its selection kernel needs the registers)."""
    d_pad = max(16, next_pow2(head_dim))
    block_n = max(16, min(128, 8192 // max(2, elem_bytes) // d_pad))
    if group_pad(group) >= 64:
        return (max(16, block_n // 2) if placement == "post_softmax" else block_n), 8
    return block_n, 4


def post_capacity(chunk: int, block_n: int) -> int:
    """Default candidate capacity per split: 2048 positions (whole tiles), at most the
    split's length. With in-place compaction the list holds at most G e^slack / theta
    entries (docs/triton.md); a split that still overflows recomputes its scores from K
    (correct, slower), so the capacity trades memory for that rare fallback."""
    cap = -(-2048 // block_n) * block_n
    return max(block_n, min(cap, -(-chunk // block_n) * block_n))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: few programs, each serial in Python


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int,
                      num_sms: int, ctas_per_sm: int = 2) -> int:
    """Split count: one full wave of ``num_sms x ctas_per_sm`` slots (see
    :func:`topth_ops.backends.triton.occupancy.choose_splits`)."""
    return occupancy.choose_splits(batch * num_kv_heads, max_seq_len, block_n, num_sms, ctas_per_sm,
                                   max_splits=MAX_SPLITS)


def choose_config(batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                  device: torch.device, group: int = 4, elem_bytes: int = 2,
                  placement: str = "pre_softmax") -> LaunchConfig:
    """Default :class:`LaunchConfig` with a static occupancy estimate of 2 CTAs per SM; the
    launcher refines the split count from the compiled kernel on a GPU."""
    if interpreter_enabled() or device.type != "cuda":
        block_n, warps = 32, 4
    else:
        block_n, warps = gpu_tiles(head_dim, group, elem_bytes, placement)
    ns = choose_num_splits(batch, num_kv_heads, max_seq_len, block_n, _num_sms(device))
    return LaunchConfig(block_n=block_n, num_splits=ns, num_warps=warps)


_OCCUPANCY: dict = {}


def _ctas_per_sm(kernel, args, kwargs, device) -> Optional[int]:
    """Resident CTAs per SM of ``kernel`` as compiled for these arguments (tensors or the
    dtypes that stand in for them), from its registers and shared memory and the device's
    limits; None if unavailable (then the static estimate of 2 is used). Compiled through
    Triton's warmup once per variant and cached."""
    name = getattr(getattr(kernel, "fn", None), "__name__", str(kernel))
    key = (name, tuple(sorted((k, str(v)) for k, v in kwargs.items())),
           tuple(str(a.dtype) if isinstance(a, torch.Tensor) else
                 (str(a) if isinstance(a, torch.dtype) else (a if isinstance(a, int) and a in (0, 1) else 2))
                 for a in args), device.index)
    if key in _OCCUPANCY:
        return _OCCUPANCY[key]
    ctas = None
    try:
        wargs = [a.dtype if isinstance(a, torch.Tensor) else a for a in args]
        compiled = kernel.warmup(*wargs, grid=(1,), **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        compiled._init_handles()
        props = torch.cuda.get_device_properties(device)
        limits = occupancy.SmLimits(
            regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
            smem_per_sm=getattr(props, "shared_memory_per_multiprocessor", 228 * 1024),
            max_threads_per_sm=getattr(props, "max_threads_per_multi_processor", 2048))
        ctas = occupancy.ctas_per_sm(compiled.n_regs, compiled.metadata.shared, kwargs["num_warps"], limits)
        if compiled.n_spills:
            logger.warning("topth: triton kernel %s spills %d registers", name, compiled.n_spills)
    except Exception as e:  # noqa: BLE001 - fall back to the static estimate
        logger.info("topth: occupancy of %s unavailable (%s): 2 CTAs/SM assumed", name, e)
    _OCCUPANCY[key] = ctas
    return ctas


def decode_attn_fwd(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    thresholds: Optional[torch.Tensor],
    out: torch.Tensor,
    *,
    scale: float,
    placement: str = "pre_softmax",
    sdc: str = "none",
    sdc_gamma: float = 0.05,
    sdc_table: Optional[torch.Tensor] = None,
    vmc: bool = False,
    value_mean: Optional[torch.Tensor] = None,
    stats: Optional[tuple] = None,
    dense: bool = False,
    config: Optional[LaunchConfig] = None,
    block_table: Optional[torch.Tensor] = None,
    kv_layout: str = "BNSD",
    selection: str = "head",
    threshold_set: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Launch the thresholded (or dense) split-KV decode kernels; writes ``out`` in place.

    Inputs are assumed validated by :func:`topth_ops.contract.make_inputs` (shapes,
    dtypes, devices). Values that are not checked on a GPU are clamped on the device:
    seq_lens into [0, max_seq_len] in their own dtype, threshold_set into
    [0, num_sets - 1], used block-table entries into [0, num_blocks - 1]. Every tensor is
    read through its strides (no copies).

    Parameters
    ----------
    query : torch.Tensor
        ``[B, Hq, D]`` float16 / bfloat16 / float32; D a multiple of 16 up to 256 (any D
        <= 256 works: columns are padded to a power of two and masked).
    key_cache, value_cache : torch.Tensor
        BNSD ``[B, Hkv, S, D]``, or paged NHD ``[num_blocks, block_size, Hkv, D]`` / HND
        ``[num_blocks, Hkv, block_size, D]`` with ``block_table``; query dtype, any strides.
    seq_lens : torch.Tensor
        ``[B]`` int32 / int64.
    thresholds : torch.Tensor or None
        float32 ``[H, R]`` or ``[num_sets, H, R]`` (H = Hq for ``selection="head"``, Hkv
        for ``"group"``); logits for pre_softmax, probabilities for post_softmax; ignored
        (may be None) with ``dense=True``.
    out : torch.Tensor
        ``[B, Hq, D]``, query dtype: every element is written.
    scale : float
        Softmax scale (a_j = scale * <q, k_j>).
    placement, sdc, sdc_gamma, sdc_table, vmc, value_mean, selection, threshold_set
        As :func:`topth_ops.decode_attention` (paper sections 3.1-3.2; contract v0.2).
    stats : tuple of torch.Tensor, optional
        ``(kept [B, Hq] int32, v_rows [B, Hkv] int32, dropped_mass [B, Hq] float32)``,
        written (through their strides) when given.
    dense : bool
        Dense mode: every valid position kept, no threshold, SDC, VMC or stats (scaled
        dot-product attention over the n valid positions).
    config : LaunchConfig, optional
        Tile size / split count override (default :func:`choose_config`, split count
        refined from the compiled kernel's occupancy on a GPU).
    block_table : torch.Tensor, optional
        ``[B, max_blocks_per_seq]`` int32 (paged caches); ``kv_layout`` "NHD" or "HND".

    Returns
    -------
    torch.Tensor
        ``out``.

    Raises
    ------
    ValueError
        ``config.num_splits`` outside [1, 64], or a capacity beyond int32 positions.
    """
    layout = kv_layout if block_table is not None else "BNSD"
    B, Hq, D = query.shape
    num_blocks, Hkv, block_size, _ = cache_dims(key_cache, layout)
    max_blocks = block_table.shape[1] if block_table is not None else 1
    S = max_blocks * block_size
    if S > MAX_POSITIONS:
        raise ValueError(f"max_seq_len {S} exceeds the kernels' int32 positions ({MAX_POSITIONS})")
    G = Hq // Hkv
    dev = query.device
    G_PAD = group_pad(G)
    D_PAD = max(16, next_pow2(D))
    user_cfg = config is not None
    cfg = config or choose_config(B, Hkv, S, D, dev, group=G, elem_bytes=query.element_size(),
                                  placement="pre_softmax" if dense else placement)
    if not 1 <= cfg.num_splits <= MAX_SPLITS:
        raise ValueError(f"config.num_splits must be in [1, {MAX_SPLITS}], got {cfg.num_splits}")
    f32, i32 = torch.float32, torch.int32
    post = placement == "post_softmax" and not dense
    group = selection == "group" and not dense
    if dense:
        sdc, vmc, stats, threshold_set = "none", False, None, None
    compute_mean = bool(vmc and value_mean is None)
    has_sets = threshold_set is not None
    count = (not dense) and (not group) and (stats is not None or sdc == "exp_threshold")
    union = (not dense) and (stats is not None or group)
    on_gpu = dev.type == "cuda" and not interpreter_enabled()

    th = thresholds if thresholds is not None else seq_lens  # never read in dense mode
    th_strides = (0, *th.stride()) if th.dim() == 2 else tuple(th.stride())
    if th.dim() == 1:
        th_strides = (0, 0, 0)
    tab = sdc_table if sdc_table is not None else th
    tab_strides = (0, *tab.stride()) if tab.dim() == 2 else tuple(tab.stride())
    if tab.dim() == 1:
        tab_strides = (0, 0, 0)
    tset = threshold_set if has_sets else seq_lens
    bt = block_table if block_table is not None else seq_lens.view(-1, 1)
    num_sets = th.shape[0] if (th.dim() == 3 and not dense) else 1
    max_row_id = th.shape[-1]

    ks, vs = cache_strides(key_cache, layout), cache_strides(value_cache, layout)
    # block-table addressing (tiles.row_offsets): one entry per tile when a tile never
    # straddles two blocks, shift / mask for power-of-two blocks, else a division per row
    pow2 = block_size & (block_size - 1) == 0
    gather_paging = 0 if block_table is None else (2 if pow2 else 3)
    paging = 1 if (block_table is not None and block_size % cfg.block_n == 0) else gather_paging
    block_shift = block_size.bit_length() - 1 if pow2 else 0
    flags = dict(G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, EVEN_D=(D == D_PAD), BLOCK_N=cfg.block_n,
                 GROUP=group, PAGING=paging, HAS_SETS=has_sets, 
                 DOT_PREC="ieee" if query.dtype == f32 else "tf32",
                 NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def common_args(ns):
        return ((*query.stride(), *ks, *vs, seq_lens.stride(0), tset.stride(0), *bt.stride(), *th_strides,
                 Hkv, S, block_size, block_shift, num_blocks, max_row_id, num_sets, ns, float(scale)))

    def chunk_of(ns):
        return math.ceil(math.ceil(S / ns) / cfg.block_n) * cfg.block_n

    def partials(ns, probe=False):
        if probe:  # dtypes stand in for buffers: Triton's warmup compiles without them
            return dict(M=f32, L=f32, ACC=f32, R=f32, CNT=i32 if count else f32,
                        VROWS=i32 if (union or post) else f32, VSUM=f32, MK=f32)
        n_head = B * Hq * ns
        n_grp = B * Hkv * ns
        P = dict(M=torch.empty(n_head, dtype=f32, device=dev), L=torch.empty(n_head, dtype=f32, device=dev),
                 ACC=torch.empty((n_head, D_PAD), dtype=f32, device=dev))
        P["R"] = torch.empty(n_head, dtype=f32, device=dev) if not dense else P["L"]
        P["CNT"] = torch.empty(n_head, dtype=i32, device=dev) if count else P["M"]
        P["VROWS"] = torch.empty(n_grp, dtype=i32, device=dev) if union or post else P["M"]
        P["VSUM"] = torch.empty((n_grp, D_PAD), dtype=f32, device=dev) if compute_mean else P["M"]
        # pre_softmax, group selection: the splits' kept maxima (cuda_kernels/attn_pre.py)
        P["MK"] = torch.empty(n_head, dtype=f32, device=dev) if (group and not dense and not post) else P["M"]
        return P

    def pre_launch(ns, P, run=True):
        args = (query, key_cache, value_cache, seq_lens, th, tset, bt,
                P["M"], P["L"], P["R"], P["CNT"], P["ACC"], P["VROWS"], P["VSUM"], P["MK"], *common_args(ns))
        kw = dict(flags, DENSE=bool(dense), COUNT=count, UNION=union, COMPUTE_MEAN=compute_mean,
                  TILE_SKIP=bool(cfg.tile_skip) and not dense, V_EARLY=bool(dense or compute_mean))
        if run:
            pre_kernel[(B * Hkv, ns)](*args, **kw)
        return [(pre_kernel, args, kw)]

    def post_launch(ns, P, run=True):
        cap = cfg.post_capacity or post_capacity(chunk_of(ns), cfg.block_n)
        n_grp = B * Hkv * ns
        if run:
            c_pos = torch.empty(n_grp * cap, dtype=i32, device=dev)
            c_s = torch.empty(n_grp * cap * G, dtype=f32, device=dev)
            c_cnt = torch.empty(n_grp, dtype=i32, device=dev)
        else:
            c_pos, c_s, c_cnt = i32, f32, i32
        a1 = (query, key_cache, value_cache, seq_lens, th, tset, bt, P["M"], P["L"], P["VSUM"], c_pos, c_s, c_cnt,
              *common_args(ns), cap)
        # pass 1: at most 3 stages (4 make ptxas spill a few bytes around the compaction;
        # 5 CTAs/SM x 2 tiles in flight already cover the memory latency)
        st1 = min(3, cfg.num_stages)
        k1 = dict(flags, COMPUTE_MEAN=compute_mean, NUM_STAGES=st1, num_stages=st1)
        a2 = (query, key_cache, value_cache, seq_lens, th, tset, bt, P["M"], P["L"], P["R"], P["CNT"], P["ACC"],
              P["VROWS"], c_pos, c_s, c_cnt, *common_args(ns), cap)
        k2 = dict(flags, COUNT=count, UNION=union, GATHER_PAGING=gather_paging)
        if run:
            post_scores_kernel[(B * Hkv, ns)](*a1, **k1)
            post_select_kernel[(B * Hkv, ns)](*a2, **k2)
        return [(post_scores_kernel, a1, k1), (post_select_kernel, a2, k2)]

    launch = post_launch if post else pre_launch
    ns = int(cfg.num_splits)
    if on_gpu and not user_cfg:
        # split count from the compiled kernels' occupancy (compiled once per variant, cached)
        probe = launch(1, partials(1, probe=True), run=False)
        ctas = [_ctas_per_sm(k, a, kw, dev) for k, a, kw in probe]
        if all(c for c in ctas):
            ns = choose_num_splits(B, Hkv, S, cfg.block_n, _num_sms(dev), min(ctas))
    P = partials(ns)
    launch(ns, P)

    if stats is not None:
        st_kept, st_vrows, st_dropped = stats
    else:
        st_kept = st_vrows = st_dropped = P["M"].view(1, -1)
    vmean = value_mean if value_mean is not None else P["M"].view(1, 1, -1)
    combine_kernel[(B * Hkv,)](
        seq_lens, th, tset, tab, vmean, out, st_kept, st_vrows, st_dropped,
        P["M"], P["L"], P["R"], P["CNT"], P["ACC"], P["VROWS"], P["VSUM"], P["MK"],
        seq_lens.stride(0), tset.stride(0), *th_strides, *tab_strides,
        *vmean.stride(), *out.stride(), *st_kept.stride(), *st_dropped.stride(), *st_vrows.stride(),
        Hkv, S, max_row_id, num_sets, ns, float(sdc_gamma),
        G=G, G_PAD=G_PAD, D=D, D_PAD=D_PAD, POST=post, DENSE=bool(dense), SDC=int(Sdc.of(sdc)), VMC=bool(vmc),
        COMPUTE_MEAN=compute_mean, STATS=stats is not None, GROUP=group, HAS_SETS=has_sets,
        COUNT=count, UNION=union, num_warps=8 if G_PAD >= 64 else 4,
    )
    return out
