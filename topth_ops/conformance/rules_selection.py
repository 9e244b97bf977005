"""Conformance rules for group selection and threshold sets (docs/semantics.md)."""

from __future__ import annotations

from .cases import random_case
from .harness import Harness, rule

_PRE_SDC = ("none", "exact", "exp_threshold", "offline")


@rule("group_selection", "selection='group': one threshold per KV head against the group maximum of logits / probabilities; every head keeps the same rows; compensation per head")
def _group(h: Harness) -> None:
    for i, shape in enumerate(h.shapes):
        placement = "pre_softmax" if i % 2 else "post_softmax"
        sdc = _PRE_SDC[(i // 2) % len(_PRE_SDC)] if placement == "pre_softmax" else "none"
        h.check(random_case("group_selection", shape, h.dtype, placement=placement, sdc=sdc,
                            vmc=i % 3 != 0, selection="group", seed=h.seed("group", shape.id)))


@rule("threshold_sets", "3-D thresholds: sequence b reads set threshold_set[b] of thresholds and sdc_table (per head and per group)")
def _sets(h: Harness) -> None:
    for i, shape in enumerate(h.shapes):
        placement = "pre_softmax" if i % 2 == 0 else "post_softmax"
        sdc = "offline" if placement == "pre_softmax" else "none"
        selection = "group" if i % 3 == 1 else "head"
        h.check(random_case("threshold_sets", shape, h.dtype, placement=placement, sdc=sdc,
                            vmc=True, selection=selection, num_sets=2 + i % 3,
                            seed=h.seed("sets", shape.id)))
