"""The writing half of the engine's calibration (:class:`topth_ops.vllm.calibration.EngineCalibration`):
the threshold files of the recorded rows, today's format, one file per placement and
selection; with tensor parallelism each rank's part and rank 0's merge of the parts into whole
files (heads in rank order) that load at any TP size."""

from __future__ import annotations

import logging
import os
import time

import torch

from ..calibration import CountAccumulator
from ..thresholds import DENSE, ThresholdSet, default_extend_to
from ..thresholds.save import save_threshold_sets

logger = logging.getLogger("vllm.topth_ops")

#: Seconds rank 0 waits for the other ranks' parts.
MERGE_WAIT_S = 120.0


class CalibrationFiles:
    """Writes what an :class:`EngineCalibration` recorded (its accumulator ``acc``, counters,
    targets, output paths, a second round's ``served`` set and ``rule``, ``lock`` and
    ``done``); a base class of it, not used alone."""

    def source(self) -> str:
        second = "" if self.served is None else f"; second round, every row served with {self.served.name()}"
        return (f"served traffic: {self.prompts} prompts ({self.finished_requests()} requests finished), "
                f"{self.tokens} tokens in {self.steps} steps; "
                f"rows recorded per layer: {self.prefill_rows} prompt, {self.decode_rows} decode; row ids 1-{self.max_row}"
                f"{second}")

    def write(self, reason: str, final: bool = False) -> list:
        """Write the files now (``final``: and stop recording once written). Returns the
        paths written (none on ranks > 0, and none without recorded rows, which is logged).
        Layers without a recorded row longer than their k are written dense, with a warning."""
        with self.lock:
            if self.done:
                return []
            if not (self.prefill_rows or self.decode_rows):
                # nothing to write yet: keep recording (a trigger that comes before the rows of
                # the requests it counts, e.g. all of them entering one step, fires again later)
                if not self._warned_empty:
                    logger.warning("topth: calibration (%s): no rows were recorded yet (no request longer than "
                                   "k=%d), so no threshold file was written", reason, self.acc.min_k)
                    self._warned_empty = True
                return []
            self.generation += 1
            acc, max_row = self.acc, self.max_row
            if self.tp > 1:
                acc, max_row = self._merge_parts()
                if acc is None:
                    self.done = final and self.rank > 0  # rank 0 merges; the other ranks are done with their part
                    return []
            extend_to = default_extend_to(max_row, self.context)
            targets = [self._covered(acc, t) for t in self.targets]
            if all(all(k == DENSE for k in t) for t in targets):
                logger.warning("topth: calibration (%s): no layer has a recorded row longer than its k (%s); no "
                               "threshold file was written yet", reason, self.ks)
                return []
            results = acc.results(targets, extend_to, calibrated_rows=max_row)
            written = []
            # the recommended placement first (a shutdown write may be cut short by the engine)
            for (k, p, s), path in sorted(self.paths().items(), key=lambda e: e[0][1] != "post_softmax"):
                sets = [self._threshold_set(results[(i, p, s)]) for i, kk in enumerate(self.ks) if k in (None, kk)]
                save_threshold_sets(path, sets)
                written.append(path)
                logger.info("topth: calibration (%s) wrote %s: %s", reason, path, "; ".join(t.summary() for t in sets))
            self.done = final
            return written

    def _covered(self, acc: CountAccumulator, layer_k: list) -> list:
        """``layer_k`` with the layers that saw no recorded row longer than their k made
        dense (warned about once per layer and k)."""
        out = list(layer_k)
        for layer, k in enumerate(layer_k):
            if k == DENSE:
                continue
            rows = acc.rows[layer].numpy()
            if not (rows[acc.edges[:-1] >= k] > 0).any():
                out[layer] = DENSE
                if (layer, k) not in self._warned_dense:
                    self._warned_dense.add((layer, k))
                    logger.warning("topth: calibration: layer %d saw no row longer than its k=%d; it is dense in the "
                                   "file (longer requests, or a smaller --layer-k for it, calibrate it)", layer, k)
        return out

    def _threshold_set(self, r) -> ThresholdSet:
        return ThresholdSet(thresholds=r.thresholds, counts=r.counts, layer_k=r.layer_k, placement=r.placement,
                            model_name=self.model_name, attention_config=dict(self.cfg), alpha=None, sdc_table=None,
                            calibration_text=self.source(), calibration_samples=max(1, self.prompts),
                            calibration_tokens=self.tokens, selection=r.selection, estimator="count",
                            length_model=r.length_model, layerwise_rule=self.rule)

    def _part_path(self, rank: int) -> str:
        return f"{next(iter(self.paths().values()))}.rank{rank}.part"

    def _merge_parts(self):
        """Write this rank's part; on rank 0 wait for every rank's part of the same steps
        (tokens recorded) and merge the heads (rank order). Returns (accumulator, longest
        row) or (None, 0)."""
        a = self.acc
        part = {"tokens": self.tokens, "max_row": self.max_row, "hist": a.hist, "range": a.range,
                "rows": a.rows, "log_n": a.log_n, "rows_per_id": a.rows_per_id}
        tmp = self._part_path(self.rank) + ".tmp"
        torch.save(part, tmp)
        os.replace(tmp, self._part_path(self.rank))
        if self.rank:
            return None, 0
        parts, deadline = {}, time.monotonic() + MERGE_WAIT_S
        while len(parts) < self.tp and time.monotonic() < deadline:
            for r in range(self.tp):
                if r not in parts and os.path.exists(self._part_path(r)):
                    p = torch.load(self._part_path(r), weights_only=True)
                    if p["tokens"] == self.tokens:  # the same steps recorded
                        parts[r] = p
            time.sleep(0.2)
        if len(parts) < self.tp:
            logger.error("topth: calibration: parts of ranks %s for the same steps did not arrive within %.0f s; no "
                         "file written (SIGUSR1 must reach every worker process, e.g. pkill -USR1 -f VllmWorker)",
                         sorted(set(range(self.tp)) - set(parts)), MERGE_WAIT_S)
            return None, 0
        cfg = self.cfg
        whole = CountAccumulator(cfg["num_layers"], cfg["num_q_heads"], cfg["num_kv_heads"], a.max_row_id,
                                 sorted({k for t in self.targets for k in t if k != DENSE}), self.placements,
                                 self.selections)
        for key in whole.hist:
            whole.hist[key] = torch.cat([parts[r]["hist"][key] for r in range(self.tp)], dim=1)
            whole.range[key] = torch.cat([parts[r]["range"][key] for r in range(self.tp)], dim=1)
        whole.rows, whole.log_n, whole.rows_per_id = a.rows, a.log_n, a.rows_per_id
        for r in range(self.tp):
            os.unlink(self._part_path(r))
        return whole, max(p["max_row"] for p in parts.values())
