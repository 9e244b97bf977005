"""What mode ``calibrate`` plans and reads: the files it will write (checked against the
model before the engine loads) and the score rows it records, read from a paged K cache."""

from __future__ import annotations

import torch

from .. import packed
from ..cli import check_output_file
from ..contract import PLACEMENTS
from ..thresholds import DEFAULT_LAYER_K, attention_config_of, format_layer_k, parse_layer_k
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


def token_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query token of a batch as one decode row of the op (a second calibration
    round serves prompt rows this way).

    Parameters
    ----------
    query_start_loc : torch.Tensor
        ``[num_reqs + 1]`` token offsets of the requests (0 first).
    seq_lens : torch.Tensor
        ``[num_reqs]`` lengths after the step.
    block_table : torch.Tensor
        ``[num_reqs, width]``.

    Returns
    -------
    row_ids : torch.Tensor
        ``[num_tokens]`` int32: the keys each token attends to (its position + 1).
    block_table : torch.Tensor
        ``[num_tokens, width]`` int32: its request's block-table row.

    Raises
    ------
    ValueError
        A request with more query tokens than its length.
    """
    qsl = query_start_loc.to(torch.int64)
    ql = qsl[1:] - qsl[:-1]
    n = seq_lens.to(torch.int64)
    if bool((ql > n).any()):
        raise ValueError(f"query_start_loc gives a request more query tokens than its seq_lens: {ql.tolist()} vs "
                         f"{n.tolist()}")
    req = torch.repeat_interleave(torch.arange(ql.numel()), ql)
    tok = torch.arange(req.numel())
    rows = n[req] - ql[req] + (tok - qsl[:-1][req]) + 1
    return rows.to(torch.int32), block_table[req].to(torch.int32)


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


def check_calibration(settings: VllmTopthSettings, hf_config, tp_size: int, served=None) -> tuple:
    """The calibration a mode-``calibrate`` engine runs, checked against the model (engine
    start, and ``topth-ops serve --calibrate`` before the engine loads).

    ``served`` (ThresholdSet): a second round serving that set; its target (layer-k map,
    placement, selection) is the one recorded, and a k, layer-k map, placement or
    selection given that differs from it is refused.

    Returns
    -------
    (ks, targets, placements, selections)
        The k list, a layer-k map per k, and the placements / selections to write.

    Raises
    ------
    TopthConfigError
        A layer-k map for another model, group selection with a TP size above the KV
        heads, a bad output template, an output path that cannot be written, or a
        second round told to record another target than its served set's.
    """
    cfg = attention_config_of(hf_config)
    ks = settings.calibrate_ks() if settings.calibrate_k or served is None else [served.k]
    if served is not None and not settings.calibrate_k and settings.calibrate_layer_k is None:
        targets = [list(served.layer_k)]  # the served set's own layer-k map
    else:
        spec = DEFAULT_LAYER_K if settings.calibrate_layer_k is None else settings.calibrate_layer_k
        try:
            targets = [list(parse_layer_k(spec, k, cfg["num_layers"])) for k in ks]
        except ValueError as e:
            raise TopthConfigError(f"topth vLLM backend: calibrate_layer_k: {e}") from None
    p = settings.calibrate_placement or (served.placement if served is not None else "post_softmax")
    s = settings.calibrate_selection or (served.selection if served is not None else "head")
    placements = list(PLACEMENTS) if p == "both" else [p]
    selections = ["head", "group"] if s == "both" else [s]
    if served is not None:
        _check_second_round_target(served, targets, placements, selections)
    if "group" in selections and tp_size > cfg["num_kv_heads"]:
        raise TopthConfigError(f"topth vLLM backend: group-selection calibration needs whole GQA groups on a rank; "
                               f"tensor-parallel size {tp_size} exceeds the model's {cfg['num_kv_heads']} KV heads")
    try:
        for path in output_paths(settings.calibrate_out, ks, placements, selections).values():
            check_output_file(path, "calibrate_out")
    except ValueError as e:
        raise TopthConfigError(f"topth vLLM backend: {e}") from None
    return ks, targets, placements, selections


def _check_second_round_target(served, targets: list, placements: list, selections: list) -> None:
    """A second round records its served set's own target: name each setting that asks for another."""
    asked = {"k per layer (calibrate_k / calibrate_layer_k; --k / --layer-k)":
             ("; ".join(format_layer_k(t) for t in targets), format_layer_k(served.layer_k),
              targets == [list(served.layer_k)]),
             "placement (calibrate_placement; --placement)": ("/".join(placements), served.placement,
                                                              placements == [served.placement]),
             "selection (calibrate_selection; --selection)": ("/".join(selections), served.selection,
                                                              selections == [served.selection])}
    wrong = [f"{name}: asked {got}, the set's {want}" for name, (got, want, ok) in asked.items() if not ok]
    if wrong:
        raise TopthConfigError(
            f"topth vLLM backend: a second calibration round records the target of the set it serves "
            f"({served.name()}), since the activations it records depend on that set; " + "; ".join(wrong) +
            " (leave these settings unset in a second round)")
