"""``topth-ops calibrate``: calibrate Top-Theta thresholds of a model on real text and
write threshold files (safetensors); also imports the paper reference code's th.txt."""

from __future__ import annotations

import argparse
import os
import time

from .cli_common import (add_calibration_arguments, add_model_argument, check_alpha, check_context,
                         check_layer_k_syntax, check_output_file, check_sizes, fail, flat_k,
                         note_short_text, parse_k_list, show_progress)

PLACEMENT_CHOICES = ("pre_softmax", "post_softmax", "both")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--k", type=parse_k_list, nargs="+", action="extend", default=None, metavar="K",
                   help="target k (keep ~k elements per row); several, e.g. '8,16,32', are "
                        "calibrated from the same forward passes (required unless --import-reference)")
    p.add_argument("--placement", choices=PLACEMENT_CHOICES, default="post_softmax",
                   help="threshold logits (pre_softmax) or probabilities (post_softmax); both "
                        "are recorded from the same passes (default post_softmax)")
    add_calibration_arguments(p)
    p.add_argument("--out", required=True, metavar="FILE",
                   help="output .safetensors; with several k or both placements it must contain "
                        "{k} and/or {placement}, e.g. th_k{k}_{placement}.safetensors")
    p.add_argument("--import-reference", metavar="TH_TXT", default=None,
                   help="instead of calibrating, import th.txt from the paper's reference code "
                        "(needs --placement pre_softmax or post_softmax; --k is ignored)")
    p.add_argument("--import-sdc", metavar="SDC_TXT", default=None,
                   help="with --import-reference: the reference code's sdc.txt")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def out_path(template: str, k: int, placement: str, multi_k: bool, multi_p: bool) -> str:
    if multi_k and "{k}" not in template:
        raise ValueError(f"--out {template!r} must contain {{k}} when several k are calibrated")
    if multi_p and "{placement}" not in template:
        raise ValueError(f"--out {template!r} must contain {{placement}} with --placement both")
    return template.replace("{k}", str(k)).replace("{placement}", placement)


def run(args: argparse.Namespace) -> int:
    from ..calibration import parse_layer_k
    from .model import ModelNotAvailable

    try:
        if args.import_reference:
            return _import(args)
        if args.k is None:
            raise ValueError("--k is required (unless --import-reference)")
        check_sizes(args, {"samples": 1, "max_tokens": 2})
        check_alpha(args.alpha)
        check_layer_k_syntax(args.layer_k)
        placements = ["pre_softmax", "post_softmax"] if args.placement == "both" else [args.placement]
        ks = flat_k(args.k)
        for k in ks:  # validate the output names before the long work
            for p in placements:
                check_output_file(out_path(args.out, k, p, len(ks) > 1, len(placements) > 1), "--out")
        from .calibrate import CalibrationText, calibrate
        from .model import load_model
        from .texts import calibration_documents, token_samples

        docs, desc = calibration_documents(args.text)
        t0 = time.time()
        lm = load_model(args.model, progress=show_progress(args))
        check_context(args.max_tokens, "--max-tokens", lm.max_context)
        L = int(lm.config.num_hidden_layers)
        targets = [parse_layer_k(args.layer_k, k, L) for k in ks]
        samples = token_samples(lm.tokenizer, docs, args.samples, args.max_tokens)
        note_short_text(samples, args.samples, args.max_tokens)
        text = CalibrationText(samples, f"{desc}; samples of <= {args.max_tokens} tokens")
        print(f"model {lm.name} loaded in {time.time() - t0:.1f} s; calibrating k={ks} "
              f"({', '.join(placements)}) on {text.tokens} tokens of {desc}")
        t1 = time.time()
        sets = calibrate(lm.model, text, targets, placements, alpha=args.alpha,
                         topk_at_calibration=args.topk_at_calibration,
                         sdc_table=not args.no_sdc_table, model_name=lm.name, progress=show_progress(args))
        for (i, p), ts in sorted(sets.items()):
            path = ts.save(out_path(args.out, ks[i], p, len(ks) > 1, len(placements) > 1))
            print(f"wrote {path}: {ts.summary()}")
        print(f"calibration took {time.time() - t1:.1f} s")
        return 0
    except (ValueError, OSError, ModelNotAvailable) as e:
        return fail(str(e))


def _import(args) -> int:
    from .model import load_config
    from ..threshold_file import import_reference_text

    if args.placement == "both":
        return fail("--import-reference needs --placement pre_softmax or post_softmax (th.txt does not record it)")
    if args.import_sdc is not None and args.placement != "pre_softmax":
        raise ValueError("--import-sdc applies to pre_softmax thresholds: add --placement pre_softmax")
    for flag, f in (("--import-reference", args.import_reference), ("--import-sdc", args.import_sdc)):
        if f is not None and os.path.isdir(f):
            raise ValueError(f"{flag} {f!r} is a directory; expected a text file")
        if f is not None and not os.path.isfile(f):
            raise ValueError(f"{flag} {f!r}: no such file")
    check_output_file(args.out, "--out")
    cfg, name = load_config(args.model)
    ts = import_reference_text(args.import_reference, args.import_sdc, placement=args.placement,
                               attention_config=cfg, model_name=name)
    path = args.out.replace("{k}", str(ts.k)).replace("{placement}", ts.placement)
    check_output_file(path, "--out")
    path = ts.save(path)
    print(f"wrote {path}: {ts.summary()}")
    return 0
