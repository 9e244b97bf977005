"""The op contract in code: option names, the frozen inputs object, and input validation.

Every backend, the dispatcher, the conformance suite and the benchmarks share
:class:`DecodeInputs` and :func:`make_inputs`, so a bad input is rejected once, before
any backend is chosen or any kernel is launched. The semantics are written out in
``docs/semantics.md``; the checks make_inputs runs, and the option names, live in
:mod:`topth_ops.contract_checks` (built on :mod:`topth_ops.validation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import validation as V
from . import contract_checks as checks
from .contract_checks import DEFAULT_SDC_GAMMA, INPUT_DTYPES, PLACEMENTS, SDC_MODES, SELECTIONS, SEQ_LEN_DTYPES

# the option names are defined with their checks and belong to the contract's public names
__all__ = ["DEFAULT_SDC_GAMMA", "INPUT_DTYPES", "PLACEMENTS", "SDC_MODES", "SELECTIONS", "SEQ_LEN_DTYPES",
           "DecodeInputs", "DecodeStats", "make_inputs"]

_shape = V.shape_str


class DecodeStats(NamedTuple):
    """Per-head statistics of one decode step (``return_stats=True``).

    Attributes
    ----------
    kept : torch.Tensor
        ``[batch, num_q_heads]`` int32: k~, the number of kept positions of each head.
    v_rows : torch.Tensor
        ``[batch, num_kv_heads]`` int32: size of the union, over the query heads of the
        KV group, of the kept positions; the V rows a kernel must read (paper section 4.6).
    dropped_mass : torch.Tensor
        ``[batch, num_q_heads]`` float32: beta = 1 - sum of the kept weights, in [0, 1]
        (paper section 3.2.2).
    """

    kept: torch.Tensor
    v_rows: torch.Tensor
    dropped_mass: torch.Tensor


@dataclass(frozen=True)
class DecodeInputs:
    """One validated decode-attention call, shared by dispatch, backends, tests and benchmarks.

    Build it with :func:`make_inputs`, never directly: the constructor does not validate.

    Attributes
    ----------
    query : torch.Tensor
        ``[batch, num_q_heads, head_dim]``, float16 / bfloat16 / float32, RoPE applied.
    key_cache, value_cache : torch.Tensor
        Same dtype and device as ``query``; the current token is already appended. BNSD
        ``[batch, num_kv_heads, max_seq_len, head_dim]`` without a block table; paged
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD) or ``[num_blocks,
        num_kv_heads, block_size, head_dim]`` (HND) with one.
    seq_lens : torch.Tensor
        ``[batch]`` int32 or int64: n_b, the number of valid positions (row id).
    thresholds : torch.Tensor
        float32 ``[H, max_row_id]`` or ``[num_sets, H, max_row_id]``, H = num_q_heads
        (``selection="head"``) or num_kv_heads (``"group"``); row id n reads column
        ``min(n, max_row_id) - 1``.
    scale : float
        Resolved softmax scale (``1/sqrt(head_dim)`` when the caller passed None).
    placement, sdc : str
        One of :data:`PLACEMENTS` and :data:`SDC_MODES`.
    sdc_gamma : float
        gamma of the exp_threshold estimate (paper section 3.2.1).
    sdc_table : torch.Tensor or None
        float32 ``[num_q_heads, max_row_id]`` (``[num_sets, num_q_heads, max_row_id]``
        with threshold sets), only with ``sdc="offline"``.
    vmc : bool
        V-mean compensation (paper section 3.2.2).
    value_mean : torch.Tensor or None
        ``[batch, num_kv_heads, head_dim]`` float32, only with ``vmc=True``.
    return_stats : bool
        Whether the caller asked for :class:`DecodeStats`.
    block_table : torch.Tensor or None
        ``[batch, max_blocks_per_seq]`` int32: position j of sequence b is slot
        ``j % block_size`` of block ``block_table[b, j // block_size]``.
    kv_layout : str
        ``"BNSD"`` (no block table), ``"NHD"`` or ``"HND"`` (paged).
    selection : str
        ``"head"`` or ``"group"`` (one threshold per KV head against the group maximum).
    threshold_set : torch.Tensor or None
        ``[batch]`` int32/int64 index into dim 0 of 3-D thresholds.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    seq_lens: torch.Tensor
    thresholds: torch.Tensor
    scale: float
    placement: str = "post_softmax"
    sdc: str = "none"
    sdc_gamma: float = DEFAULT_SDC_GAMMA
    sdc_table: Optional[torch.Tensor] = None
    vmc: bool = False
    value_mean: Optional[torch.Tensor] = None
    return_stats: bool = False
    block_table: Optional[torch.Tensor] = None
    kv_layout: str = "BNSD"
    selection: str = "head"
    threshold_set: Optional[torch.Tensor] = None

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return V.cache_dims(self.key_cache, self.kv_layout)[1]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio); query head h reads KV head h // group_size."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.query.shape[2]

    @property
    def paged(self) -> bool:
        """True when the caches are paged (a block table was given)."""
        return self.block_table is not None

    @property
    def block_size(self) -> int:
        """Positions per cache block (BNSD: max_seq_len, one block per sequence)."""
        return V.cache_dims(self.key_cache, self.kv_layout)[2]

    @property
    def num_blocks(self) -> int:
        """Cache blocks (BNSD: batch)."""
        return self.key_cache.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_table.shape[1] if self.paged else 1

    @property
    def max_seq_len(self) -> int:
        """Positions a sequence can hold: BNSD dim 2, or max_blocks_per_seq * block_size."""
        return self.max_blocks_per_seq * self.block_size

    @property
    def max_row_id(self) -> int:
        return self.thresholds.shape[-1]

    @property
    def num_sets(self) -> int:
        """Threshold sets (1 for 2-D thresholds)."""
        return self.thresholds.shape[0] if self.thresholds.dim() == 3 else 1

    @property
    def threshold_heads(self) -> int:
        """Rows of one threshold set: num_q_heads ("head") or num_kv_heads ("group")."""
        return self.num_q_heads if self.selection == "head" else self.num_kv_heads

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def device(self) -> torch.device:
        return self.query.device

    def cache_strides(self, which: str = "key") -> tuple[int, int, int, int]:
        """Element strides ``(block, kv_head, slot, dim)`` of the key or value cache (see
        :func:`topth_ops.validation.cache_strides`)."""
        t = self.key_cache if which == "key" else self.value_cache
        return V.cache_strides(t, self.kv_layout)

    def clamped_lengths(self, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """``[batch]`` lengths clamped into ``[0, max_seq_len]`` in their own dtype's full range
        first, then cast to ``dtype``: the contract's rule for paths that do not check values
        (an int64 of 1 << 40 becomes max_seq_len, never a wrapped int32)."""
        return self.seq_lens.clamp(0, self.max_seq_len).to(dtype)

    def block_table_or_identity(self) -> torch.Tensor:
        """int32 ``[batch, max_blocks_per_seq]``: the block table, or for BNSD the identity
        ``[[0], [1], ...]`` that makes the BNSD cache one HND block per sequence."""
        if self.paged:
            return self.block_table
        return torch.arange(self.batch, dtype=torch.int32, device=self.device).view(self.batch, 1)

    def thresholds_3d(self) -> torch.Tensor:
        """``[num_sets, threshold_heads, max_row_id]`` (a view; 2-D thresholds are one set)."""
        th = self.thresholds
        return th if th.dim() == 3 else th.unsqueeze(0)

    def sdc_table_3d(self) -> Optional[torch.Tensor]:
        """``[num_sets, num_q_heads, max_row_id]`` view of sdc_table, or None."""
        t = self.sdc_table
        if t is None:
            return None
        return t if t.dim() == 3 else t.unsqueeze(0)

    def describe(self) -> str:
        """One line naming every shape, dtype, device and option; used in error messages."""
        parts = [
            f"query {_shape(self.query)} {V.dtype_str(self.dtype)} on {self.device}",
            f"key/value cache {_shape(self.key_cache)} {self.kv_layout}",
            f"seq_lens {_shape(self.seq_lens)} {V.dtype_str(self.seq_lens.dtype)}",
            f"thresholds {_shape(self.thresholds)}",
            f"placement={self.placement}",
            f"sdc={self.sdc}",
            f"vmc={self.vmc}",
        ]
        if self.paged:
            parts.append(f"block_table {_shape(self.block_table)}")
        if self.selection != "head":
            parts.append(f"selection={self.selection}")
        if self.threshold_set is not None:
            parts.append(f"threshold_set {_shape(self.threshold_set)}")
        if self.value_mean is not None:
            parts.append("value_mean given")
        return "; ".join(parts)

    def empty_outputs(self, fill: Optional[float] = None) -> tuple[torch.Tensor, Optional[DecodeStats]]:
        """Allocate the output ``[batch, num_q_heads, head_dim]`` and, if asked, the stats.

        Parameters
        ----------
        fill : float, optional
            Value to fill every buffer with (the conformance suite poisons with NaN; the
            integer stats get -1). None leaves them uninitialised.
        """
        dev = self.device
        out = torch.empty(self.query.shape, dtype=self.dtype, device=dev)
        stats = None
        if self.return_stats:
            stats = DecodeStats(
                kept=torch.empty((self.batch, self.num_q_heads), dtype=torch.int32, device=dev),
                v_rows=torch.empty((self.batch, self.num_kv_heads), dtype=torch.int32, device=dev),
                dropped_mass=torch.empty((self.batch, self.num_q_heads), dtype=torch.float32, device=dev),
            )
        if fill is not None:
            out.fill_(fill)
            if stats is not None:
                stats.kept.fill_(-1)
                stats.v_rows.fill_(-1)
                stats.dropped_mass.fill_(fill)
        return out, stats


def make_inputs(
    query,
    key_cache,
    value_cache,
    seq_lens,
    thresholds,
    *,
    scale=None,
    placement="post_softmax",
    sdc="none",
    sdc_gamma=DEFAULT_SDC_GAMMA,
    sdc_table=None,
    vmc=False,
    value_mean=None,
    return_stats=False,
    block_table=None,
    kv_layout=None,
    selection="head",
    threshold_set=None,
    check_values=True,
) -> DecodeInputs:
    """Validate one decode-attention call and return the frozen :class:`DecodeInputs`.

    Arguments are those of :func:`topth_ops.decode_attention` (see there and
    ``docs/semantics.md``). Nothing here launches a kernel or copies a tensor.

    Parameters
    ----------
    check_values : bool
        Also check the values of ``seq_lens`` (0 <= n <= max_seq_len), of the used
        ``block_table`` entries (in [0, num_blocks)), of ``threshold_set`` (in
        [0, num_sets)) and of ``sdc_table`` (finite, >= 0). Done only where it needs no
        device sync (CPU tensors outside a trace); elsewhere a backend clamps lengths,
        set indices and block ids into range so that it never reads out of bounds.

    Returns
    -------
    DecodeInputs

    Raises
    ------
    TypeError
        A tensor argument is not a tensor, or has the wrong dtype (query not float16 /
        bfloat16 / float32, caches not of the query's dtype, seq_lens / threshold_set not
        int32/int64, block_table not int32, thresholds / sdc_table / value_mean not
        float32); a flag is not a bool; a number is not a real number.
    ValueError
        Wrong rank or shape (caches against ``kv_layout``), head_dim mismatch,
        num_q_heads not a multiple of num_kv_heads, tensors on different devices, values
        out of range (see ``check_values``), unknown placement / sdc / selection /
        kv_layout, a paged layout without block_table or BNSD with one, sdc other than
        "none" with post_softmax, "offline" without sdc_table, sdc_table without
        "offline", value_mean without vmc, threshold_set without 3-D thresholds or the
        reverse, sdc_gamma other than its default without "exp_threshold", scale not
        finite and > 0, sdc_gamma not finite and >= 0.
    """
    q, k, v, lens, th, layout, selection = checks.check_tensors(
        query, key_cache, value_cache, seq_lens, thresholds, sdc_table, value_mean, block_table, threshold_set,
        kv_layout, selection)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size, max_seq_len = checks.check_layout(q, k, v, lens, block_table, layout)
    sdc_gamma = checks.check_thresholds_and_sets(th, sdc_table, threshold_set, placement, sdc, sdc_gamma, selection,
                                                  num_q_heads, num_kv_heads, batch)
    vmc, return_stats, scale = checks.check_options(vmc, return_stats, value_mean, scale, batch, num_kv_heads, head_dim)
    if check_values:
        checks.check_values(lens, block_table, threshold_set, sdc_table, th, max_seq_len, block_size, k.shape[0])

    return DecodeInputs(
        query=q, key_cache=k, value_cache=v, seq_lens=lens, thresholds=th, scale=scale,
        placement=placement, sdc=sdc, sdc_gamma=sdc_gamma, sdc_table=sdc_table, vmc=vmc,
        value_mean=value_mean, return_stats=return_stats, block_table=block_table,
        kv_layout=layout, selection=selection, threshold_set=threshold_set,
    )
