"""Per-step statistics of the vLLM backend: V rows read by Top-Theta decode vs dense.

One :class:`ServingStats` per worker process (one per tensor-parallel rank) sums, for
every decode step (one model forward that had decode tokens), the V rows the op read
(``DecodeStats.v_rows``: per sequence and KV head, the union of the rows kept by the
group's query heads) and the rows dense attention reads (``seq_len`` per sequence and KV
head), over all layers. Prefill tokens are dense and counted apart. With statistics
sampling (settings ``metrics_every``) the V rows cover the measured steps; the others are
counted as steps and tokens only (:meth:`ServingStats.skip_step`).

The counts stay on the device between log lines (no sync per layer). Every
``log_interval`` seconds one INFO line goes to the ``topth_ops.vllm`` logger, and the
JSON report (``stats_file``) is rewritten atomically; it is also written at process exit.
With tensor parallelism each rank reports the rows of its own KV heads.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger("vllm.topth_ops")

REPORT_FORMAT = "topth-vllm-stats"
STEP_HISTORY = 4096
#: Closed steps whose per-step sums are reduced together (bounds the tensors kept).
REDUCE_STEPS = 32


def rank_path(path: str, rank: int) -> str:
    """``path`` for rank 0, ``<stem>.rank<r><suffix>`` for rank r > 0."""
    if rank == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


class ServingStats:
    """Accumulates V-row counts of one process.

    Parameters
    ----------
    mode : str
        "topth" or "dense" (recorded in the report).
    stats_file : str, optional
        JSON report path (already rank-specific).
    log_interval : float
        Seconds between log lines / report writes; 0: log never, write the report only
        at exit and on :meth:`flush`.
    meta : dict, optional
        Extra fields of the report (model, threshold file, TP rank, ...).
    """

    def __init__(self, mode: str, stats_file: Optional[str] = None, log_interval: float = 10.0,
                 meta: Optional[dict] = None):
        self.mode = mode
        self.stats_file = stats_file
        self.log_interval = float(log_interval)
        self.meta = dict(meta or {})
        self.sections: dict = {}  # report key -> callable giving its value (e.g. "per_set")
        self.idle_hooks: list = []  # called by the statistics thread every period (e.g. a flush when idle)
        self._lock = threading.Lock()
        self._raw: list = []  # (step, seqs, rows) of closed steps not yet reduced
        self._pending: list = []  # ([step], [seqs], read [n], dense [n]) reduced, not yet on the host
        self._step_rows: list = []  # (v_rows, seq_lens, num_kv_heads) of the step in progress
        self._step = 0
        self._last_layer = None
        self._step_has_decode = False
        self._step_has_prefill = False
        self.decode_steps = 0  # measured steps (their V rows are summed)
        self.unmeasured_steps = 0  # decode steps whose statistics were not sampled (metrics_every)
        self.decode_tokens = 0
        self.prefill_tokens = 0
        self.v_rows_read = 0
        self.v_rows_dense = 0
        self.layers_seen: set[int] = set()
        self.history: deque = deque(maxlen=STEP_HISTORY)
        self._last_flush = time.monotonic()
        self._logged_read = 0
        self._logged_dense = 0
        self._dirty = False
        self._thread: Optional[threading.Thread] = None
        if stats_file:
            atexit.register(self.flush)

    def _start_flusher(self) -> None:
        # Steps stop when requests stop; a daemon thread writes what the last interval
        # gathered, so the report is at most one interval old even when the server is
        # killed without running atexit hooks.
        period = self.log_interval if self.log_interval > 0 else 2.0

        def loop():
            while True:
                time.sleep(period)
                for hook in self.idle_hooks:
                    if _section("idle hook", hook):
                        self._dirty = True  # new sums: rewrite the report
                if self._dirty and time.monotonic() - self._last_flush >= period:
                    self.flush(log=self.log_interval > 0)

        self._thread = threading.Thread(target=loop, name="topth-stats", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ recording

    def _advance(self, layer: int) -> None:
        # A step is one model forward: layer indices rise within it.
        if self._last_layer is None or layer <= self._last_layer:
            self._close_step()
            self._step += 1
            self._step_has_decode = False
            self._step_has_prefill = False
        self._last_layer = layer

    def add(self, layer: int, v_rows: Optional[torch.Tensor] = None, seq_lens: Optional[torch.Tensor] = None,
            prefill_tokens: int = 0) -> None:
        """One layer's forward: its decode part (``v_rows`` ``[batch, num_kv_heads]`` int and
        ``seq_lens`` ``[batch]``; dense reads ``seq_len`` rows per sequence and KV head) and
        the number of its prefill tokens (dense). Call once per layer and forward."""
        with self._lock:
            self._advance(layer)
            if prefill_tokens and not self._step_has_prefill:
                self._step_has_prefill = True
                self.prefill_tokens += int(prefill_tokens)
            if v_rows is not None and v_rows.numel():
                self.layers_seen.add(layer)
                B, Hkv = v_rows.shape
                if not self._step_has_decode:
                    self._step_has_decode = True
                    self.decode_tokens += B
                # summed every REDUCE_STEPS steps (_reduce): a few ops per batch of steps, not per layer
                self._step_rows.append((v_rows, seq_lens, Hkv))
            self._dirty = True
        if self._thread is None and (self.stats_file or self.log_interval > 0):
            self._start_flusher()
        self.maybe_flush()

    def skip_step(self, num_decodes: int) -> None:
        """A decode step whose V rows are not recorded (statistics sampling): counted only."""
        with self._lock:
            self.unmeasured_steps += 1
            self.decode_tokens += int(num_decodes)
            self._dirty = True

    # ------------------------------------------------------------------ reading

    def _close_step(self) -> None:
        rows, self._step_rows = self._step_rows, []
        if rows:
            self._raw.append((self._step, rows[0][0].shape[0], rows))
            if len(self._raw) >= REDUCE_STEPS:
                self._reduce()

    def _reduce(self) -> None:
        """Per-step V rows read and dense of the closed steps not yet reduced: a few batched
        ops for up to :data:`REDUCE_STEPS` steps (no sync)."""
        raw, self._raw = self._raw, []
        if not raw:
            return
        dev = raw[0][2][0][0].device
        i64 = torch.int64
        groups: dict = {}  # (v_rows shape, KV heads) -> (v_rows, seq_lens, step slot) per layer
        for j, (_, _, rows) in enumerate(raw):
            for v, n, h in rows:
                g = groups.setdefault((v.shape, h), ([], [], []))
                g[0].append(v)
                g[1].append(n)
                g[2].append(j)
        read = torch.zeros(len(raw), dtype=i64, device=dev)
        dn = torch.zeros(len(raw), dtype=i64, device=dev)
        for (_, h), (vs, ns, js) in groups.items():
            slot = torch.tensor(js, device=dev)
            read.index_add_(0, slot, torch.stack(vs).sum((1, 2), dtype=i64))
            dn.index_add_(0, slot, torch.stack(ns).sum(1, dtype=i64) * h)  # seq_len per KV head
        self._pending.append(([r[0] for r in raw], [r[1] for r in raw], read, dn))

    def _collect(self) -> None:
        self._close_step()  # the step in progress too (_collect merges records of one step)
        self._reduce()
        pending, self._pending = self._pending, []
        if not pending:
            return
        reads = torch.cat([p[2] for p in pending]).cpu().tolist()
        denses = torch.cat([p[3] for p in pending]).cpu().tolist()
        by_step: dict[int, list] = {}
        for (step, seqs), r, d in zip([x for p in pending for x in zip(p[0], p[1])], reads, denses):
            e = by_step.setdefault(step, [seqs, 0, 0])
            e[1] += r
            e[2] += d
        for step, (seqs, r, d) in by_step.items():
            if self.history and self.history[-1][0] == step:
                _, s0, r0, d0 = self.history[-1]
                self.history[-1] = (step, s0, r0 + r, d0 + d)
            else:
                self.history.append((step, seqs, r, d))
                self.decode_steps += 1
            self.v_rows_read += r
            self.v_rows_dense += d

    def report(self) -> dict:
        """The report as a dict (see docs/vllm.md, "Statistics")."""
        with self._lock:
            self._collect()
            frac = self.v_rows_read / self.v_rows_dense if self.v_rows_dense else None
            steps = [{"step": s, "decode_seqs": n, "v_rows_read": r, "v_rows_dense": d}
                     for s, n, r, d in self.history]
            return {
                "format": REPORT_FORMAT,
                "mode": self.mode,
                **self.meta,
                "layers": len(self.layers_seen),
                "decode_steps": self.decode_steps + self.unmeasured_steps,
                "decode_steps_measured": self.decode_steps,
                "decode_tokens": self.decode_tokens,
                "prefill_tokens_dense": self.prefill_tokens,
                "v_rows_read": self.v_rows_read,
                "v_rows_dense": self.v_rows_dense,
                "v_rows_fraction": frac,
                "v_rows_read_per_decode_step": (self.v_rows_read / self.decode_steps) if self.decode_steps else None,
                "v_rows_dense_per_decode_step": (self.v_rows_dense / self.decode_steps) if self.decode_steps else None,
                **{key: _section(key, f) for key, f in self.sections.items()},
                "last_steps": steps[-256:],
                "updated_unix": time.time(),
            }

    def maybe_flush(self) -> None:
        if self.log_interval <= 0 or time.monotonic() - self._last_flush < self.log_interval:
            return
        self.flush(log=True)

    def flush(self, log: bool = False) -> None:
        """Write the report (when a file is set) and, with ``log``, one INFO line."""
        self._last_flush = time.monotonic()
        self._dirty = False
        rep = self.report()
        if log and rep["v_rows_dense"] > self._logged_dense:
            d_read = rep["v_rows_read"] - self._logged_read
            d_dense = rep["v_rows_dense"] - self._logged_dense
            logger.info("topth (mode %s): %d decode steps, %d decode tokens; V rows read %.3f of dense "
                        "(last interval %.3f; %d of %d rows)", self.mode, rep["decode_steps"],
                        rep["decode_tokens"], rep["v_rows_fraction"] or 0.0, d_read / max(d_dense, 1),
                        rep["v_rows_read"], rep["v_rows_dense"])
            self._logged_read, self._logged_dense = rep["v_rows_read"], rep["v_rows_dense"]
        if self.stats_file:
            _write_json(self.stats_file, rep)


def _section(key: str, f):
    try:
        return f()
    except Exception as e:  # statistics must never take the server down
        logger.warning("topth: statistics section %s failed: %s", key, e)
        return None


def _write_json(path: str, data: dict) -> None:
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, p)
    except OSError as e:  # statistics must never take the server down
        logger.warning("topth: cannot write the statistics report %s: %s", path, e)


_CURRENT: Optional[ServingStats] = None


def current() -> Optional[ServingStats]:
    """This process's statistics (None before the backend ran here)."""
    return _CURRENT


def install(stats: ServingStats) -> ServingStats:
    global _CURRENT
    _CURRENT = stats
    return stats
