"""``turbo-dispatch tune``: tunes every key of one training step of the model presets (or the keys
a job recorded) and merges the winners into the writable tuning DB, then prints each winner
against the op's default. ``--distributed`` under torchrun shards the keys over ranks."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

from .common import UsageError, device_arg, positive_int, readable_db_file, table

# The help text the command has always shown (it names the db commands too).
_DESCRIPTION = """\
* ``turbo-dispatch tune --model llama3.1-8b --ops gemm,gemm_fp8``: tunes every key of one
  training step of the model presets (or ``--from-recorded FILE``) and merges the winners into
  the writable tuning DB (``--db``, default: the one in force). Prints a summary table of each
  winner against the op's default. ``--distributed`` under torchrun shards the keys over ranks.
* ``turbo-dispatch db show FILE``: one row per entry with its verdict for this machine, then
  ``N entries (... skipped, and why)``. ``db validate FILE...`` exits 1 on problems; ``db prune
  FILE`` drops entries stale for this machine; ``db merge -o OUT IN...`` merges files."""


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def add_parser(sub) -> None:
    """Adds the ``tune`` command to the top-level subparsers ``sub``."""
    from ..tuning.keys import FP8_GRANULARITIES, OPS

    tune = sub.add_parser("tune", help="tune the keys of model presets (or a recorded file) into a tuning DB",
                          description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_argument("--model", type=_csv, default=None,
                      help="comma-separated presets (see --list-models); default: llama3.1-8b on a GPU, tiny on CPU")
    tune.add_argument("--ops", type=_csv, default=list(OPS), help=f"comma-separated ops (default: {','.join(OPS)})")
    tune.add_argument("--from-recorded", type=Path, default=None, metavar="FILE",
                      help="tune the keys a job recorded with PRIMUS_TURBO_RECORD_UNTUNED=FILE")
    tune.add_argument("--micro-batches", type=_ints, default=[1], help="e.g. 1,2,4 (default: 1)")
    tune.add_argument("--seq-len", type=positive_int, default=None, help="default: the preset's")
    tune.add_argument("--fp8", type=_csv, default=list(FP8_GRANULARITIES),
                      help=f"fp8 granularities for the *_fp8 ops (default: {','.join(FP8_GRANULARITIES)})")
    tune.add_argument("--ep", type=positive_int, default=8, help="expert parallelism for MoE presets (default 8)")
    tune.add_argument("--tokens-per-expert", type=positive_int, default=4096)
    tune.add_argument("--db", type=Path, default=None, help="DB to write (default: the writable DB in force)")
    tune.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when a GPU is visible")
    tune.add_argument("--force", action="store_true", help="re-tune keys that already have a stored result")
    tune.add_argument("--step", action="store_true",
                      help="tune the grouped ops by whole training steps of each layer (forward, dgrad and wgrad "
                           "choices timed together) instead of one GEMM at a time")
    tune.add_argument("--min-speedup", type=float, default=1.02, metavar="X",
                      help="with --step: store a layer's choices only where its tuned step, timed in turns with "
                           "the default step, ran faster in every round and at least X times faster in the median "
                           "(default 1.02)")
    tune.add_argument("--step-budget-ms", type=float, default=100.0, metavar="MS",
                      help="with --step: time spent timing each candidate step (at least 5 steps; default 100)")
    tune.add_argument("--distributed", action="store_true", help="under torchrun: shard keys over ranks")
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    tune.add_argument("--list-models", action="store_true", help="list the model presets and exit")
    tune.set_defaults(func=_cmd_tune)


def init_distributed(gpu: bool | None = None) -> bool:
    """Joins the torchrun job; True when this call made the process group (a caller's own group
    is left to the caller). ``gpu``: each rank on its own GPU (LOCAL_RANK) over NCCL; else gloo
    on the CPU, where a rank needs no GPU of its own (default: a GPU when torch sees one)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UsageError("--distributed needs torchrun (RANK and WORLD_SIZE are not set)")
    gpu = torch.cuda.is_available() if gpu is None else gpu
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if torch.distributed.is_initialized():
        return False
    torch.distributed.init_process_group("nccl" if gpu else "gloo")
    return True


def _cmd_tune(args: argparse.Namespace) -> int:
    from ..presets import MODELS

    if args.list_models:
        for name, model in MODELS.items():
            print(f"{name:16s} {model.note or ''}")
        return 0
    if not args.distributed:
        return _tune(args)
    # `tune --device cpu` under torchrun takes gloo: binding every rank to a GPU would fail
    # ("invalid device ordinal") on a machine with fewer GPUs than ranks.
    made_group = init_distributed(device_arg(args.device) == "cuda")
    try:
        return _tune(args)
    finally:
        # Without it, a rank could exit with gloo's threads still running and abort
        # ("terminate called without an active exception", SIGABRT), failing the whole torchrun
        # after the DB was written.
        if made_group:
            torch.distributed.destroy_process_group()


def _tune(args: argparse.Namespace) -> int:
    from ..device_platform import platform_of
    from ..manager import GlobalBackendManager
    from ..tuning import keys as key_sources
    from ..tuning import offline
    from ..tuning import step as step_tuner
    from ..tuning.step import STEP_OPS

    device = device_arg(args.device)
    platform = platform_of(device)
    db = args.db or GlobalBackendManager.get_tune_db()
    if db is None:
        raise UsageError("no writable tuning DB: PRIMUS_TURBO_TUNE_DB is off; pass --db FILE")
    for flag, value in (("--min-speedup", args.min_speedup), ("--step-budget-ms", args.step_budget_ms)):
        if not value > 0:
            raise UsageError(f"tune: {flag} must be a positive number, got {value}")
    stepped = [op for op in args.ops if op in STEP_OPS] if args.step else []
    if args.step and not stepped:
        raise UsageError(f"tune --step tunes {' and '.join(STEP_OPS)}; --ops names neither")
    layers = []
    if args.from_recorded is not None:
        if args.model is not None:
            raise UsageError("pass either --model or --from-recorded, not both")
        if args.step:
            raise UsageError("tune --step needs --model: a recorded key does not say which layer it belongs to")
        readable_db_file(args.from_recorded, "tune --from-recorded")
        keys = offline.recorded_keys(args.from_recorded)
        source = str(args.from_recorded)
    else:
        models = args.model or (["llama3.1-8b"] if device == "cuda" else ["tiny"])
        keys = []
        per_key = [op for op in args.ops if op not in stepped]
        for model in models:
            keys += key_sources.model_keys(model, per_key, platform, args.micro_batches, args.seq_len, args.fp8,
                                           args.ep, args.tokens_per_expert) if per_key else []
            layers += step_tuner.model_layers(model, stepped, args.fp8, args.ep, args.tokens_per_expert)
        keys = list(dict.fromkeys(keys))
        source = ",".join(models)
    rank = torch.distributed.get_rank() if args.distributed else 0
    if rank == 0:
        print(f"tuning {len(keys)} key(s)" + (f" and {len(layers)} layer(s) by steps" if args.step else "")
              + f" from {source} on {device} into {db}", file=sys.stderr)
    reports = offline.run(keys, db, force=args.force, progress=not args.no_progress,
                          distributed=args.distributed) if keys else []
    step_reports = step_tuner.run(layers, db, torch.device(device), force=args.force, progress=not args.no_progress,
                                  distributed=args.distributed, min_speedup=args.min_speedup,
                                  candidate_s=args.step_budget_ms / 1e3) if layers else []
    if rank != 0:
        return 0
    if args.step:
        _print_step_reports(step_reports, args.min_speedup)
        if not keys:
            failed = [r for r in step_reports if r.status == "failed"]
            return 1 if failed and len(failed) == len(step_reports) else 0
    rows = []
    for r in reports:
        speedup = f"{r.speedup:.2f}x" if math.isfinite(r.speedup) else "-"
        rows.append([r.op, r.key, r.status, r.winner, _ms(r.winner_ms), r.default, _ms(r.default_ms), speedup,
                     f"{r.seconds:.1f}"])
    print(table(["OP", "KEY", "STATUS", "WINNER", "MS", "DEFAULT", "DEFAULT MS", "SPEEDUP", "TUNE S"], rows))
    tuned = [r for r in reports if r.status == "tuned"]
    failed = [r for r in reports if r.status in ("failed", "no candidate")]
    total = sum(r.seconds for r in reports)
    print(f"{len(reports)} keys: {len(tuned)} tuned, {sum(r.status == 'stored' for r in reports)} already stored, "
          f"{len(failed)} failed; {total:.1f} s profiling"
          + (f" ({total / len(tuned):.2f} s per tuned key)" if tuned else ""))
    for r in failed:
        print(f"  {r.status}: {r.op} {r.key}: {r.note}")
    return 1 if failed and not tuned else 0


def _print_step_reports(reports, min_speedup: float) -> None:
    rows = []
    for r in reports:
        speedup = f"{r.speedup:.3f}x" if math.isfinite(r.speedup) else "-"
        winners = {role.role: role.winner + (" (held)" if role.held else "") for role in r.roles}
        rows.append([r.layer, r.status, _ms(r.default_ms), _ms(r.tuned_ms), speedup,
                     *(winners.get(role, "-") for role in ("forward", "dgrad", "wgrad"))])
    print(table(["LAYER", "STATUS", "DEFAULT STEP MS", "TUNED STEP MS", "SPEEDUP", "FORWARD", "DGRAD", "WGRAD"], rows))
    counts = {status: sum(r.status == status for r in reports)
              for status in ("tuned", "default kept", "held", "stored", "failed")}
    print(f"{len(reports)} layers by steps: {counts['tuned']} tuned (stored), {counts['default kept']} kept the "
          f"default (no confirmed gain of {min_speedup}x), {counts['held']} shared an earlier layer's keys, "
          f"{counts['stored']} already stored, {counts['failed']} failed; {sum(r.seconds for r in reports):.1f} s")
    for r in reports:
        if r.note and r.status != "stored":
            print(f"  {r.status}: {r.layer}: {r.note}")


def _ms(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "-"
