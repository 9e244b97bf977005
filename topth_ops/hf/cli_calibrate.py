"""``topth-ops calibrate``: calibrate Top-Theta thresholds of a model on real text and
write threshold files (safetensors); also imports the paper reference code's th.txt."""

from __future__ import annotations

import argparse
import os
import time

from .cli_common import (
    add_calibration_arguments,
    add_model_argument,
    check_alpha,
    check_context,
    check_extend_to,
    check_layer_k_syntax,
    check_layerwise,
    check_output_file,
    check_sizes,
    fail,
    flat_k,
    note_short_text,
    parse_k_list,
    show_progress,
)

from ..thresholds.save import sets_file_path as out_path

PLACEMENT_CHOICES = ("pre_softmax", "post_softmax", "both")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--k", type=parse_k_list, nargs="+", action="extend", default=None, metavar="K",
                   help="target k (keep ~k elements per row); several, e.g. '8,16,32', are "
                        "calibrated from the same forward passes (required unless --import-reference)")
    p.add_argument("--placement", choices=PLACEMENT_CHOICES, default="post_softmax",
                   help="threshold logits (pre_softmax) or probabilities (post_softmax); both "
                        "are recorded from the same passes (default post_softmax)")
    p.add_argument("--selection", choices=("head", "group", "both"), default="head",
                   help="head: one threshold per query head; group: one per KV head against the group "
                        "maximum (the V rows a GQA group reads are the rows it keeps; k = V rows per group)")
    add_calibration_arguments(p)
    p.add_argument("--out", required=True, metavar="FILE",
                   help="output .safetensors; several k go into one file as threshold sets (per-request "
                        "sparsity), or one file per k when the name contains {k}; with both placements / "
                        "selections it must contain {placement} / {selection}, e.g. th_{placement}.safetensors")
    p.add_argument("--second-round", metavar="FILE", default=None,
                   help="calibrate again with every layer running this earlier file's thresholds (its set of the "
                        "same k, placement and selection; VMC): re-fits a one-pass pre_softmax file, whose upper "
                        "layers keep above k, to the activations it gives. The reference of the vLLM engine's "
                        "second round (`topth-ops serve --calibrate OUT --thresholds FILE`); offline, "
                        "--layerwise-calibration fits exactly. One k; needs --no-sdc-table for pre_softmax")
    p.add_argument("--import-reference", metavar="TH_TXT", default=None,
                   help="instead of calibrating, import th.txt from the paper's reference code "
                        "(needs --placement pre_softmax or post_softmax; --k is ignored)")
    p.add_argument("--import-sdc", metavar="SDC_TXT", default=None,
                   help="with --import-reference: the reference code's sdc.txt")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from ..thresholds import parse_layer_k
    from .model import ModelNotAvailable

    try:
        if args.import_reference:
            for flag, on in (("--layerwise-calibration", args.layerwise_calibration),
                             ("--second-round", args.second_round)):
                if on:
                    raise ValueError(f"{flag} calibrates; --import-reference only converts a file")
            if args.align != "stream":
                raise ValueError("--align chooses calibration samples; --import-reference only converts a file")
            if args.extend_to is not None:
                raise ValueError("--extend-to sets the length model's reach; --import-reference only converts a file "
                                 "(the reference format has no length model)")
            return _import(args)
        if args.k is None:
            raise ValueError("--k is required (unless --import-reference)")
        check_sizes(args, {"samples": 1, "max_tokens": 2})
        check_extend_to(args, "--max-tokens")
        check_alpha(args.alpha)
        check_layerwise(args)
        second = _second_round_set(args) if args.second_round else None
        check_layer_k_syntax(args.layer_k)
        placements = ["pre_softmax", "post_softmax"] if args.placement == "both" else [args.placement]
        selections = ["head", "group"] if args.selection == "both" else [args.selection]
        ks = flat_k(args.k)
        per_k = "{k}" in args.out
        if args.estimator == "mean" and selections != ["head"]:
            raise ValueError("--selection group needs --estimator count")
        if args.estimator == "count" and args.alpha != 0:
            raise ValueError("--alpha applies to --estimator mean (algorithm 1)")
        for k in (ks if per_k else [None]):  # validate the output names before the long work
            for p in placements:
                for sel in selections:
                    check_output_file(out_path(args.out, k, p, len(placements) > 1, sel, len(selections) > 1), "--out")
        from ..thresholds import save_threshold_sets
        from .calib_sources import calibration_texts, mixed_samples
        from .calibrate import CalibrationText, calibrate
        from .model import load_model

        sources = calibration_texts(args.text)
        if args.samples < len(sources):
            raise ValueError(f"--samples must be >= the number of --text sources ({len(sources)}), got {args.samples}")
        t0 = time.time()
        lm = load_model(args.model, progress=show_progress(args))
        check_context(args.max_tokens, "--max-tokens", lm.max_context)
        L = int(lm.config.num_hidden_layers)
        targets = [parse_layer_k(args.layer_k, k, L) for k in ks]
        samples, desc = mixed_samples(lm.tokenizer, sources, args.samples, args.max_tokens, align=args.align)
        note_short_text(samples, args.samples, args.max_tokens)
        text = CalibrationText(samples, desc)
        print(f"model {lm.name} loaded in {time.time() - t0:.1f} s; calibrating k={ks} "
              f"({', '.join(placements)}{', layer-wise' if args.layerwise_calibration else ''}) on "
              f"{text.tokens} tokens of {desc}")
        t1 = time.time()
        sets = calibrate(lm.model, text, targets, placements, alpha=args.alpha,
                         topk_at_calibration=args.topk_at_calibration, layerwise=args.layerwise_calibration,
                         sdc_table=not args.no_sdc_table, model_name=lm.name, progress=show_progress(args),
                         estimator=args.estimator, selections=selections, extend_to=args.extend_to,
                         second_round=second)
        for p in placements:
            for sel in selections:
                mine = [sets[(i, p, sel)] for i in range(len(ks))]
                files = [(k, [ts]) for k, ts in zip(ks, mine)] if per_k else [(None, mine)]
                for k, group in files:
                    path = save_threshold_sets(out_path(args.out, k, p, len(placements) > 1, sel,
                                                        len(selections) > 1), group)
                    for ts in group:
                        print(f"wrote {path}" + (f" set {ts.set_index}" if len(group) > 1 else "") + f": {ts.summary()}")
        print(f"calibration took {time.time() - t1:.1f} s")
        return 0
    except (ValueError, OSError, ModelNotAvailable) as e:
        return fail(str(e))


def _second_round_set(args):
    """The set of ``--second-round`` that this calibration refits (before the model loads):
    the file's set with the one --k, --placement and --selection given."""
    from ..thresholds import load_threshold_sets

    if args.layerwise_calibration or args.topk_at_calibration:
        raise ValueError("--second-round replaces --layerwise-calibration and --topk-at-calibration (give one)")
    if args.estimator != "count":
        raise ValueError("--second-round needs the kept-count estimator (--estimator count)")
    ks = flat_k(args.k)
    if len(ks) != 1 or args.placement == "both" or args.selection == "both":
        raise ValueError("--second-round refits one set: give one --k, --placement pre_softmax or post_softmax and "
                         "--selection head or group")
    if args.placement == "pre_softmax" and not args.no_sdc_table:
        raise ValueError("--second-round records no offline SDC table: add --no-sdc-table")
    sets = load_threshold_sets(args.second_round)
    match = [t for t in sets if (t.k, t.placement, t.selection) == (ks[0], args.placement, args.selection)]
    if len(match) != 1:
        have = ", ".join(f"k={t.k} {t.placement} {t.selection}" for t in sets)
        raise ValueError(f"--second-round {args.second_round!r} needs one set with k={ks[0]}, {args.placement}, "
                         f"{args.selection} selection; it holds {have}")
    return match[0]


def _import(args) -> int:
    from ..thresholds import import_reference_text
    from .model import load_config

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
    path = args.out.replace("{k}", str(ts.k)).replace("{placement}", ts.placement).replace("{selection}", "head")
    check_output_file(path, "--out")
    path = ts.save(path)
    print(f"wrote {path}: {ts.summary()}")
    return 0
