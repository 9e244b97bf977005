"""What mode ``calibrate`` plans and reads: the files it will write (checked against the
model before the engine loads) and the score rows it records, read from a paged K cache."""

from __future__ import annotations

import torch

from .. import packed
from ..cli import check_output_file
from ..contract import PLACEMENTS
from ..thresholds import attention_config_of, parse_layer_k
from ..thresholds.save import sets_file_path
from .settings import TopthConfigError, VllmTopthSettings


def paged_keys(key_cache: torch.Tensor, kv_layout: str, block_ids: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` K rows of one sequence, ``[num_kv_heads, n, head_dim]`` float32.

    Parameters
    ----------
    key_cache : torch.Tensor
        ``[num_blocks, num_kv_heads, block_size, head_dim]`` (``HND``, any strides, or
        ``VLLM_AMX``) or ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``NHD``).
    kv_layout : {"NHD", "HND", "VLLM_AMX"}
    block_ids : torch.Tensor
        The sequence's block table row (at least ``ceil(n / block_size)`` entries).
    n : int
    """
    bs = key_cache.shape[1] if kv_layout == "NHD" else key_cache.shape[2]
    blocks = key_cache[block_ids[:-(-n // bs)].long()]
    if kv_layout == "NHD":
        blocks = blocks.permute(0, 2, 1, 3)
    elif kv_layout == "VLLM_AMX":
        blocks = packed.unpack(blocks, "key")
    H, D = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(H, -1, D)[:, :n].float()


def row_scores(q: torch.Tensor, keys: torch.Tensor, row_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Logits ``[num_q_heads, R, n]`` of query rows ``q`` ``[R, num_q_heads, head_dim]``
    over ``keys`` ``[num_kv_heads, n, head_dim]`` (GQA: query head h reads KV head
    h // group), -inf at keys j >= the row's row id."""
    R, Hq, D = q.shape
    Hkv, n, _ = keys.shape
    G = Hq // Hkv
    qg = q.float().view(R, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, R * G, D)
    a = torch.bmm(qg, keys.transpose(1, 2)).mul_(scale)  # [Hkv, R * G, n]
    a = a.view(Hkv, R, G, n).permute(0, 2, 1, 3).reshape(Hq, R, n)
    invalid = torch.arange(n)[None, :] >= row_ids[:, None]
    return a.masked_fill_(invalid[None], float("-inf"))


def output_paths(template: str, ks: list, placements: list, selections: list) -> dict:
    """``{(k or None, placement, selection): path}`` of the files a calibration writes
    (``{k}`` in ``template``: one file per k)."""
    out = {}
    for k in (ks if "{k}" in template else [None]):
        for p in placements:
            for s in selections:
                out[(k, p, s)] = sets_file_path(template, k, p, len(placements) > 1, s, len(selections) > 1,
                                                flag="calibrate_out")
    return out


def check_calibration(settings: VllmTopthSettings, hf_config, tp_size: int) -> tuple:
    """The calibration a mode-``calibrate`` engine runs, checked against the model (engine
    start, and ``topth-ops serve --calibrate`` before the engine loads).

    Returns
    -------
    (ks, targets, placements, selections)
        The k list, a layer-k map per k, and the placements / selections to write.

    Raises
    ------
    TopthConfigError
        A layer-k map for another model, group selection with a TP size above the KV
        heads, a bad output template, or an output path that cannot be written.
    """
    cfg = attention_config_of(hf_config)
    ks = settings.calibrate_ks()
    try:
        targets = [list(parse_layer_k(settings.calibrate_layer_k, k, cfg["num_layers"])) for k in ks]
    except ValueError as e:
        raise TopthConfigError(f"topth vLLM backend: calibrate_layer_k: {e}") from None
    p, s = settings.calibrate_placement, settings.calibrate_selection
    placements = list(PLACEMENTS) if p == "both" else [p]
    selections = ["head", "group"] if s == "both" else [s]
    if "group" in selections and tp_size > cfg["num_kv_heads"]:
        raise TopthConfigError(f"topth vLLM backend: group-selection calibration needs whole GQA groups on a rank; "
                               f"tensor-parallel size {tp_size} exceeds the model's {cfg['num_kv_heads']} KV heads")
    try:
        for path in output_paths(settings.calibrate_out, ks, placements, selections).values():
            check_output_file(path, "calibrate_out")
    except ValueError as e:
        raise TopthConfigError(f"topth vLLM backend: {e}") from None
    return ks, targets, placements, selections
