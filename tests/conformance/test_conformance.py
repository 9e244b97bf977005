"""The conformance suite under pytest: every rule x dtype for every backend available here.

Backends that cannot run on this machine get one skipped test each, with the registry's
reasons. The shape set is "full" except for backends that are slow on the CPU (the Triton
interpreter), which get "quick"; TOPTH_CONFORMANCE_SHAPES=full|quick overrides.
"""

import os

import pytest

from topth_ops.env import interpreter_enabled
from topth_ops.conformance import RULES, run_rule
from topth_ops.conformance.runner import DTYPES
from topth_ops.registry import list_backends


def shape_set_for(backend) -> str:
    forced = os.environ.get("TOPTH_CONFORMANCE_SHAPES")
    if forced:
        return forced
    interpreted = backend.name == "triton" and interpreter_enabled()
    return "quick" if interpreted else "full"


def _params():
    params = []
    for b in list_backends():
        reasons = b.unavailable_reasons()
        if reasons:
            params.append(pytest.param(b, None, None, None, id=f"{b.name}-unavailable",
                                       marks=pytest.mark.skip(reason="; ".join(reasons))))
            continue
        for dev in b.devices():
            for dname, dtype in DTYPES.items():
                for rule in RULES:
                    params.append(pytest.param(b, dev, dtype, rule, id=f"{b.name}-{dev.type}-{dname}-{rule}"))
    return params


@pytest.mark.parametrize("backend,device,dtype,rule", _params())
def test_rule(backend, device, dtype, rule):
    result = run_rule(backend, rule, dtype, device=device, shape_set=shape_set_for(backend))
    if result.status == "skip":
        pytest.skip("every case unsupported here: " + result.reason)
    assert result.status == "pass", result.report()
