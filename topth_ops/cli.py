"""The ``topth-ops`` command line. Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int`` and keeps heavy imports inside ``run``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Optional, Sequence


class CliError(Exception):
    """A bad flag value; ``main`` prints it on one line and exits with status 2."""


def check_output_file(path: str, flag: str) -> None:
    """Raise ValueError unless ``path`` can be written as a file (checked before any long
    work; the write itself still reports OSError with the path)."""
    if not path:
        raise ValueError(f"{flag} is empty; expected a file path")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path!r} is a directory; expected a file path")
    _check_creatable_dir(p.parent, flag, path)


def check_output_dir(path: str, flag: str) -> None:
    """Raise ValueError unless ``path`` is, or can be created as, a writable directory."""
    if not path:
        raise ValueError(f"{flag} is empty; expected a directory")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path!r} exists and is not a directory")
    _check_creatable_dir(p, flag, path)


def _check_creatable_dir(d: Path, flag: str, path: str) -> None:
    """The nearest existing folder at or above ``d`` must accept a new file: tried with a
    temporary file (``os.access`` says yes to root even on read-only or virtual file
    systems such as /proc)."""
    a = d.absolute()
    while not a.exists() and a != a.parent:
        a = a.parent
    if not a.is_dir():
        raise ValueError(f"{flag} {path!r}: {str(a)!r} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".topth-write-check.", dir=a)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"{flag} {path!r}: cannot create files in {str(a)!r} ({e.strerror})") from None


# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("topth_ops.info", "list every backend, available or not, and why"),
    "conformance": ("topth_ops.conformance.cli", "run the conformance suite against one backend"),
    "demo": ("topth_ops.demo", "synthetic decode demo: error vs dense attention and V rows read"),
    "bench": ("topth_ops.bench.cli", "kernel benchmark: thresholded vs dense decode per backend"),
    "calibrate": ("topth_ops.hf.cli_calibrate", "calibrate Top-Theta thresholds of a model on real text"),
    "generate": ("topth_ops.hf.cli_generate", "generate text with Top-Theta attention, with V-row statistics"),
    "evaluate": ("topth_ops.hf.cli_evaluate", "main job: calibrate + evaluate dense / Top-Theta / top-k on real text"),
    "export-hf": ("topth_ops.hf.export", "write the default GGUF model as a Hugging Face folder (for vLLM, offline)"),
    "serve": ("topth_ops.vllm.cli_serve", "OpenAI-compatible vLLM server with Top-Theta decode (needs vLLM)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="topth-ops", description="Top-Theta thresholded sparse decode attention"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``topth-ops`` console script; returns the exit status."""
    # Triton's CPU interpreter (TRITON_INTERPRET=1) evaluates masked lanes with numpy and
    # warns about inf/NaN arithmetic that the kernels discard by design.
    warnings.filterwarnings("ignore", module="triton.runtime.interpreter")
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list = []
    if "--" in argv:  # everything after "--" goes to a wrapped program (serve: vLLM)
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if passthrough and not getattr(args, "_passthrough_ok", False):
        parser.error(f"topth-ops {args.command} takes no arguments after '--'")
    args.passthrough = passthrough
    seen: set = set()

    def show_warning(message, category, filename, lineno, file=None, line=None):
        # one line per distinct warning, without the Python source location
        if str(message) not in seen:
            seen.add(str(message))
            print(f"topth-ops {args.command}: warning: {message}", file=sys.stderr)

    saved, warnings.showwarning = warnings.showwarning, show_warning
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except CliError as e:
        print(f"topth-ops {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = saved


if __name__ == "__main__":
    sys.exit(main())
