"""The ``topth::decode_attention`` custom op (torch.library) and the direct call path.

Two ways in, each validating once:

- the public op ``torch.ops.topth.decode_attention`` takes plain tensors and scalars,
  validates them with :func:`topth_ops.contract.make_inputs`, picks a backend and runs it.
  Its fake (meta) implementation validates shapes and allocates outputs, so the op traces
  under ``torch.compile`` and passes ``torch.library.opcheck``;
- :func:`run` takes :class:`~topth_ops.contract.DecodeInputs` that its caller has already
  validated and trusts them: :func:`topth_ops.decode_attention` validates its arguments
  (so that the messages are ours) and calls it in eager mode, and the op's implementation
  calls it after its own validation.

The op is inference-only: it has no autograd formula.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .contract import DecodeInputs, DecodeStats, make_inputs
from .registry import select_backend

OP_NAME = "topth::decode_attention"


def run(inputs: DecodeInputs, backend: Optional[str] = None) -> tuple[Tensor, Optional[DecodeStats]]:
    """Direct call path: select a backend and run it on inputs the caller has validated,
    without the custom-op dispatcher.

    Parameters
    ----------
    inputs : DecodeInputs
        From :func:`topth_ops.contract.make_inputs`.
    backend : str, optional
        Explicit backend name (else ``TOPTH_BACKEND``, else automatic).

    Returns
    -------
    out : Tensor
        ``[batch, num_q_heads, head_dim]``, input dtype.
    stats : DecodeStats or None
        Only when ``inputs.return_stats``.

    Raises
    ------
    ValueError, NotImplementedError
        As :func:`topth_ops.registry.select_backend`.
    """
    b = select_backend(inputs, backend)
    out, stats = inputs.empty_outputs()
    b.forward(inputs, out, stats)
    return out, stats


def _no_stats(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    return (
        torch.empty(0, dtype=torch.int32, device=device),
        torch.empty(0, dtype=torch.int32, device=device),
        torch.empty(0, dtype=torch.float32, device=device),
    )


@torch.library.custom_op(OP_NAME, mutates_args=())
def decode_attention_op(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    seq_lens: Tensor,
    thresholds: Tensor,
    scale: Optional[float],
    placement: str,
    sdc: str,
    sdc_gamma: float,
    sdc_table: Optional[Tensor],
    vmc: bool,
    value_mean: Optional[Tensor],
    return_stats: bool,
    backend: str,
    block_table: Optional[Tensor] = None,
    kv_layout: str = "",
    selection: str = "head",
    threshold_set: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Custom-op form of :func:`topth_ops.decode_attention`; ``backend=""`` means automatic.

    Returns ``(out, kept, v_rows, dropped_mass)``; the three stats tensors are empty
    (shape ``[0]``) when ``return_stats`` is False.
    """
    inputs = make_inputs(
        query, key_cache, value_cache, seq_lens, thresholds, scale=scale, placement=placement,
        sdc=sdc, sdc_gamma=sdc_gamma, sdc_table=sdc_table, vmc=vmc, value_mean=value_mean,
        return_stats=return_stats, block_table=block_table, kv_layout=kv_layout or None,
        selection=selection, threshold_set=threshold_set,
    )
    return _flat(*run(inputs, backend or None))


def _flat(out: Tensor, stats: Optional[DecodeStats]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's return value: the output and the three stats (empty when not asked for)."""
    if stats is None:
        return (out, *_no_stats(out.device))
    return (out, *stats)


@decode_attention_op.register_fake
def _decode_attention_fake(
    query, key_cache, value_cache, seq_lens, thresholds, scale, placement, sdc, sdc_gamma,
    sdc_table, vmc, value_mean, return_stats, backend, block_table=None, kv_layout="",
    selection="head", threshold_set=None,
):
    inputs = make_inputs(
        query, key_cache, value_cache, seq_lens, thresholds, scale=scale, placement=placement,
        sdc=sdc, sdc_gamma=sdc_gamma, sdc_table=sdc_table, vmc=vmc, value_mean=value_mean,
        return_stats=return_stats, block_table=block_table, kv_layout=kv_layout or None,
        selection=selection, threshold_set=threshold_set, check_values=False,
    )
    return _flat(*inputs.empty_outputs())
