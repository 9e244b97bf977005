"""The suite must fail on a wrong compiled kernel too: each case breaks the argument
marshalling of backend ``cpu`` (topth_ops.backends.cpu.kernel_args, the one place where
tensors become pointers and strides) in a way a binding could, runs the real compiled
kernel, and requires the rule that guards it to report a failure. Every broken variant
stays in bounds (no crash): it reads the wrong elements, never foreign memory."""

import pytest
import torch

from topth_ops.codes import Sdc, VmcMode
from topth_ops.backends import cpu as cpu_backend
from topth_ops.conformance import run_rule
from topth_ops.registry import get_backend

REAL_ARGS = cpu_backend.kernel_args


def _edit(fn):
    def kernel_args(inputs, out, stats):
        args = REAL_ARGS(inputs, out, stats)
        fn(args, inputs)
        return args
    return kernel_args


def _contiguous_cache_strides(args, inputs):
    k = inputs.key_cache  # strides of a contiguous tensor of the same shape, layout-mapped
    B, H, S, D = k.shape
    if inputs.kv_layout == "BNSD":
        args["key_cache"] = (args["key_cache"][0], (H * S * D, S * D, D, 1))


def _ge_for_gt(args, inputs):  # x > nextafter(theta, -inf) keeps x == theta: '>=' in effect
    th = torch.nextafter(inputs.thresholds_3d(), torch.tensor(float("-inf")))
    args["_keep"] = th  # keeps the tensor alive for the call
    args["thresholds"] = (th.data_ptr(), th.stride())


def _table_of_next_sequence(args, inputs):
    if inputs.block_table is not None:
        bt = inputs.block_table.roll(1, dims=0).contiguous()
        args["_keep"] = bt
        args["block_table"] = (bt.data_ptr(), bt.stride())


def _no_threshold_set(args, inputs):
    args["threshold_set"] = None


def _first_set_stride(args, inputs):  # thresholds read as if sets were not there
    if inputs.threshold_set is not None:
        ptr, s = args["thresholds"]
        args["thresholds"] = (ptr, (0, s[1], s[2]))


def _int64_lengths_as_int32(args, inputs):
    if args["seq_lens"][2]:
        ptr, stride, _ = args["seq_lens"]
        args["seq_lens"] = (ptr, stride, False)


def _exact_as_none(args, inputs):
    args["options"][2] = int(Sdc.NONE)


def _value_mean_ignored(args, inputs):
    if args["options"][3] == VmcMode.GIVEN:
        args["options"][3] = int(VmcMode.COMPUTED)
        args["value_mean"] = None


def _unscaled(args, inputs):
    args["scale"] = 1.0


def _head_stride_dropped(args, inputs):  # every query head reads KV head 0's rows
    ptr, s = args["value_cache"]
    args["value_cache"] = (ptr, (s[0], 0, s[2], s[3]))


def _no_stride_small(args, inputs):  # strided seq_lens read as contiguous
    ptr, stride, is64 = args["seq_lens"]
    args["seq_lens"] = (ptr, 1, is64)


MUTANTS = [
    # (name, edit, rule that must catch it)
    ("assumes-contiguous-key-cache", _contiguous_cache_strides, "strided_inputs"),
    ("ge-instead-of-gt", _ge_for_gt, "strict_tie"),
    ("block-table-of-another-sequence", _table_of_next_sequence, "paged_equivalence"),
    ("ignores-threshold-set", _no_threshold_set, "threshold_sets"),
    ("threshold-set-stride-zero", _first_set_stride, "threshold_sets"),
    ("int64-seq-lens-read-as-int32", _int64_lengths_as_int32, "pre_softmax"),
    ("exact-sdc-dropped", _exact_as_none, "sdc_exact"),
    ("value-mean-ignored", _value_mean_ignored, "vmc_value_mean"),
    ("scale-dropped", _unscaled, "post_softmax"),
    ("value-head-stride-dropped", _head_stride_dropped, "group_selection"),
    ("seq-lens-stride-ignored", _no_stride_small, "strided_small_inputs"),
]


@pytest.mark.parametrize("name,edit,rule", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_rule_catches_broken_marshalling(name, edit, rule, monkeypatch):
    backend = get_backend("cpu")
    assert run_rule(backend, rule, torch.float32, device=torch.device("cpu"), shape_set="quick").status == "pass"
    monkeypatch.setattr(cpu_backend, "kernel_args", _edit(edit))
    result = run_rule(backend, rule, torch.float32, device=torch.device("cpu"), shape_set="quick")
    assert result.status == "fail", f"{rule} did not catch {name}: {result.report()}"
    assert not any("CaseGenerationError" in f for f in result.failures), result.report()
