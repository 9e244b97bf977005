"""``python -m topth_ops.info`` / ``topth-ops info``: every backend, available or not, and why."""

from __future__ import annotations

import argparse
import os
import platform

import torch

from .registry import ENV_BACKEND, list_backends, priority
from .validation import dtype_str


def backend_rows() -> list[dict]:
    """One dict per registered backend: name, device, dtypes, head_dims, available, runs_on
    (device types of this machine it runs on), reasons, description."""
    rows = []
    for b in list_backends():
        reasons = b.unavailable_reasons()
        rows.append({
            "name": b.name,
            "device": b.device_type,
            "dtypes": ",".join(dtype_str(d) for d in b.dtypes),
            "head_dims": (b.head_dims_note or "any") if b.head_dims is None else ",".join(map(str, b.head_dims)),
            "available": not reasons,
            "runs_on": ",".join(sorted({d.type for d in b.devices()})) if not reasons else "-",
            "reasons": "; ".join(reasons),
            "description": b.description,
        })
    return rows


def format_info() -> str:
    """The text printed by ``topth-ops info``."""
    from . import __version__

    lines = [
        f"topth-ops {__version__}  torch {torch.__version__}  python {platform.python_version()}",
        f"cuda available: {torch.cuda.is_available()}",
        f"{ENV_BACKEND}: {os.environ.get(ENV_BACKEND) or '(not set)'}",
        "",
        f"{'backend':<13} {'device':<6} {'available':<9} {'runs on':<8} {'dtypes':<25} "
        f"{'head_dims':<18} notes",
    ]
    for r in backend_rows():
        note = r["description"] if r["available"] else "unavailable: " + r["reasons"]
        lines.append(
            f"{r['name']:<13} {r['device']:<6} {'yes' if r['available'] else 'no':<9} "
            f"{r['runs_on']:<8} {r['dtypes']:<25} {r['head_dims']:<18} {note}"
        )
    lines.append("")
    for dev in ("cuda", "npu", "cpu"):
        lines.append(f"automatic order on {dev}: {' > '.join(priority(dev))}")
    lines.append("explicit choice: backend=NAME or the TOPTH_BACKEND environment variable")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    print(format_info())
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m topth_ops.info", description=__doc__)
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
