"""The `slidedp` command line: train, export, plan, inspect, report, calibrate."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
from pathlib import Path

from slidedp.budget import parse_with_unit
from slidedp.costmodel.hardware import LINKS, PRESETS as HARDWARE_PRESETS
from slidedp.errors import InsufficientMemoryError, NonFiniteGradientError, TrainingInterrupted, WorkerError
from slidedp.scheduler.plan import Plan
from slidedp.train.config import keys_help
from slidedp.train.shapes import PRESETS as MODEL_PRESETS

# Each subcommand imports what it alone needs when it runs (torch, transformers, the solver, the
# train job, the profiler, the report), so that `slidedp --help`, `inspect` and the others start
# without loading what they do not use.


def _train(args) -> int:
    from slidedp.train.config import load_config
    from slidedp.train.job import run

    run(load_config(args.config, args.overrides), verbose=args.verbose)
    return 0


def _export(args) -> int:
    from slidedp.train.export import export_checkpoint

    folder, step = export_checkpoint(args.checkpoint, args.out_dir, overwrite=args.overwrite, dtype=args.dtype)
    print(f"exported {folder} (step {step}, {args.dtype}) to {args.out_dir}: load it with "
          f"AutoModelForCausalLM.from_pretrained({str(args.out_dir)!r})")
    return 0


def _config_from_spec(spec: str):
    """The transformers config of a local Hugging Face folder or a preset shape name."""
    from transformers import AutoConfig

    from slidedp.train.shapes import preset_config

    return preset_config(spec) if not os.path.isdir(spec) else AutoConfig.from_pretrained(spec)


def _model_from_spec(spec: str):
    """A meta-device model from a local Hugging Face folder or a preset shape name."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config_from_spec(spec))


def _block_shape(spec: str, seq_len: int):
    """calibrate --model: the decoder block of a model (folder or preset) as the calibration's BlockShape."""
    from slidedp.profiler.calibrate import BlockShape

    c = _config_from_spec(spec)
    heads = c.num_attention_heads
    return BlockShape(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=heads,
                      num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, seq_len=seq_len)


def _grad_norm(value: str) -> float | None:
    """--max-grad-norm: a positive number, or "none" (no clipping, the default)."""
    if value.lower() == "none":
        return None
    try:
        norm = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'none', got {value!r}") from None
    if not norm > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'none', got {value!r}")
    return norm


def _link_arg(value: str | None):
    """--link: a preset name, a rate in bytes/s, or the JSON of `slidedp calibrate --link`."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    if value.endswith(".json") or Path(value).is_file():
        from slidedp.profiler.link import load_link

        return load_link(value)
    return value


def _plan(args) -> int:
    from slidedp import api

    parse_with_unit(args.budget, "--budget")
    model = _model_from_spec(args.model)
    plan = api.plan(model, args.budget, batch_size=args.batch_size, seq_len=args.seq_len,
                        world_size=args.world_size, precision=args.precision, hardware=args.hardware,
                        micro_batches=args.micro_batches, device="cpu" if args.hardware is None else "auto",
                        host_memory=args.host_memory, hosts=args.nodes, link=_link_arg(args.link),
                        max_grad_norm=args.max_grad_norm, nonfinite=args.nonfinite,
                        group_rows={"yes": True, "no": False}.get(args.group_rows, args.group_rows))
    plan.save(args.out)
    print(plan.summary())
    print(f"\nplan written to {args.out}")
    return 0


def _bench(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from slidedp.profiler.bench import run_bench, to_json
    from slidedp.train.shapes import preset_config

    parse_with_unit(args.budget, "--budget")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    precision = args.precision if args.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if os.path.isdir(args.model):
        model = AutoModelForCausalLM.from_pretrained(args.model, use_safetensors=True)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(preset_config(args.model))
    print(f"slidedp bench: {args.model} on {device.type} ({precision}), {args.steps} timed steps after a warm-up",
          file=sys.stderr)
    records = run_bench(model, budget=args.budget, tokens=args.tokens, batch_size=args.batch_size,
                        seq_len=args.seq_len, device=device, precision=precision, hardware=args.hardware,
                        steps=args.steps, progress=lambda line: print(line, flush=True))
    result = to_json(records)
    for r in result["ratios"]:
        vs = f"{r['slidedp_over_pytorch']:.2f}x PyTorch" if r["slidedp_over_pytorch"] else "PyTorch out of memory"
        print(f"{r['tokens_per_step']:>9,} tokens/step  slidedp {vs}; measured / predicted step "
              f"{r['measured_over_predicted']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _looks_like_a_plan(path) -> None:
    """Refuse, in one line, a folder or a JSON file that is no plan at all (another JSON object:
    a config, a trainer state); what Plan.load says of a damaged plan stays its own."""
    if os.path.isdir(path):
        raise ValueError(f"{path} is a folder, not a plan file (a plan is the JSON that `slidedp plan` writes)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return  # Plan.load names what is wrong with it
    if isinstance(data, dict) and "schema_version" not in data and "schedule" not in data:
        raise ValueError(f"{path} is not a slidedp plan (a JSON object without schema_version or schedule; a "
                         "plan is the JSON that `slidedp plan` or Plan.save writes)")


def _load_plan_warning(path) -> Plan:
    """The plan of `path`, and a warning line on stderr for what compile would refuse of it."""
    _looks_like_a_plan(path)
    plan = Plan.load(path)
    problems = plan.problems()
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(f"warning: compile would refuse {path}: {problems[0]}{more}", file=sys.stderr)
    return plan


def _inspect(args) -> int:
    plan = _load_plan_warning(args.plan)
    print(plan.summary())
    if args.hardware is not None:
        if args.model is None:
            raise ValueError("--hardware needs --model: the plan's model (a local Hugging Face folder or a preset "
                             "shape)")
        from slidedp import api

        step_s = api.predict(_model_from_spec(args.model), plan, hardware=args.hardware)
        print(f"\nunder {args.hardware}: {step_s * 1e3:.1f} ms a step for these decisions "
              f"(the plan's own hardware: {plan.predicted_step_time_s * 1e3:.1f} ms)")
    return 0


def _report(args) -> int:
    from slidedp.report import to_chrome_trace, to_html

    if not args.html and not args.trace:
        raise ValueError("nothing to write: give --html OUT.html and/or --trace OUT.json")
    plan = _load_plan_warning(args.plan)
    if not plan.timeline:
        print(f"note: {args.plan} has no predicted timeline (solver {plan.solver.get('method', '?')}); "
              "the report shows the totals and decisions only", file=sys.stderr)
    if args.html:
        to_html(plan, args.html)
        print(f"HTML report written to {args.html}")
    if args.trace:
        to_chrome_trace(plan, args.trace)
        print(f"Chrome trace written to {args.trace} (open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def _calibrate(args) -> int:
    if args.link:
        return _calibrate_link(args)
    if args.host_only:
        return _calibrate_host(args)
    from slidedp.profiler.calibrate import calibrate

    if args.seq_len is not None and args.model is None:
        raise SystemExit("slidedp calibrate: --seq-len goes with --model (the block whose rate is measured)")
    if args.base is not None and (args.model is None or args.step_fits is None):
        raise SystemExit("slidedp calibrate: --base goes with --model and --step-fits (only the blocks are timed)")
    say = lambda line: print(line, flush=True)  # noqa: E731
    shape = None if args.model is None else _block_shape(args.model, args.seq_len or 4096)
    profile = _base_profile(args.base, args.device) if args.base else calibrate(
        device=args.device, quick=args.quick, progress=say, model_shape=shape)
    if args.step_fits:
        from slidedp.costmodel.hardware import STEP_FITTED, with_step_fits
        from slidedp.profiler.calibrate import block_rate_ratio

        ratio = 1.0 if shape is None else block_rate_ratio(
            model_shape=shape, device=args.device, attention_flops_per_s=profile.attention_flops_per_s,
            quick=args.quick, progress=say)
        profile = with_step_fits(profile, args.step_fits, block_ratio=ratio, block=args.model)
        print(f"step fits       from {args.step_fits} (fitted on its steps, not measured here"
              + (f"; its compiled block rate times {ratio:.4f}, {args.model}'s block over the fitted one's"
                 if shape is not None else "") + "): "
              + ", ".join(f"{f} {getattr(profile, f):.4g}" for f in STEP_FITTED))
    profile.save(args.out)  # the JSON goes to the file only; stdout gets the measurements above and this
    print(f"\n{profile.name}: matmul {profile.matmul_flops_per_s / 1e12:.3g} TFLOP/s, H2D "
          f"{profile.h2d_bytes_per_s / 1e9:.3g} GB/s, D2H {profile.d2h_bytes_per_s / 1e9:.3g} GB/s, CPU AdamW "
          f"{profile.cpu_adamw_params_per_s / 1e9:.3g} G params/s")
    print(f"hardware profile written to {args.out} (use it with --hardware {args.out})")
    return 0


def _calibrate_host(args) -> int:
    from slidedp.costmodel.hardware import resolve_hardware
    from slidedp.profiler.calibrate import calibrate_host

    if args.model or args.step_fits or args.base:
        raise SystemExit("slidedp calibrate: --host-only measures only the host; --model, --step-fits and --base "
                         "go with a calibration of the GPU")
    try:
        base = resolve_hardware(args.host_only, "cpu")
    except (OSError, ValueError) as e:
        raise SystemExit(f"slidedp calibrate --host-only: {e}") from None
    profile = calibrate_host(base, device=args.device, quick=args.quick, progress=lambda line: print(line, flush=True))
    profile.save(args.out)
    print(f"\n{profile.name}: CPU AdamW {profile.cpu_adamw_params_per_s / 1e9:.3g} G params/s "
          f"(was {base.cpu_adamw_params_per_s / 1e9:.3g}), host DRAM {profile.host_dram_bytes_per_s / 1e9:.3g} GB/s")
    print(f"hardware profile written to {args.out} (use it with --hardware {args.out})")
    return 0


def _base_profile(path: str, device: str):
    """calibrate --base: a profile `slidedp calibrate` measured on this machine, without step fits."""
    import torch

    from slidedp.costmodel.hardware import Hardware
    from slidedp.profiler.calibrate import resolve_device

    profile = Hardware.load(path)
    dev = resolve_device(device)
    here = f"calibrated:{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}"
    if profile.name != here:
        raise SystemExit(f"slidedp calibrate --base: {path} is {profile.name!r}, not the measurements of this "
                         f"machine ({here}) alone")
    return profile


def _calibrate_link(args) -> int:
    import torch.distributed as dist

    from slidedp.profiler.link import measure_link

    out = "link.json" if args.out == "hardware.json" else args.out
    result = measure_link(parse_with_unit(args.link_bytes, "--link-bytes").device_bytes)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"link between {result['hosts']} hosts ({result['ranks_per_host']} rank(s) each, {result['backend']}): "
              f"{result['link_bytes_per_s'] / 1e9:.3g} GB/s per host (all-gather of "
              f"{result['nbytes'] / 2**20:.0f} MiB: median {result['median_s'] * 1e3:.1f} ms, IQR "
              f"{result['iqr_s'] * 1e3:.1f} ms)\nwritten to {out} (use it with slidedp plan --nodes "
              f"{result['hosts']} --link {out})", flush=True)
    dist.destroy_process_group()
    return 0


def _presets(names) -> str:
    return ", ".join(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slidedp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    model_help = (f"a local Hugging Face folder (a Hub model: download it first) or a preset shape with random "
                  f"weights: {_presets(MODEL_PRESETS)}")
    hardware_help = f"a preset ({_presets(HARDWARE_PRESETS)}) or a hardware profile JSON (slidedp calibrate)"

    p = sub.add_parser("train", help="fine-tune a model (no arguments: the embedded SmolLM2 default job)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Fine-tune a model: defaults, then the config file, then key=value overrides. "
                                   "A key may be given flat (lr=1e-4) or in its section (optimizer.lr=1e-4).",
                       epilog="config keys (section: key = default: meaning):\n" + keys_help())
    p.add_argument("config", nargs="?", help="YAML/TOML/JSON config file")
    p.add_argument("overrides", nargs="*", help="key=value overrides (the keys below)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print the plan's whole summary (every decision and why) before the first step; "
                        "without it, 3 lines (the run folder's plan.json has it all: slidedp inspect RUN/plan.json)")
    p.set_defaults(func=_train)

    p = sub.add_parser("export", help="a checkpoint (or a run folder's latest) to a Hugging Face folder")
    p.add_argument("checkpoint", help="a checkpoint folder, or a run's output_dir (its latest checkpoint)")
    p.add_argument("out_dir", help="the Hugging Face folder to write (not inside a run or checkpoint folder)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is not empty")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="the weights' dtype: bf16 (default, as the model was trained to run) or fp32 (the master "
                        "weights exactly, twice the size)")
    p.set_defaults(func=_export)

    p = sub.add_parser("plan", help="solve a plan offline (no GPU needed) and write it as JSON")
    p.add_argument("model", help=model_help)
    p.add_argument("--budget", required=True, help="device-memory budget per GPU, with a unit (e.g. 24GiB)")
    p.add_argument("--batch-size", type=int, required=True, help="rows (sequences) per micro-batch and rank")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per row")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches sharing one pass over the weights (default 1)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto (default): bf16 for a GPU hardware profile, fp32 for the CPU")
    p.add_argument("--hardware", default=None, help=hardware_help + " (default: cpu)")
    p.add_argument("--host-memory", default=None,
                   help="host RAM available on the machine the plan is for (e.g. 500GiB), per host: bounds activation "
                        "offload there (default: unbounded)")
    p.add_argument("--nodes", type=int, default=1,
                   help="hosts the --world-size ranks span, as torchrun --nnodes (default 1)")
    p.add_argument("--link", default=None,
                   help=f"with --nodes > 1: each host's link into the network, one of {', '.join(LINKS)}, bytes/s, "
                        "or the JSON of slidedp calibrate --link")
    p.add_argument("--max-grad-norm", type=_grad_norm, default=None,
                   help="exact global clipping the run will use (default: none, which allows early updates)")
    p.add_argument("--nonfinite", choices=("skip", "stop"), default="skip",
                   help="a non-finite gradient: skip the step (default) or stop; stop, without clipping, lets the "
                        "plan stream the gradients into the update (no gradient in host RAM) or write its early "
                        "updates in place (no spare state)")
    p.add_argument("--group-rows", nargs="?", choices=("auto", "yes", "no"), const="yes", default="auto",
                   help="let the plan group the --batch-size x --micro-batches rows of a rank's step into micro-batches "
                        "of another number of rows, the fastest predicted (each grouping solved; the plan says which); "
                        "auto (default): where the blocks are host-bound; no: keep the asked grouping")
    p.add_argument("--out", default="plan.json", help="where to write the plan (default plan.json)")
    p.set_defaults(func=_plan)

    p = sub.add_parser("inspect", help="print a plan's summary")
    p.add_argument("plan", help="plan JSON (from `slidedp plan` or Plan.save)")
    p.add_argument("--hardware", default=None,
                   help=hardware_help + ": also the step these decisions take under it (needs --model)")
    p.add_argument("--model", default=None, help="with --hardware: the plan's model, " + model_help)
    p.set_defaults(func=_inspect)

    p = sub.add_parser("report", help="draw a plan: self-contained HTML report and/or Chrome trace JSON")
    p.add_argument("plan", help="plan JSON (from `slidedp plan` or Plan.save)")
    p.add_argument("--html", metavar="OUT.html", help="write the HTML report here")
    p.add_argument("--trace", metavar="OUT.json", help="write the Perfetto / chrome://tracing JSON here")
    p.set_defaults(func=_report)

    p = sub.add_parser("calibrate", help="measure this machine into a hardware profile JSON (for --hardware)")
    p.add_argument("--out", default="hardware.json", help="where to write the profile (default hardware.json)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="what to measure")
    p.add_argument("--quick", action="store_true", help="small sizes: seconds instead of minutes, rougher figures")
    p.add_argument("--link", action="store_true",
                   help="measure the link between hosts instead: run on every host under torchrun --nnodes N "
                        "(N >= 2); writes link.json (or --out) for slidedp plan --link")
    p.add_argument("--link-bytes", default="256MiB", help="with --link: the all-gather's size (default 256MiB)")
    p.add_argument("--model", help="measure the block efficiency on this model's decoder block (a local Hugging "
                                   "Face folder or a preset shape; default a Qwen3-4B block), as a Qwen3 block "
                                   "of its sizes")
    p.add_argument("--seq-len", type=int, help="with --model: tokens per row of the measured block (default 4096)")
    p.add_argument("--step-fits", choices=["h200-sxm"],  # the one preset fitted on measured steps
                   help="take the coefficients that only whole steps fit (the CPU AdamW's share in a step, the "
                        "host's issue times, the head's and a compiled block's rate in a step) from this preset "
                        "instead of leaving them unknown; with --model, the compiled block's rate scaled by the "
                        "model's block over the fitted (Qwen3-4B) one, both timed here")
    p.add_argument("--base", metavar="PROFILE", help="with --model and --step-fits: time only the two blocks and "
                   "take the rest from PROFILE, this machine's `slidedp calibrate` output without step fits")
    p.add_argument("--host-only", metavar="PROFILE", help="measure only this host (its CPU AdamW, DRAM and the "
                   "engine's time to issue a block; under a minute) and take the GPU's figures from PROFILE (a "
                   "preset or profile JSON): for a host unlike the one PROFILE was measured on")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("bench", help="throughput against plain PyTorch in the same process; predicted vs measured")
    p.add_argument("model", help=model_help)
    p.add_argument("--budget", required=True, help="slidedp's device-memory budget, with a unit (e.g. 40GiB)")
    p.add_argument("--batch-size", type=int, default=1, help="rows per micro-batch (default 1)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per row")
    p.add_argument("--tokens", type=int, nargs="+", required=True, help="tokens per step (multiples of batch x seq)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="where to run (default auto)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto", help="auto: bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--hardware", default=None, help=hardware_help + " (default: detected)")
    p.add_argument("--out", help="write the records and ratios here (JSON)")
    p.set_defaults(func=_bench)

    argv = sys.argv[1:] if argv is None else list(argv)
    unknown = _unknown_command(argv, sub.choices)
    if unknown is not None:
        print(unknown, file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    _show_progress()
    # A config file given as `key=value` belongs to the overrides.
    if args.command == "train" and args.config and "=" in args.config:
        args.overrides.insert(0, args.config)
        args.config = None
    return _run_command(args)


def _unknown_command(argv: list[str], commands) -> str | None:
    """One line for a first word that is no subcommand, with the closest ones (None: it is one)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is None or first in commands or (argv and argv[0].startswith("-")):
        return None
    close = difflib.get_close_matches(first, commands, n=2)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return f"slidedp: error: unknown command {first!r}: {hint}(commands: {', '.join(commands)})"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def _show_progress() -> None:
    """slidedp's progress messages (the plan search, weights loading) on stderr, as "[slidedp] ..."."""
    logger = logging.getLogger("slidedp")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[slidedp] %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _run_command(args) -> int:
    """Run a subcommand; errors become one line on stderr and an exit status, never a traceback
    (SLIDEDP_DEBUG=1 re-raises them). 2: bad input (config, data, model, budget, plan, checkpoint,
    a missing file or package); 1: the run failed (repeated non-finite gradients, not enough memory,
    an unexpected error); 128 + N: stopped by signal N (SIGINT 130, SIGTERM 143)."""
    debug = os.environ.get("SLIDEDP_DEBUG", "") not in ("", "0")
    prefix = f"slidedp {args.command}"
    try:
        return args.func(args)
    except TrainingInterrupted as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except (NonFiniteGradientError, InsufficientMemoryError, WorkerError) as exc:
        if debug:
            raise
        print(f"{prefix}: error: {str(exc).splitlines()[0]}", file=sys.stderr)  # a rank's traceback follows
        return 1
    except (ValueError, TypeError, LookupError, OSError, ImportError) as exc:
        if debug:
            raise
        print(f"{prefix}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a bug: one line, and how to get the traceback
        if debug:
            raise
        print(f"{prefix}: internal error: {type(exc).__name__}: {_one_line(exc)} "
              "(run with SLIDEDP_DEBUG=1 for the traceback, and please report it)", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, KeyError) and exc.args:  # KeyError's str() is the quoted key only
        text = f"missing key {exc.args[0]!r}"
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
