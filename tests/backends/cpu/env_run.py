"""One call of the ``cpu`` backend with environment variables set for its duration (the SIMD
level and split plan are read from the environment at each call), returning the output, the
statistics and the kernel's counters."""

import os

from topth_ops.contract import make_inputs
from topth_ops.registry import get_backend

BACKEND = get_backend("cpu")


def run_with_env(kw: dict, env: dict):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        inputs = make_inputs(**kw, return_stats=True)
        out, stats = inputs.empty_outputs(fill=float("nan"))
        BACKEND.forward(inputs, out, stats)
        return out, stats, dict(BACKEND.last_counters)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
