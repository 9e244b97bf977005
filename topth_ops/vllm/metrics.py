"""Prometheus metrics of the vLLM backend (docs/vllm.md, "Metrics").

The worker process updates them at every flush of its :class:`~topth_ops.vllm.fidelity.Fidelity`
sums (every few dozen decode steps). They reach the server's ``/metrics`` through
prometheus_client's multi-process mode: ``PROMETHEUS_MULTIPROC_DIR`` must name an empty
directory before vLLM starts (``topth-ops serve`` creates one); vLLM's server then reads
every process's values from it. Without it the values stay in the worker (a log line
says so) and the JSON report still has them.

=================================  =======  ========================================
name                               type     labels
=================================  =======  ========================================
topth_decode_steps_total           counter  rank
topth_decode_rows_total            counter  set, rank
topth_v_rows_read_total            counter  layer, set, rank
topth_v_rows_dense_total           counter  layer, set, rank
topth_kept_over_k                  gauge    layer, set, bucket, rank (guardrail window)
topth_dropped_mass                 gauge    layer, set, rank (last flush interval)
topth_guardrail_out_of_band        gauge    layer, set, bucket, rank (1 while outside)
topth_guardrail_trips_total        counter  layer, set, bucket, rank
topth_threshold_set_info           gauge    set, k, placement, selection, file, rank
=================================  =======  ========================================

``set`` is the set's index in the threshold file, or ``dense``; ``bucket`` a row-length
range (``fidelity.bucket_labels``).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Optional, Sequence

import numpy as np

from .fidelity import Fidelity, bucket_labels

logger = logging.getLogger("vllm.topth_ops")

_METRICS: Optional[dict] = None


def _metrics() -> dict:
    """The metric objects, created once per process (a second engine in the process
    reuses them)."""
    global _METRICS
    if _METRICS is None:
        from prometheus_client import Counter, Gauge

        g = dict(multiprocess_mode="mostrecent")
        _METRICS = {
            "steps": Counter("topth_decode_steps", "Decode steps (forwards with decode rows) of the worker", ["rank"]),
            "rows": Counter("topth_decode_rows", "Decode rows (one per sequence and step) per threshold set",
                            ["set", "rank"]),
            "read": Counter("topth_v_rows_read", "V rows read by decode attention (per KV head)",
                            ["layer", "set", "rank"]),
            "dense": Counter("topth_v_rows_dense", "V rows dense attention reads for the same decode rows",
                             ["layer", "set", "rank"]),
            "kept": Gauge("topth_kept_over_k", "Kept count over the layer's target k (k~/k), mean over the "
                          "guardrail window", ["layer", "set", "bucket", "rank"], **g),
            "beta": Gauge("topth_dropped_mass", "Mean dropped softmax mass (beta) over the last interval",
                          ["layer", "set", "rank"], **g),
            "out": Gauge("topth_guardrail_out_of_band", "1 while the windowed k~/k is outside the guardrail band",
                         ["layer", "set", "bucket", "rank"], **g),
            "trips": Counter("topth_guardrail_trips", "Times the windowed k~/k left the guardrail band",
                             ["layer", "set", "bucket", "rank"]),
            "info": Gauge("topth_threshold_set_info", "Threshold sets of the engine (value 1)",
                          ["set", "k", "placement", "selection", "file", "rank"], **g),
        }
    return _METRICS


class PrometheusExporter:
    """Turns :class:`Fidelity` flushes into metric updates (``on_flush``).

    Parameters
    ----------
    rank : int
        Tensor-parallel rank (label).
    sets : sequence of dict
        Per set-table row: ``{"set", "k", "placement", "selection", "file"}`` (the info metric).
    """

    def __init__(self, rank: int, sets: Sequence[dict]):
        self.m = _metrics()
        self.rank = str(rank)
        self._last: Optional[np.ndarray] = None
        self._steps = 0
        self._extra: Optional[np.ndarray] = None  # unmeasured rows per set at the last update
        self._trips: dict = {}
        self._shown: dict = {}  # (layer, set, bucket) -> (k~/k, out, trips) last exported
        for s in sets:
            self.m["info"].labels(**{k: str(v) for k, v in s.items()}, rank=self.rank).set(1)
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ and "prometheus_multiproc_dir" not in os.environ:
            logger.info("topth: PROMETHEUS_MULTIPROC_DIR is not set, so this worker's topth_* metrics do not reach "
                        "the server's /metrics (`topth-ops serve` sets it; docs/vllm.md, \"Metrics\")")

    def __call__(self, fid: Fidelity) -> None:
        t = fid.totals
        last = self._last if self._last is not None else np.zeros_like(t)
        d = t - last
        self._last = t.copy()
        m, r = self.m, self.rank
        steps = fid.all_steps  # measured or not (statistics sampling)
        if steps > self._steps:
            m["steps"].labels(rank=r).inc(steps - self._steps)
            self._steps = steps
        extra = fid.unmeasured_at_flush[1]  # rows of unmeasured steps, per set
        extra_d = extra - (self._extra if self._extra is not None else 0)
        self._extra = extra.copy()
        labels = bucket_labels()
        g = fid.guardrail
        rows = t[..., 5].sum(2)  # [L, S]
        first = {}
        for layer, s in np.argwhere(rows > 0).tolist():
            first.setdefault(s, layer)
            sl, ll = fid.set_labels[s], str(layer)
            dc = d[layer, s]
            if float(dc[:, 3].sum()) > 0:
                m["read"].labels(layer=ll, set=sl, rank=r).inc(float(dc[:, 3].sum()))
            if float(dc[:, 4].sum()) > 0:
                m["dense"].labels(layer=ll, set=sl, rank=r).inc(float(dc[:, 4].sum()))
            rr = float(dc[:, 1].sum())
            if rr > 0:
                m["beta"].labels(layer=ll, set=sl, rank=r).set(float(dc[:, 2].sum()) / rr)
            for b in range(fid.num_buckets):
                if g.ratio is None or math.isnan(float(g.ratio[layer, s, b])):
                    continue
                key = (layer, s, b)
                state = (round(float(g.ratio[layer, s, b]), 4), bool(g.out[layer, s, b]), int(g.trips[layer, s, b]))
                if self._shown.get(key) == state:  # unchanged since the last update: no metric calls
                    continue
                self._shown[key] = state
                bl = labels[b]
                m["kept"].labels(layer=ll, set=sl, bucket=bl, rank=r).set(state[0])
                m["out"].labels(layer=ll, set=sl, bucket=bl, rank=r).set(int(state[1]))
                seen = self._trips.get(key, 0)
                if state[2] > seen:
                    m["trips"].labels(layer=ll, set=sl, bucket=bl, rank=r).inc(state[2] - seen)
                    self._trips[key] = state[2]
        for s in range(len(fid.set_labels)):
            n = float(extra_d[s]) + (float(d[first[s], s, :, 5].sum()) if s in first else 0.0)
            if n > 0:
                m["rows"].labels(set=fid.set_labels[s], rank=r).inc(n)
