"""``topth-ops conformance --backend NAME``: the pass/fail table a new hardware port needs."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", help="registered backend name (see topth-ops info); required unless --list")
    parser.add_argument("--dtypes", default="float16,bfloat16,float32",
                        help="comma-separated input dtypes (default: %(default)s)")
    parser.add_argument("--rules", default=None, help="comma-separated rule names (default: all)")
    parser.add_argument("--shapes", default="full", choices=("full", "quick"),
                        help="shape set: full (the contract's shapes) or quick (default: %(default)s)")
    parser.add_argument("--device", default=None, help="torch device (default: the backend's own)")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--list", action="store_true", help="list the rules and exit")


def _names(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def run(args: argparse.Namespace) -> int:
    from ..cli import CliError
    from .harness import RULES
    from .runner import format_table, plan, run_conformance

    if args.list:
        for r in RULES.values():
            print(f"{r.name:<20} {r.description}")
        return 0
    if not args.backend:
        raise CliError("--backend is required (see topth-ops info for the names)")
    rules = _names(args.rules) if args.rules else None
    dtypes = _names(args.dtypes)
    try:  # every flag is checked before the first rule runs
        plan(args.backend, dtypes=dtypes, rules=rules, shape_set=args.shapes, device=args.device)
    except ValueError as e:
        raise CliError(str(e)) from None

    def progress(r):
        print(f"  {r.rule:<20} {r.dtype:<9} {r.status:<4} {r.cases:>4} cases  {r.seconds:6.1f} s", flush=True)

    print(f"conformance of backend {args.backend!r} ({args.shapes} shapes)")
    results = run_conformance(args.backend, dtypes=dtypes, rules=rules, shape_set=args.shapes,
                              device=args.device, progress=progress)
    print()
    print(format_table(results))
    bad = [r for r in results if r.status == "fail"]
    skipped = [r for r in results if r.status == "skip"]
    for r in bad + skipped:
        print()
        print(r.report())
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)
    print()
    verdict = "FAIL" if bad else "PASS"
    print(f"{verdict}: {sum(r.status == 'pass' for r in results)} passed, {len(bad)} failed, "
          f"{len(skipped)} skipped (rule x dtype)")
    return 1 if bad else 0
