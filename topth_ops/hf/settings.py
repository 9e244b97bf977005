"""What the "topth" attention function does: :class:`TopthSettings` (mode, thresholds,
placement, SDC, VMC, selection, threshold sets, prefill) and its validation against a
model's layer count (:meth:`TopthSettings.resolved`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..contract import DEFAULT_SDC_GAMMA, PLACEMENTS, SDC_MODES, SELECTIONS
from ..thresholds import DENSE, ThresholdSet, as_index

MODES = ("dense", "topth", "topk")
PREFILL_MODES = ("thresholded", "dense")


@dataclass
class TopthSettings:
    """What the "topth" attention function does.

    Attributes
    ----------
    mode : {"topth", "topk", "dense"}
        Top-Theta with calibrated thresholds, exact top-k per row, or dense attention.
    thresholds : ThresholdSet, sequence of ThresholdSet, or path, optional
        Required by mode "topth"; its placement and selection mode are used. Several
        sets (of one file: same model, placement and selection) make one batch mix
        requests at different k: the op gets 3-D thresholds and a per-sequence
        ``threshold_set`` (op contract v0.2). A ``str`` / ``os.PathLike`` loads every set
        of the file (:func:`topth_ops.thresholds.load_threshold_sets`; TypeError for
        other types).
    threshold_set : int or sequence of int, optional
        With several sets: the set of each request (one int for the whole batch, or one
        per batch row; a batch that ``generate`` expanded for beams or several return
        sequences repeats each entry). Default 0 with one set; required with several.
        Out of range: :class:`~topth_ops.thresholds.ThresholdFileError` naming the file;
        not an int, a sequence of int or a 1-D integer tensor: TypeError. Stored as a list
        of int.
    selection : {"head", "group"}, optional
        The selection mode the caller expects; must equal the file's (checked).
    placement : str, optional
        Required by mode "topk" (weights of the kept keys); must match the file in "topth".
    sdc : {"none", "exact", "exp_threshold", "offline"}
        pre_softmax only; "offline" needs the file's sdc_table.
    sdc_gamma : float
    vmc : bool
    layer_k : list of int, optional
        k per layer for mode "topk" (0 = dense layer); "topth" takes it from the file.
    prefill : {"thresholded", "dense"}
        Whether prompt (multi-token) rows are thresholded too.
    backend : str, optional
        Backend of the decode op (None: automatic / TOPTH_BACKEND).
    """

    mode: str = "topth"
    thresholds: Optional[object] = None
    placement: Optional[str] = None
    sdc: str = "none"
    sdc_gamma: float = DEFAULT_SDC_GAMMA
    vmc: bool = False
    layer_k: Optional[list] = None
    prefill: str = "thresholded"
    backend: Optional[str] = None
    threshold_set: Optional[object] = None
    selection: Optional[str] = None

    def __post_init__(self):
        if self.selection is not None and self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS} or None, got {self.selection!r}")
        self.threshold_set = set_choice(self.threshold_set)
        if isinstance(self.thresholds, (str, os.PathLike)):
            from ..thresholds import load_threshold_sets

            sets = load_threshold_sets(self.thresholds)
            self.thresholds = sets[0] if len(sets) == 1 else sets
        elif isinstance(self.thresholds, (list, tuple)):
            if not self.thresholds or not all(isinstance(t, ThresholdSet) for t in self.thresholds):
                raise TypeError("thresholds must be a ThresholdSet, a non-empty sequence of ThresholdSet, or a "
                                "path to a threshold file")
            self.thresholds = self.thresholds[0] if len(self.thresholds) == 1 else list(self.thresholds)
        elif self.thresholds is not None and not isinstance(self.thresholds, ThresholdSet):
            raise TypeError("thresholds must be a ThresholdSet (topth_ops.thresholds.load_thresholds), a "
                            f"sequence of them, or a path to a threshold file, got {type(self.thresholds).__name__}")

    @property
    def sets(self) -> list:
        """The threshold sets (one or several), [] without thresholds."""
        t = self.thresholds
        return [] if t is None else (list(t) if isinstance(t, list) else [t])

    def resolved(self, num_layers: int) -> "TopthSettings":
        """Validated copy with placement and layer_k filled in.

        Raises
        ------
        ValueError
            Unknown mode / prefill / placement / sdc, a missing thresholds file or k map,
            sdc with post_softmax, offline sdc without a table, or a layer map of the
            wrong length.
        """
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.prefill not in PREFILL_MODES:
            raise ValueError(f"prefill must be one of {PREFILL_MODES}, got {self.prefill!r}")
        if self.sdc not in SDC_MODES:
            raise ValueError(f"sdc must be one of {SDC_MODES}, got {self.sdc!r}")
        if self.mode != "topth" and self.selection == "group":
            raise ValueError(f"selection='group' needs mode 'topth' with group thresholds, got mode {self.mode!r}")
        s = replace(self)
        if s.mode == "topth":
            if s.thresholds is None:
                raise ValueError("mode 'topth' needs a thresholds file (ThresholdSet)")
            sets = s.sets
            first = sets[0]
            for ts in sets:
                if ts.placement != first.placement or ts.selection != first.selection or \
                        ts.fingerprint != first.fingerprint:
                    raise ValueError(f"threshold sets used together must share model, placement and selection; "
                                     f"{first.name()} and {ts.name()} differ")
                ts.check_model(first.attention_config, placement=s.placement, selection=s.selection)  # raises
            s.placement, s.selection = first.placement, first.selection
            # a layer is dense only when it is dense in every set (a dense set's -inf rows keep all)
            s.layer_k = [next((ts.layer_k[i] for ts in sets if ts.layer_k[i] != DENSE), DENSE)
                         for i in range(len(first.layer_k))]
            if s.sdc == "offline" and any(ts.sdc_table is None for ts in sets):
                bad = next(ts for ts in sets if ts.sdc_table is None)
                raise ValueError(f"sdc='offline' needs an sdc_table; {bad.name()} has none "
                                 "(calibrate with pre_softmax placement and the SDC pass)")
            check_set_indices(s.threshold_set, sets)
        elif s.mode == "topk":
            if s.layer_k is None:
                raise ValueError("mode 'topk' needs layer_k (k per layer)")
            if s.sdc == "offline":
                raise ValueError("sdc='offline' is for mode 'topth' (it needs a calibrated table)")
        else:
            s.layer_k = [DENSE] * num_layers
        if s.placement is None:
            s.placement = "post_softmax"
        if s.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {s.placement!r}")
        if s.placement == "post_softmax" and s.sdc != "none":
            raise ValueError(f"sdc must be 'none' with post_softmax, got {s.sdc!r}")
        if len(s.layer_k) != num_layers:
            raise ValueError(f"layer_k must have {num_layers} entries, got {len(s.layer_k)}")
        return s


def set_choice(choice) -> Optional[list]:
    """A threshold-set choice as a list of int (None stays None).

    Parameters
    ----------
    choice : int, sequence of int, 1-D integer torch.Tensor / numpy.ndarray, or None

    Raises
    ------
    TypeError
        Anything else (a bool, float, str, mapping, a float or bool tensor, a tensor of 2+
        dimensions, a nested sequence).
    ValueError
        An empty sequence.
    """
    if choice is None:
        return None
    what = "threshold_set must be an int, a sequence of int, or a 1-D integer tensor"
    if isinstance(choice, torch.Tensor) or hasattr(choice, "__array__") and hasattr(choice, "dtype"):
        try:
            t = torch.as_tensor(choice)
        except (TypeError, ValueError, RuntimeError):  # numpy uint64, strings, objects
            raise TypeError(f"{what}, got {choice!r}") from None
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool or t.dim() > 1:
            raise TypeError(f"{what}, got a {t.dim()}-D {t.dtype} tensor")
        vals = t.reshape(-1).tolist()
    elif isinstance(choice, (list, tuple, range)):
        vals = list(choice)
    else:
        vals = [choice]
    out = [as_index(v) for v in vals]
    if None in out:
        raise TypeError(f"{what}, got {choice!r}")
    if not out:
        raise ValueError("threshold_set must not be empty")
    return out


def check_set_indices(choice, sets) -> Optional[list]:
    """:func:`set_choice` of ``choice``, checked against the threshold sets at hand.

    Raises
    ------
    ThresholdFileError
        An index out of range (naming the file).
    ValueError
        No choice (None) while there are several sets (the message lists their k), or an
        empty one.
    TypeError
        As :func:`set_choice`.
    """
    vals = set_choice(choice)
    if vals is None:
        if len(sets) > 1:
            ks = ", ".join(f"{i}: k={ts.k}" for i, ts in enumerate(sets))
            raise ValueError(f"{sets[0].name()} holds {len(sets)} threshold sets ({ks}): give threshold_set "
                             "(one index for the batch, or one per request)")
        return None
    from ..thresholds import pick_set

    for v in vals:
        pick_set(sets, v, sets[0].path or "(unsaved)")
    return vals
