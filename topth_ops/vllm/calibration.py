"""Threshold calibration inside the vLLM engine (mode ``calibrate``; paper section 3.1).

The engine serves every row through the platform's own attention, so answers are those of
dense serving (a second round, with a served file: every row of its thresholded layers
through the op with that file, :meth:`topth_ops.vllm.split.SplitImpl._second_round`),
while this module records the rows the engine computes in the bounded-memory
kept-count accumulator of offline calibration
(:class:`topth_ops.calibration.CountAccumulator`), for every requested k, placement and
selection at once:

- decode rows (row id n = the request's length after the step) and, with
  ``calibrate_prefill``, prompt rows of prefill and chunked prefill (row id = position + 1),
  which give every row id of a prompt;
- rows are thinned exactly as offline (:meth:`CountAccumulator.row_stride`: every row up
  to 128 row ids, then 128 per octave and sequence), so the same token sequences give the
  same rows as ``topth-ops calibrate``; only the recorded rows' scores are computed:
  ``q . K^T * scale`` in float32 from the request's K rows in the paged cache.

The threshold file (today's format, one file per placement and selection as ``topth-ops
calibrate --out``) is written when ``calibrate_requests`` requests have finished, on
SIGUSR1 (a snapshot; recording goes on), or when the engine shuts down; it records its
source (served traffic: requests, tokens, rows, row ids covered), and the length model
continues the table beyond the longest row seen. Pre-softmax files carry no offline SDC
table (that needs a second pass at the final thresholds).

Tensor parallelism: each rank records its own query (and KV) heads; each rank writes its
part next to the output, and rank 0 merges the parts (heads in rank order) into whole
files that load at any TP size. Group selection needs whole GQA groups on a rank.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from typing import Optional

import torch

from ..calibration import CountAccumulator
from ..prefill import MAX_CHUNK_ELEMS
from ..thresholds import DENSE, ThresholdSet, attention_config_of, format_layer_k
from . import requests as requests_mod
from .calib_files import CalibrationFiles
from .calib_plan import check_calibration, output_paths, paged_keys, row_scores
from .settings import VllmTopthSettings

logger = logging.getLogger("vllm.topth_ops")

#: Score rows computed at once are capped at this many float32 values (bounded memory).
CHUNK_VALUES = 1 << 24
#: Seconds without a forward (at least; and twice the last step) after which the engine is idle:
#: every request of the last batch has finished, and writes happen from the trigger thread.
IDLE_S = 5.0


class EngineCalibration(CalibrationFiles):
    """Records served rows and writes threshold files (module docstring).

    Parameters
    ----------
    settings : VllmTopthSettings
        Mode ``calibrate``.
    hf_config : transformers config
        The served model's config.
    model_name : str or None
        Recorded in the files.
    tp_rank, tp_size : int
    max_model_len : int
        The engine's longest row (sizes the accumulator).
    served : ThresholdSet, optional
        A second round: the set every row of its thresholded layers is served with
        (prompt rows too); its own target is recorded.

    Raises
    ------
    TopthConfigError
        An output path that cannot be written, a template without ``{placement}`` /
        ``{selection}`` where both are written, a layer-k map for another model, or group
        selection with a TP size above the KV heads.
    """

    def __init__(self, settings: VllmTopthSettings, hf_config, model_name: Optional[str], tp_rank: int,
                 tp_size: int, max_model_len: int, served: Optional[ThresholdSet] = None):
        cfg = attention_config_of(hf_config)
        self.served = served
        # a second round: the compensation its rows ran with, recorded in the file (ThresholdSet.check_rule)
        self.rule = None if served is None else {"sdc": settings.sdc, "vmc": bool(settings.vmc)}
        self.cfg, self.model_name, self.rank, self.tp = cfg, model_name, tp_rank, tp_size
        L, Hq, Hkv = cfg["num_layers"], cfg["num_q_heads"], cfg["num_kv_heads"]
        self.template = settings.calibrate_out
        self.ks, self.targets, self.placements, self.selections = check_calibration(settings, hf_config, tp_size, served)
        self.context = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        self.prefill = settings.calibrate_prefill
        self.requests_target = settings.calibrate_requests
        ks = sorted({k for t in self.targets for k in t if k != DENSE})
        self.acc = CountAccumulator(L, Hq // tp_size, max(1, Hkv // tp_size), int(max_model_len), ks,
                                    self.placements, self.selections)
        self.lock = threading.RLock()
        self.platform_layers: dict = {}
        self.tokens = self.steps = self.prompts = self.prefill_rows = self.decode_rows = self.max_row = 0
        self.seconds = {"prefill": 0.0, "decode": 0.0}  # spent recording, by kind of row
        self._first_layer: Optional[int] = None
        self.generation = 0
        self.done = self._stopping = self._in_forward = False
        self._pending: Optional[tuple] = None  # (reason, final) of a write due at the next step boundary
        self._warned_empty = False  # the "no rows yet" warning is logged once
        self._plock = threading.Lock()
        self._step_start: Optional[float] = None
        self._step_s = 0.0
        self._warned_dense: set = set()
        self._last_forward = time.monotonic()
        self._signal = threading.Event()
        if tp_size > 1 and os.path.exists(self._part_path(tp_rank)):
            os.unlink(self._part_path(tp_rank))  # a part left by an earlier run that was killed
        never = sorted({k for t in self.targets for k in t if k != DENSE and k >= max_model_len})
        if never:
            logger.warning("topth: calibration: k=%s reach the engine's max_model_len %d; no row is longer, so layers "
                           "at those k will be dense in the file", never, max_model_len)
        nbytes = sum(h.numel() * 8 for h in self.acc.hist.values()) + self.acc.rows_per_id.numel() * 8
        how = ("every row served by vLLM's own attention" if served is None else
               f"second round: every row of the thresholded layers through the op with {served.name()}")
        logger.info("topth: calibrating from served traffic (%s): k=%s, %s, "
                    "%s selection, k per layer %s, prefill rows %s; writing %s %s; accumulators %.1f MB (rank %d of %d); "
                    "`kill -USR1 %d` writes a snapshot", how, self.ks, "/".join(self.placements), "/".join(self.selections),
                    "; ".join(format_layer_k(t) for t in self.targets),
                    "on" if self.prefill else "off", ", ".join(self.paths().values()),
                    f"after {self.requests_target} requests" if self.requests_target else "at shutdown",
                    nbytes / 1e6, tp_rank, tp_size, os.getpid())

    # ------------------------------------------------------------------ recording

    def paths(self) -> dict:
        """``{(k or None, placement, selection): path}`` of the files to write."""
        return output_paths(self.template, self.ks, self.placements, self.selections)

    def platform_layer(self, layer: int, reason: str) -> None:
        """Layer ``layer`` is served by the platform in every row (sliding window, ...): it is
        not recorded and stays dense in the files."""
        if layer not in self.platform_layers:
            self.platform_layers[layer] = reason
            for t in self.targets:
                t[layer] = DENSE
            logger.info("topth: calibration keeps layer %d dense (served by vLLM's own attention: %s)", layer, reason)

    def observe(self, layer: int, query: torch.Tensor, key_cache: torch.Tensor, kv_layout: str,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                num_decodes: int, scale: float) -> None:
        """Record the rows of one layer's forward.

        Parameters
        ----------
        layer : int
        query : torch.Tensor
            ``[num_tokens, num_q_heads (this rank), head_dim]``.
        key_cache : torch.Tensor
            The layer's paged K cache in ``kv_layout`` (the step's tokens written).
        query_start_loc : torch.Tensor
            ``[num_reqs + 1]`` token offsets of the requests.
        seq_lens : torch.Tensor
            ``[num_reqs]`` lengths after the step.
        block_table : torch.Tensor
            ``[num_reqs, width]``.
        num_decodes : int
            Requests ``[0, num_decodes)`` are decode rows; the others prompt rows.
        """
        if self.done:
            return
        qsl = query_start_loc.tolist()
        lens = seq_lens.tolist()
        first = self._first_layer is None or layer <= self._first_layer
        if first and self._step_boundary():
            return
        with self.lock:
            self._in_forward = True
            if first:
                self._first_layer = layer
                self.steps += 1
                self.tokens += qsl[len(lens)] - qsl[0]
                self.prompts += sum(1 for i, n in enumerate(lens[num_decodes:], num_decodes)
                                    if n > 1 and n == qsl[i + 1] - qsl[i])  # a prompt's first chunk
            for i, n in enumerate(lens):
                T = qsl[i + 1] - qsl[i]
                decode = i < num_decodes
                if T <= 0 or n <= 0 or not (decode or self.prefill):
                    continue
                rows = torch.arange(n - T + 1, n + 1)
                keep = (rows > self.acc.min_k) & (rows % self.acc.row_stride(rows) == 0)
                if not bool(keep.any()):
                    continue
                t0 = time.perf_counter()
                ids = rows[keep]
                q = query[qsl[i]:qsl[i + 1]][keep]
                keys = paged_keys(key_cache, kv_layout, block_table[i], n)
                # the row chunks of the offline pass over a sequence of n tokens (a layer's
                # histogram range comes from its first chunk: the same rows give the same range)
                chunk = (ids - 1) // max(1, MAX_CHUNK_ELEMS // (self.cfg["num_q_heads"] * n))
                step = max(1, CHUNK_VALUES // (q.shape[1] * n))
                for c0 in range(0, ids.numel(), step):
                    c1 = min(ids.numel(), c0 + step)
                    while c0 < c1:
                        e = c0 + int((chunk[c0:c1] == chunk[c0]).sum())
                        # keys past the chunk's last row id are invalid for all of its rows
                        a = row_scores(q[c0:e], keys[:, :int(ids[e - 1])], ids[c0:e], scale)
                        self.acc.record(layer, a[None], ids[None, c0:e])
                        c0 = e
                self.seconds["decode" if decode else "prefill"] += time.perf_counter() - t0
                if first:
                    self.max_row = max(self.max_row, n)
                    if decode:
                        self.decode_rows += int(ids.numel())
                    else:
                        self.prefill_rows += int(ids.numel())
            self._in_forward = False
            self._last_forward = time.monotonic()

    def _step_boundary(self) -> bool:
        """The first layer of a step: time the last step, count finished requests and make
        a write that is due (every rank is at the same step here). True once done."""
        now = time.monotonic()
        if self._step_start is not None:
            self._step_s = now - self._step_start
        self._step_start = now
        self._check_count(stepping=True)
        due = self._take_pending()
        if due is not None:
            self.write(*due)
        return self.done

    # ------------------------------------------------------------------ triggers

    def start_triggers(self) -> None:
        """The write triggers: shutdown (atexit), SIGUSR1 (where this thread may install a
        handler) and the request count. Writes happen at a step boundary (the first layer's
        forward) while the engine steps, and from a daemon thread once it is idle."""
        atexit.register(self.at_exit)
        try:
            signal.signal(signal.SIGUSR1, lambda *_: self._signal.set())
        except ValueError:  # not the main thread
            logger.warning("topth: calibration cannot install its SIGUSR1 handler here (not the main thread); the "
                           "file is written at shutdown%s", " or after the request count" if self.requests_target else "")
        threading.Thread(target=self._loop, name="topth-calibrate", daemon=True).start()

    def idle(self) -> bool:
        """No forward for a while: longer than IDLE_S and than twice the last step (a long
        prefill step leaves gaps of seconds between layers)."""
        quiet = time.monotonic() - self._last_forward
        return not self._in_forward and quiet >= max(IDLE_S, 2.0 * self._step_s)

    def finished_requests(self, stepping: bool = False) -> int:
        """Requests that entered the batch and left it (all of them once the engine is idle
        or stopping: the last batch's requests have finished then; ``stepping``: called at a
        step boundary, so the engine is not idle)."""
        added, size = requests_mod.batch_counts()
        return added if (self._stopping or (not stepping and self.idle())) else added - size

    def _check_count(self, stepping: bool = False) -> None:
        if (self.requests_target and self._pending is None and not self.done
                and self.finished_requests(stepping) >= self.requests_target):
            self._due((f"{self.requests_target} requests finished", True))

    def _due(self, write: tuple) -> None:
        with self._plock:
            if self._pending is None or write[1]:
                self._pending = write

    def _take_pending(self) -> Optional[tuple]:
        with self._plock:
            due, self._pending = self._pending, None
            return due

    def at_exit(self) -> None:
        """The shutdown trigger: the last write (every request has finished)."""
        self._stopping = True
        self.write("engine shutdown", final=True)

    def _loop(self) -> None:
        while not self.done:
            if self._signal.wait(1.0):
                self._signal.clear()
                if self.done:
                    logger.warning("topth: calibration already wrote its final file; SIGUSR1 ignored")
                else:
                    self._due(("SIGUSR1", False))
            if self.idle():  # no step boundary coming: write from here
                self._check_count()
                due = self._take_pending()
                if due is not None:
                    self.write(*due)

    def report(self) -> dict:
        """The calibration's counters (the JSON report's ``calibration`` section)."""
        return {"prompts": self.prompts, "requests_finished": self.finished_requests(), "tokens": self.tokens,
                "steps": self.steps, "prompt_rows_per_layer": self.prefill_rows,
                "decode_rows_per_layer": self.decode_rows, "longest_row": self.max_row,
                "record_seconds": dict(self.seconds), "files_written": self.generation, "done": self.done}
