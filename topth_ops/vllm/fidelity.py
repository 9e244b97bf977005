"""Live fidelity statistics of the vLLM backend and the drift guardrail.

Per (layer, threshold set, row-length bucket) the worker sums, on the device and without
a host sync per step, six channels over its decode rows:

- ``ratio_sum`` / ``ratio_rows``: k~/k, the kept count (mean over the query heads; with
  group selection the V rows of the group) over the layer's target k (``min(k, n)`` for a
  row of n positions), for rows of sets that threshold the layer;
- ``beta_sum``: the dropped softmax mass beta (paper section 3.2.2), mean over heads;
- ``v_read`` / ``v_dense``: V rows read and the rows dense attention reads (per KV head);
- ``rows``: decode rows.

With statistics sampling (settings ``metrics_every``) the sums cover the measured steps;
:meth:`Fidelity.skip_step` counts the other steps (on the host) and their rows per served set
(on the device, no sync).

Every :data:`FLUSH_STEPS` decode steps (or on :meth:`Fidelity.snapshot`) the sums are
copied to the host once; :class:`Guardrail` keeps the deltas of the last ``window``
decode steps and logs one warning per flush naming the cells whose k~/k left the band
(and an info line for cells back inside).
Exporting the numbers (Prometheus, JSON) is :mod:`topth_ops.vllm.metrics` and
:mod:`topth_ops.vllm.stats`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger("vllm.topth_ops")

#: Upper edges of the row-length buckets (row id = seq_len): [1, 512), [512, 1024), ...
BUCKET_EDGES = (512, 1024, 2048, 4096, 8192, 16384, 32768)
CHANNELS = ("ratio_sum", "ratio_rows", "beta_sum", "v_read", "v_dense", "rows")
FLUSH_STEPS = 32
#: Rows a cell needs in the window before the guardrail judges it.
MIN_ROWS = 64
#: Cells named in one guardrail log line.
MAX_NAMED = 12


def bucket_labels() -> list:
    """Prometheus label of each bucket: ``"0-511"``, ``"512-1023"``, ..., ``"32768+"``."""
    lo = [0, *BUCKET_EDGES]
    return [f"{a}-{b - 1}" for a, b in zip(lo, BUCKET_EDGES)] + [f"{BUCKET_EDGES[-1]}+"]


def buckets(seq_lens: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 bucket index of each row (no host sync)."""
    edges = torch.tensor(BUCKET_EDGES, dtype=seq_lens.dtype, device=seq_lens.device)
    return torch.bucketize(seq_lens, edges, right=True)


class Guardrail:
    """Windowed k~/k per (layer, set, bucket) against a band.

    Parameters
    ----------
    band : (float, float)
    window : int
        Decode steps of the window.
    describe : callable
        ``(layer, set, bucket) -> str`` for the warning.
    """

    def __init__(self, band: Sequence[float], window: int, describe: Callable[[int, int, int], str]):
        self.band = (float(band[0]), float(band[1]))
        self.window = int(window)
        self.describe = describe
        # host state in numpy: flushes run both inside the forward (inference mode) and in the
        # statistics thread, and torch's inference tensors cannot be updated outside it
        self._deltas: deque = deque()  # (steps, ratio_sum [L,S,NB], ratio_rows [L,S,NB])
        self.out: Optional[np.ndarray] = None  # bool [L, S, NB]
        self.trips: Optional[np.ndarray] = None  # int64 [L, S, NB]
        self.ratio: Optional[np.ndarray] = None  # float64 [L, S, NB], NaN without enough rows

    def update(self, steps: int, ratio_sum: np.ndarray, ratio_rows: np.ndarray) -> list:
        """Add one flush interval (host arrays); returns the warnings logged."""
        if self.out is None:
            self.out = np.zeros(ratio_sum.shape, dtype=bool)
            self.trips = np.zeros(ratio_sum.shape, dtype=np.int64)
        self._deltas.append((steps, ratio_sum, ratio_rows))
        while len(self._deltas) > 1 and sum(d[0] for d in self._deltas) - self._deltas[0][0] >= self.window:
            self._deltas.popleft()
        rs = sum(d[1] for d in self._deltas)
        rn = sum(d[2] for d in self._deltas)
        ratio = np.where(rn >= MIN_ROWS, rs / np.maximum(rn, 1), np.nan)
        self.ratio = ratio
        lo, hi = self.band
        judged = ~np.isnan(ratio)
        now_out = judged & ((ratio < lo) | (ratio > hi))
        now_in = judged & ~now_out
        new = np.argwhere(now_out & ~self.out).tolist()
        for cell in new:
            self.trips[tuple(cell)] += 1
        back = np.argwhere(now_in & self.out).tolist()
        if back:
            logger.info("topth guardrail: k~/k back inside [%g, %g]: %s", lo, hi,
                        "; ".join(f"{self.describe(*c)}: {float(ratio[tuple(c)]):.3f}" for c in back[:MAX_NAMED]))
        self.out = (self.out & ~now_in) | now_out
        lines = []
        if new:  # one warning per flush, naming the cells that left the band
            named = "; ".join(f"{self.describe(*c)}: {float(ratio[tuple(c)]):.3f}" for c in new[:MAX_NAMED])
            more = f"; and {len(new) - MAX_NAMED} more" if len(new) > MAX_NAMED else ""
            lines.append(f"topth guardrail: k~/k over the last {self.steps_in_window()} measured decode steps left "
                         f"[{lo:g}, {hi:g}] in {len(new)} cell(s): {named}{more}")
            logger.warning("%s", lines[0])
        return lines

    def steps_in_window(self) -> int:
        return sum(d[0] for d in self._deltas)


class Fidelity:
    """Device-side sums of one worker process (module docstring).

    Parameters
    ----------
    num_layers : int
    set_labels : list of str
        One per row of the engine's set table (the last is "dense").
    device : torch.device
    band, window :
        The guardrail's (settings ``guard_band``, ``guard_window``).
    on_flush : callable, optional
        Called with this object after each flush (the Prometheus exporter).
    """

    def __init__(self, num_layers: int, set_labels: Sequence[str], device, band=(0.8, 1.25), window: int = 256,
                 on_flush: Optional[Callable[["Fidelity"], None]] = None):
        self.num_layers = int(num_layers)
        self.set_labels = list(set_labels)
        self.num_buckets = len(BUCKET_EDGES) + 1
        self.device = torch.device(device)
        self._shape = (self.num_layers, len(self.set_labels), self.num_buckets, len(CHANNELS))
        self._acc = torch.zeros(self._shape, dtype=torch.float64, device=self.device)
        self._flat = self._acc.view(-1, len(CHANNELS))
        self.totals = np.zeros(self._shape)  # host copy at the last flush
        self.decode_steps = 0  # measured steps (their rows are in the sums)
        self._steps_at_flush = 0
        # steps not sampled (settings metrics_every): counted, their rows per served set on the device
        self.unmeasured_steps = 0
        self._unmeasured_rows = torch.zeros(len(self.set_labels), dtype=torch.int64, device=self.device)
        self.unmeasured_at_flush = (0, np.zeros(len(self.set_labels), dtype=np.int64))  # values at the last flush
        self._last_layer: Optional[int] = None
        self._entries: list = []  # the layers since the last flush (tensors; summed at the flush)
        self._last_add = time.monotonic()
        self._lock = threading.Lock()
        self.guardrail = Guardrail(band, window, self.describe)
        self.on_flush = on_flush
        self.flushes = 0

    def describe(self, layer: int, s: int, b: int) -> str:
        return f"layer {layer}, set {self.set_labels[s]}, rows {bucket_labels()[b]}"

    def add(self, layer: int, set_idx: torch.Tensor, bucket: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int,
            v_rows: Optional[torch.Tensor] = None, kept: Optional[torch.Tensor] = None,
            dropped_mass: Optional[torch.Tensor] = None, set_k: Optional[torch.Tensor] = None) -> None:
        """One layer's decode rows of one step.

        Parameters
        ----------
        layer : int
        set_idx, bucket : torch.Tensor
            ``[B]`` int64: each row's set-table row and row-length bucket.
        seq_lens : torch.Tensor
            ``[B]`` rows dense attention reads per KV head (clamped to a sliding window).
        num_kv_heads : int
        v_rows : torch.Tensor, optional
            ``[B, num_kv_heads]`` V rows read (None: dense, ``seq_lens`` per head).
        kept, dropped_mass : torch.Tensor, optional
            ``[B, num_q_heads]`` from the op's statistics.
        set_k : torch.Tensor, optional
            ``[num_sets]`` float: the layer's target k per set-table row (0: dense).

        The tensors are summed at the next flush (at most :data:`FLUSH_STEPS` decode steps
        later): they must not change until then (a buffer the engine rewrites for the next
        step must be passed as a copy).
        """
        with self._lock:
            if self._last_layer is None or layer <= self._last_layer:
                self._new_step()
            self._last_layer = layer
            self._last_add = time.monotonic()
            if set_idx.shape[0]:
                # kept until the flush: one batch of small ops per flush, not per layer or step
                self._entries.append((layer, set_idx, bucket, seq_lens, num_kv_heads, v_rows, kept, dropped_mass,
                                      set_k if kept is not None else None))

    def skip_step(self, threshold_set: torch.Tensor) -> None:
        """A decode step that is not measured: counted, and its rows per set-table row
        (``threshold_set`` ``[B]``: the set each row is served with; no host sync)."""
        with self._lock:
            self.unmeasured_steps += 1
            self._last_add = time.monotonic()
            rows = threshold_set.to(torch.int64)
            self._unmeasured_rows.index_add_(0, rows, torch.ones_like(rows))

    @property
    def all_steps(self) -> int:
        """Decode steps at the last flush, measured or not."""
        return self._steps_at_flush + self.unmeasured_at_flush[0]

    def _sum_step(self) -> None:
        """Add the layers recorded since the last call (up to :data:`FLUSH_STEPS` steps) to
        the device sums: a few batched ops per flush rather than per step, no sync."""
        entries, self._entries = self._entries, []
        groups: dict = {}
        for e in entries:  # layers with op statistics / without, and batch shape
            groups.setdefault((e[6] is not None, e[1].shape[0], e[4]), []).append(e)
        S, NB = len(self.set_labels), self.num_buckets
        f64 = torch.float64
        for (with_stats, _, hkv), es in groups.items():
            layers = torch.tensor([e[0] for e in es], device=self.device)[:, None]      # [n, 1]
            set_idx = torch.stack([e[1] for e in es])                                   # [n, B]
            bucket = torch.stack([e[2] for e in es])
            n = torch.stack([e[3] for e in es]).to(f64)
            dense = n * hkv
            zero = torch.zeros_like(dense)
            if with_stats:
                read = torch.stack([e[5] for e in es]).sum(-1, dtype=f64)
                k = torch.gather(torch.stack([e[8] for e in es]).to(self.device, f64), 1, set_idx)
                has = k > 0
                k_eff = torch.minimum(k, n).clamp(min=1)  # a row of n positions keeps at most n
                ratio = torch.where(has, torch.stack([e[6] for e in es]).to(f64).mean(-1) / k_eff, zero)
                rrows = has.to(f64)
                beta = torch.where(has, torch.stack([e[7] for e in es]).to(f64).mean(-1), zero)
            else:
                read, ratio, rrows, beta = dense, zero, zero, zero
            src = torch.stack([ratio, rrows, beta, read, dense, torch.ones_like(dense)], -1)
            idx = (layers * S + set_idx) * NB + bucket
            self._flat.index_add_(0, idx.reshape(-1), src.reshape(-1, len(CHANNELS)))

    def _new_step(self) -> None:
        if self._last_layer is not None:
            self.decode_steps += 1
        if self.decode_steps - self._steps_at_flush >= FLUSH_STEPS:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self._sum_step()  # the steps since the last flush (their tensors are kept until now)
        now = self._acc.cpu().numpy().copy()  # the one host sync per flush
        delta = now - self.totals
        steps = self.decode_steps - self._steps_at_flush
        self.totals = now
        self._steps_at_flush = self.decode_steps
        self.unmeasured_at_flush = (self.unmeasured_steps, self._unmeasured_rows.cpu().numpy().copy())
        if steps > 0:
            self.guardrail.update(steps, delta[..., 0], delta[..., 1])
        self.flushes += 1
        if self.on_flush is not None:
            try:
                self.on_flush(self)
            except Exception as e:  # metrics must never take the server down
                logger.warning("topth: metrics update failed: %s", e)

    def idle(self, seconds: float = 1.0) -> bool:
        """No decode row added for ``seconds`` and some not yet flushed: the statistics
        thread flushes then, so the last steps of a burst reach the metrics."""
        return (time.monotonic() - self._last_add > seconds
                and (bool(self._entries) or self.decode_steps > self._steps_at_flush
                     or self.unmeasured_steps > self.unmeasured_at_flush[0]))

    def snapshot(self) -> np.ndarray:
        """Flush now and return the host totals ``[L, S, NB, len(CHANNELS)]``."""
        with self._lock, torch.inference_mode():  # the sums are inference tensors (made in the forward)
            self._flush_locked()  # the step in progress too (its later layers add to the sums when they come)
            return self.totals.copy()

    def report(self, fresh: bool = True) -> dict:
        """Per set and layer: V rows read / dense, k~/k per bucket, mean beta, rows (the
        JSON report's ``per_set`` section). ``fresh=False`` reads the sums of the last
        flush (at most :data:`FLUSH_STEPS` decode steps old) instead of flushing now."""
        if fresh:
            self.snapshot()
        with self._lock:  # the sums and the unmeasured rows of one flush
            t, extra_rows = self.totals.copy(), self.unmeasured_at_flush[1].copy()
        labels = bucket_labels()
        out = {}
        for s, name in enumerate(self.set_labels):
            layers = []
            for layer in range(self.num_layers):
                c = t[layer, s]
                rows = float(c[:, 5].sum())
                if rows == 0:
                    continue
                rr = c[:, 1]
                layers.append({
                    "layer": layer,
                    "v_rows_fraction": float(c[:, 3].sum() / c[:, 4].sum()) if float(c[:, 4].sum()) else None,
                    "kept_over_k": {labels[b]: float(c[b, 0] / rr[b]) for b in range(self.num_buckets) if rr[b] > 0},
                    "dropped_mass": float(c[:, 2].sum() / rr.sum()) if float(rr.sum()) else None,
                    "rows": int(rows),
                })
            if layers:
                tot = t[:, s]
                out[name] = {"v_rows_read": int(tot[..., 3].sum()), "v_rows_dense": int(tot[..., 4].sum()),
                             "v_rows_fraction": float(tot[..., 3].sum() / tot[..., 4].sum()),
                             "decode_rows": int(t[min(x["layer"] for x in layers), s, :, 5].sum() + extra_rows[s]),
                             "layers": layers}
            elif extra_rows[s]:  # rows only on unmeasured steps so far
                out[name] = {"v_rows_read": 0, "v_rows_dense": 0, "v_rows_fraction": None,
                             "decode_rows": int(extra_rows[s]), "layers": []}
        g = self.guardrail
        out_cells = [] if g.out is None else [self.describe(*c) for c in np.argwhere(g.out).tolist()]
        return {"sets": out, "guardrail": {"band": list(g.band), "window_steps": g.window,
                                           "out_of_band": out_cells}}
