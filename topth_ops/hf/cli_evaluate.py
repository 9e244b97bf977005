"""``topth-ops evaluate``: the main job. Calibrates (unless --thresholds files are given),
then measures dense, Top-Theta variants and exact top-k over a k sweep on HumanEval and
long standard-library documents; prints a table, writes JSON and PNG plots."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from pathlib import Path

from .cli_common import (
    add_calibration_arguments,
    add_model_argument,
    check_alpha,
    check_backend,
    check_context,
    check_extend_to,
    check_layer_k_syntax,
    check_layerwise,
    check_output_dir,
    check_output_file,
    check_sizes,
    fail,
    flat_k,
    note_short_text,
    parse_k_list,
    show_progress,
)

DEFAULT_KS = "16,32,96"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .evaluate import DEFAULT_FAMILIES, FAMILIES, EvalConfig

    d = EvalConfig()
    add_model_argument(p)
    p.add_argument("--thresholds", nargs="+", action="extend", metavar="FILE", default=None,
                   help="threshold files to evaluate (their k and placement); without it the "
                        "command calibrates for every --k first")
    p.add_argument("--k", type=parse_k_list, nargs="+", action="extend", default=None, metavar="K",
                   help=f"k sweep, e.g. '8,16,32' or '8 16 32' (default {DEFAULT_KS}; not with --thresholds)")
    p.add_argument("--variants", nargs="+", action="extend", default=None, metavar="NAME",
                   help=f"variant families (default {' '.join(DEFAULT_FAMILIES)}; known: {', '.join(FAMILIES)})")
    p.add_argument("--problems", type=int, default=d.problems, metavar="N",
                   help=f"HumanEval problems for teacher-forced perplexity (default {d.problems})")
    p.add_argument("--agreement-problems", type=int, default=d.agreement_problems, metavar="N",
                   help=f"HumanEval prompts for greedy agreement / decode V rows (default {d.agreement_problems})")
    p.add_argument("--agreement-tokens", type=int, default=d.agreement_tokens, metavar="N",
                   help=f"generated tokens per prompt (default {d.agreement_tokens})")
    p.add_argument("--long-docs", type=int, default=d.long_docs, metavar="N",
                   help=f"standard-library module sources for the long-context run (default {d.long_docs}; 0 = skip)")
    p.add_argument("--long-tokens", type=int, default=d.long_tokens, metavar="T",
                   help=f"tokens per long document (default {d.long_tokens}; perplexity over rows >= --long-min-row)")
    p.add_argument("--long-min-row", type=int, default=d.long_min_row, metavar="N",
                   help=f"long documents: perplexity and V rows over rows of at least N keys (default {d.long_min_row}; "
                        "--long-dense-prefix can raise it)")
    p.add_argument("--long-dense-prefix", type=int, default=d.long_dense_prefix, metavar="N",
                   help="long documents only: the first N rows attend densely, as a serving engine's own "
                        "prefill serves an N-token prompt, and only later rows are thresholded (its decode "
                        "rows, teacher-forced) and counted in k~/k; perplexity and V rows are over rows of at "
                        "least max(--long-min-row, N + 1) keys, and documents must have 256 tokens more than "
                        "that (default 0: every row thresholded)")
    p.add_argument("--backend", default=None, metavar="NAME", help="decode-op backend (default automatic)")
    p.add_argument("--json", required=True, metavar="OUT.json", help="write the records here")
    p.add_argument("--plots", metavar="DIR", default=None, help="write PNG plots here")
    p.add_argument("--thresholds-dir", metavar="DIR", default=None,
                   help="where calibrated threshold files go (default: <json dir>/thresholds)")
    add_calibration_arguments(p, prefix="calib-")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from .model import ModelNotAvailable

    try:
        return _run(args)
    except (ValueError, OSError, ModelNotAvailable, NotImplementedError) as e:
        return fail(str(e))


def _check_layerwise_variants(variants, no_sdc_table: bool) -> None:
    """Raise ValueError for a variant whose inference rule is not the one the layer-wise
    pass propagates with. The pass runs once per (placement, selection), with VMC and, for
    pre_softmax, the offline SDC when some variant uses it (and the table is computed):
    a variant with another rule would get thresholds calibrated on activations it never
    produces, and which ones would depend on the other variants listed."""
    from .evaluate import FAMILIES

    offline = not no_sdc_table and any(FAMILIES[f]["sdc"] == "offline" for f in variants)
    for f in variants:
        s = FAMILIES[f]
        if s["mode"] != "topth":
            continue
        sdc = "offline" if offline and s["placement"] == "pre_softmax" else "none"
        if s["vmc"] and s["sdc"] == sdc:
            continue
        raise ValueError(f"--layerwise-calibration calibrates each layer under one rule per placement (here "
                         f"{s['placement']} with sdc={sdc}, vmc=True), but variant {f} runs {s['placement']} "
                         f"with sdc={s['sdc']}, vmc={s['vmc']}: evaluate it in a separate run")


def _run(args) -> int:
    from .evaluate import DEFAULT_FAMILIES

    args.variants = list(dict.fromkeys(args.variants or DEFAULT_FAMILIES))  # order kept, no repeats
    check_backend(args.backend)
    for name in ("problems", "agreement_problems", "agreement_tokens", "long_docs", "long_tokens",
                 "long_dense_prefix"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.problems < 1:
        raise ValueError("--problems must be >= 1")
    if args.long_min_row < 1:  # the token a row of N keys predicts is token N; token 0 has no row
        raise ValueError(f"--long-min-row must be >= 1, got {args.long_min_row}")
    check_output_file(args.json, "--json")
    if args.plots is not None:
        check_output_dir(args.plots, "--plots")
    if args.thresholds and args.layerwise_calibration:
        raise ValueError("--layerwise-calibration applies when evaluate calibrates; with --thresholds the files "
                         "are used as they are (their summary says whether they were calibrated layer-wise)")
    if args.thresholds and args.calib_align != "stream":
        raise ValueError("--calib-align applies when evaluate calibrates; with --thresholds nothing is calibrated")
    if args.thresholds and args.calib_text:
        raise ValueError("--calib-text applies when evaluate calibrates; with --thresholds nothing is calibrated")
    if args.thresholds and args.k:
        raise ValueError("--k applies when evaluate calibrates; with --thresholds the files' sets give k")
    if args.thresholds and args.extend_to is not None:
        raise ValueError("--extend-to applies when evaluate calibrates; with --thresholds nothing is calibrated")
    if not args.thresholds:
        check_sizes(args, {"calib_samples": 1, "calib_max_tokens": 2})
        check_extend_to(args, "--calib-max-tokens")
        if args.calib_text:  # what calibration_texts refuses after the model loads, refused before it
            from .calib_sources import HUMANEVAL_SOURCE, check_sources
            from .texts import humaneval_problems

            check_sources(args.calib_text)
            if HUMANEVAL_SOURCE in args.calib_text:  # the evaluated problems are left out: some must remain
                every = len(humaneval_problems())
                if args.problems >= every:
                    raise ValueError(f"--calib-text {HUMANEVAL_SOURCE} leaves out the problems evaluate evaluates, "
                                     f"and --problems {args.problems} takes all {every}: give fewer "
                                     "--problems or another calibration text")
            if args.calib_samples < len(args.calib_text):
                raise ValueError(f"--calib-samples must be >= the number of --calib-text sources "
                                 f"({len(args.calib_text)}), got {args.calib_samples}")
        check_alpha(args.alpha)
        check_layerwise(args)
        if args.estimator == "count" and args.alpha != 0:
            raise ValueError("--alpha applies to --estimator mean (algorithm 1)")
        if args.estimator == "mean" and any("group" in f for f in args.variants):
            raise ValueError("group variants need --estimator count")
        check_layer_k_syntax(args.layer_k)
        tdir = Path(args.thresholds_dir or Path(args.json).absolute().parent / "thresholds")
        check_output_dir(str(tdir), "--thresholds-dir")
    from .evaluate import FAMILIES, EvalConfig, dense_reference, evaluate_variant, make_variants, tokenize_texts

    for fam in args.variants:
        if fam not in FAMILIES:
            raise ValueError(f"unknown variant {fam!r}; known: {', '.join(FAMILIES)}")
    if not args.thresholds and args.layerwise_calibration:
        _check_layerwise_variants(args.variants, args.no_sdc_table)
    from tqdm.auto import tqdm

    from ..thresholds import load_threshold_sets, parse_layer_k, save_threshold_sets
    from .model import load_model
    from .report import format_table, group_vs_head, make_plots, num, pct
    from .texts import humaneval_problems, stdlib_documents

    cfg = EvalConfig(problems=args.problems, agreement_problems=min(args.agreement_problems, args.problems),
                     agreement_tokens=args.agreement_tokens, long_docs=args.long_docs,
                     long_tokens=args.long_tokens, long_min_row=args.long_min_row,
                     long_dense_prefix=args.long_dense_prefix, backend=args.backend)
    if cfg.long_dense_prefix and not cfg.long_docs:
        raise ValueError("--long-dense-prefix applies to the long documents; give --long-docs N (N >= 1) with it")
    if cfg.long_docs and cfg.long_tokens <= cfg.long_first_row:
        raise ValueError(f"--long-tokens must exceed {cfg.long_first_row} (perplexity is over rows >= "
                         f"{cfg.long_first_row}: --long-min-row, or the first row after --long-dense-prefix)")
    problems = humaneval_problems()  # read once: checked against, held out of calibration, scored
    if cfg.problems > len(problems):  # recorded as asked, so never fewer than asked
        raise ValueError(f"--problems {cfg.problems}: HumanEval has {len(problems)} problems; give at most that")
    problems = problems[:cfg.problems]
    problem_ids = [q["task_id"] for q in problems]
    files = [ts for f in args.thresholds for ts in load_threshold_sets(f)] if args.thresholds else []
    if files:
        from .calib_sources import humaneval_overlap

        for ts in files:
            seen = humaneval_overlap(ts.calibration_text, problem_ids)
            if seen:
                raise ValueError(f"{ts.path}: calibrated on HumanEval problems this evaluation uses ({seen[0]}"
                                 f"{f' and {len(seen) - 1} more' if len(seen) > 1 else ''}); let evaluate calibrate "
                                 "(it leaves its problems out) or use a calibration text without humaneval")
    variants = _file_variants(files, args.variants) if files else None  # checked before the model loads
    bars = show_progress(args)
    t_start = time.time()
    lm = load_model(args.model, progress=bars)
    if cfg.long_docs:
        check_context(cfg.long_tokens, "--long-tokens", lm.max_context)
    if not files:
        check_context(args.calib_max_tokens, "--calib-max-tokens", lm.max_context)
    for ts in files:
        ts.check_model(lm.config, lm.name)
    L = int(lm.config.num_hidden_layers)
    progress = (lambda it, desc: tqdm(it, desc=desc, leave=False)) if bars else (lambda it, desc: it)
    print(f"model {lm.name} loaded in {time.time() - t_start:.1f} s")

    long_docs = (stdlib_documents(lm.tokenizer, cfg.long_docs, cfg.long_first_row + 256, cfg.long_tokens)
                 if cfg.long_docs else [])
    thresholds: dict = {}
    calibration = None
    if files:
        ks = sorted({ts.k for ts in files})
    else:
        ks = flat_k(args.k) or parse_k_list(DEFAULT_KS)
        topth = [FAMILIES[f] for f in args.variants if FAMILIES[f]["mode"] == "topth"]
        placements = sorted({f["placement"] for f in topth})
        selections = sorted({f["selection"] for f in topth}, reverse=True)  # head first
        wanted = {(f["placement"], f["selection"]) for f in topth}  # calibrate computes every pair
        if placements:
            from .calib_sources import calibration_texts, mixed_samples
            from .calibrate import CalibrationText, calibrate

            held = [name for name, _ in long_docs] + problem_ids
            samples, desc = mixed_samples(lm.tokenizer, calibration_texts(args.calib_text, exclude=held),
                                          args.calib_samples, args.calib_max_tokens, align=args.calib_align)
            note_short_text(samples, args.calib_samples, args.calib_max_tokens)
            text = CalibrationText(samples, desc)
            targets = [parse_layer_k(args.layer_k, k, L) for k in ks]
            need_sdc = any(FAMILIES[f]["sdc"] == "offline" for f in args.variants) and not args.no_sdc_table
            t0 = time.time()
            sets = calibrate(lm.model, text, targets, placements, alpha=args.alpha,
                             topk_at_calibration=args.topk_at_calibration, sdc_table=need_sdc,
                             layerwise=args.layerwise_calibration, pairs=wanted,
                             model_name=lm.name, progress=bars, estimator=args.estimator,
                             selections=selections, extend_to=args.extend_to)
            for p in placements:  # one file per (placement, selection): the k's are its threshold sets
                for sel in selections:
                    if (p, sel) not in wanted:
                        continue
                    group = [sets[(i, p, sel)] for i in range(len(ks)) if (i, p, sel) in sets]
                    if group:
                        save_threshold_sets(tdir / f"{_slug(lm.name)}_{p}_{sel}.safetensors", group)
            sets = {key: ts for key, ts in sets.items() if key[1:] in wanted}
            for (i, p, sel), ts in sets.items():
                thresholds[(ks[i], p, sel)] = ts
            calibration = dict(text=text.description, samples=len(samples), tokens=text.tokens,
                               alpha=args.alpha, layer_k=args.layer_k, topk_at_calibration=args.topk_at_calibration,
                               layerwise=args.layerwise_calibration,
                               estimator=args.estimator, seconds=time.time() - t0,
                               files=sorted({ts.path for ts in sets.values()}))
            how = ", ".join(placements) + (", layer-wise" if args.layerwise_calibration else "")
            print(f"calibrated k={ks} ({how}) on {text.tokens} tokens in "
                  f"{calibration['seconds']:.0f} s; files in {tdir}")
        variants = make_variants(args.variants, ks, thresholds, lambda k: parse_layer_k(args.layer_k, k, L))

    texts = tokenize_texts(lm.tokenizer, cfg, problems, long_docs)
    t0 = time.time()
    dense = dense_reference(lm, texts, cfg, progress)
    print(f"dense: HumanEval ppl {dense['ppl']:.4f} over {dense['tokens']} solution tokens"
          + (f", long-doc ppl {dense['long_ppl']:.4f}" if long_docs else "") + f" ({time.time() - t0:.0f} s)")
    records = []
    for v in tqdm(variants, desc="variants", disable=not bars):
        rec = evaluate_variant(lm, v, texts, dense, cfg, progress)
        records.append(rec)
        print(f"{v.label}: ppl {rec['ppl']:.4f} ({pct(rec['ppl_rel_change'])}), V rows "
              f"{num(rec['v_rows_frac'])}, agreement {num(rec['token_agreement'])}, k~/k "
              f"{num(rec['k_tilde_over_k'], 2)}, long {pct(rec['long_ppl_rel_change'])} @ "
              f"{num(rec['long_v_rows_frac'])} ({rec['seconds']:.0f} s)")
    table = format_table(records, dense)
    print()
    print(table)
    gvh = group_vs_head(records)
    for c in gvh:
        sk = c["same_k"]
        print(f"{c['family']} k={c['k']}: {pct(c['ppl_rel_change'])} at V rows {num(c['v_rows_frac'])}"
              + (f"; per head at k={c['k']}: {pct(sk['ppl_rel_change'])} at {num(sk['v_rows_frac'])} "
                 f"({sk['ratio']:.2f}x)" if sk else "")
              + "".join(f"; per head k={p['k']} within 0.1 points: {pct(p['ppl_rel_change'])} at "
                        f"{num(p['v_rows_frac'])} ({p['ratio']:.2f}x)" for p in c["pairs"]))
    result = dict(
        model=lm.name, created=time.strftime("%Y-%m-%d %H:%M:%S"), python=platform.python_version(),
        config=dict(cfg.__dict__, long_first_row=cfg.long_first_row, variants=args.variants, k=ks),
        calibration=calibration,
        dense=dict(ppl=dense["ppl"], tokens=dense["tokens"], long_ppl=dense["long_ppl"],
                   long_tokens=dense["long_tokens"]),
        long_documents=[name for name, _ in long_docs],
        humaneval_tasks=[t for t, _, _ in texts.problems],
        records=records,
        group_vs_head=gvh,
        load_average=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        seconds=time.time() - t_start,
    )
    os.makedirs(Path(args.json).resolve().parent, exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(_clean(result), f, indent=1)
    print(f"\nwrote {args.json}")
    if args.plots:
        for p in make_plots(records, args.plots):
            print(f"wrote {p}")
    print(f"total {time.time() - t_start:.0f} s")
    return 0


def _file_variants(files: list, families: list) -> list:
    """Variants of the given threshold files: each file with every Top-Theta family of its
    placement (offline SDC only with a table), plus the top-k families at each file's k."""
    from .evaluate import FAMILIES, Variant

    seen: dict = {}
    for ts in files:
        key = (ts.k, ts.placement, ts.selection)
        if key in seen:
            same = os.path.realpath(seen[key].path) == os.path.realpath(ts.path) and \
                seen[key].set_index == ts.set_index
            raise ValueError(f"--thresholds {ts.path!r} is given twice" if same else
                             f"--thresholds {seen[key].path!r} and {ts.path!r} both hold k={ts.k} "
                             f"{ts.placement} {ts.selection}-selection thresholds; evaluate them in separate runs")
        seen[key] = ts
    variants = []
    for ts in files:
        for fam in families:
            spec = FAMILIES[fam]
            if spec["mode"] == "topth" and spec["placement"] == ts.placement and spec["selection"] == ts.selection \
                    and (spec["sdc"] != "offline" or ts.sdc_table is not None):
                variants.append(Variant(fam, ts.k, thresholds=ts))
    for k in sorted({ts.k for ts in files}):
        layer_k = next(ts.layer_k for ts in files if ts.k == k)
        variants += [Variant(f, k, layer_k=list(layer_k)) for f in families if FAMILIES[f]["mode"] == "topk"]
    if not variants:
        have = ", ".join(f"{ts.placement} {ts.selection}{' + SDC table' if ts.sdc_table is not None else ''}"
                         for ts in files)
        raise ValueError(f"no variant of --variants {' '.join(families)} applies to the --thresholds files "
                         f"({have}); e.g. topth-post-vmc needs post_softmax, topth-pre-offline-vmc "
                         "pre_softmax with an SDC table")
    return variants


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _clean(x):
    """JSON without NaN (null instead)."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x
