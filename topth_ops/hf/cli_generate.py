"""``topth-ops generate``: greedy generation with Top-Theta attention; prints the text
and the V-row and k~/k statistics of the decode steps."""

from __future__ import annotations

import argparse
import time

from .cli_common import add_model_argument, check_backend, fail, plural, show_progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    p.add_argument("--thresholds", required=True, metavar="FILE", help="threshold file from `topth-ops calibrate`")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument("--backend", default=None, metavar="NAME",
                   help="decode-op backend (default: automatic; see `topth-ops info`)")
    p.add_argument("--sdc", default=None, choices=("none", "exact", "exp_threshold", "offline"),
                   help="softmax-denominator compensation (pre_softmax files; default: offline when "
                        "the file has an SDC table, else none)")
    p.add_argument("--no-vmc", action="store_true", help="disable V-mean compensation (on by default)")
    p.add_argument("--dense-prefill", action="store_true", help="keep the prompt (prefill) dense")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--compare-dense", action="store_true", help="also generate densely and report agreement")
    p.add_argument("--threshold-set", type=int, default=None, metavar="I",
                   help="which threshold set of a file of several (e.g. k=16,32,64 from one calibration) to use")
    p.add_argument("--quiet", action="store_true", help="no progress bars while the model loads")


def run(args: argparse.Namespace) -> int:
    from .model import ModelNotAvailable

    try:
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        check_backend(args.backend)
        from ..rowstats import StatsCollector, length_buckets
        from ..thresholds import load_thresholds
        from .attention import TopthSettings, disable, enable
        from .model import load_model
        from .runner import greedy

        if not args.prompt:
            raise ValueError("--prompt is empty")
        ts = load_thresholds(args.thresholds, args.threshold_set)
        sdc = args.sdc or ("offline" if ts.sdc_table is not None else "none")
        settings = TopthSettings(mode="topth", thresholds=ts, sdc=sdc, vmc=not args.no_vmc,
                                 prefill="dense" if args.dense_prefill else "thresholded", backend=args.backend)
        try:  # before the model loads: --sdc against the file's placement and SDC table
            settings.resolved(len(ts.layer_k))
        except ValueError as e:
            raise ValueError(f"--sdc {sdc} with {args.thresholds!r}: {e}") from None
        lm = load_model(args.model, progress=show_progress(args))
        tok = lm.tokenizer
        if args.chat:
            prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                             add_generation_prompt=True)
        else:
            prompt = args.prompt
        from .texts import bos_ids

        ids = tok(prompt, add_special_tokens=False).input_ids
        if not args.chat:
            ids = bos_ids(tok) + ids
        if not ids:
            raise ValueError("--prompt is empty after tokenization")
        ctx = lm.max_context
        if ctx and len(ids) + args.max_new_tokens > ctx:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds the "
                f"model's context of {ctx} tokens")
        c = lm.config
        stats = StatsCollector(int(c.num_hidden_layers), int(c.num_attention_heads),
                               int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads))
        dense_out = None
        if args.compare_dense:
            dense_out, _ = greedy(lm.model, ids, args.max_new_tokens, eos_token_id=tok.eos_token_id)
        ctl = enable(lm.model, settings, decode_stats=stats)
        t0 = time.time()
        try:
            out, _ = greedy(lm.model, ids, args.max_new_tokens, eos_token_id=tok.eos_token_id)
        finally:
            disable(lm.model)
        dt = time.time() - t0
        print(prompt + tok.decode(out, skip_special_tokens=True))
        print()
        print(f"{ts.summary()}")
        print(f"settings: placement={ts.placement} sdc={sdc} vmc={not args.no_vmc} "
              f"backend={args.backend or 'auto'}; {len(out)} tokens in {dt:.1f} s")
        layer_k = ctl.settings.layer_k
        at_k = [i for i, k in enumerate(layer_k) if k == ts.k]
        if stats.num_rows():
            ktk, ktk_rows = stats.k_tilde_over_k(layer_k)
            print(f"decode steps: V rows read {stats.v_rows_frac():.3f} of dense (all layers), "
                  f"{stats.v_rows_frac(layers=at_k):.3f} ({plural(len(at_k), 'layer')} at k={ts.k}); attention "
                  f"kept {stats.attn_kept_frac():.3f}; k~/k "
                  + (f"{ktk:.3f}" if ktk_rows else "n/a (no decode row longer than its layer's k)"))
            for lo, hi in length_buckets(stats.R):
                r, rows = stats.k_tilde_over_k(layer_k, lo, hi)
                if rows:
                    print(f"  rows ({lo},{hi}]: k~/k {r:.3f}, V rows {stats.v_rows_frac(lo, hi):.3f}")
        if dense_out is not None:
            same = sum(int(a == b) for a, b in zip(out, dense_out))
            print(f"agreement with dense greedy: {same}/{max(len(out), len(dense_out))} tokens")
        return 0
    except (ValueError, OSError, ModelNotAvailable, NotImplementedError) as e:
        return fail(str(e))
