"""``turbo-dispatch db show|validate|prune|merge``: inspect and maintain tuning DB files.

``db show FILE`` prints one row per entry (with the winner's time, its device and host time per
call where the tuner measured them, and how it compares with the high-precision op where that
was timed) and its verdict for this machine, then ``N entries
(... skipped, and why)``; ``db validate FILE...`` exits 1 on problems; ``db prune FILE`` drops
entries stale for this machine; ``db merge -o OUT IN...`` merges files."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import UsageError, readable_db_file, table


def add_parser(sub) -> None:
    """Adds the ``db`` command and its actions to the top-level subparsers ``sub``."""
    db = sub.add_parser("db", help="inspect and maintain tuning DB files")
    db_sub = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    show = db_sub.add_parser("show", help="one row per entry and its verdict for this machine")
    show.add_argument("file", type=Path)
    show.set_defaults(func=_cmd_show)
    validate = db_sub.add_parser("validate", help="exit 1 if a file has unreadable lines or stale entries")
    validate.add_argument("files", type=Path, nargs="+")
    validate.set_defaults(func=_cmd_validate)
    prune = db_sub.add_parser("prune", help="drop the entries that are stale for this machine")
    prune.add_argument("file", type=Path)
    prune.add_argument("--foreign", action="store_true", help="also drop entries tuned on other machines")
    prune.add_argument("--min-speedup", type=float, default=None, metavar="X",
                       help="also drop entries whose winner was not at least X times faster than the op's "
                            "default in its own profile (keys left out run the default)")
    prune.set_defaults(func=_cmd_prune)
    merge = db_sub.add_parser("merge", help="merge files into OUT (per key, a step result over a GEMM's, then the faster)")
    merge.add_argument("-o", "--output", type=Path, required=True)
    merge.add_argument("inputs", type=Path, nargs="+")
    merge.set_defaults(func=_cmd_merge)


def _cmd_show(args: argparse.Namespace) -> int:
    from ..tuning.report import inspect

    readable_db_file(args.file, "db show")
    report = inspect(args.file)
    rows = [[r.op, r.key, r.backend, str(r.config), f"{r.time_ms:.4f}", _us(r.gpu_us), _us(r.host_us), r.scope,
             _peer(r.peer, r.peer_ratio), r.gpu, r.status] for r in report.rows]
    if rows:
        print(table(["OP", "KEY", "BACKEND", "CONFIG", "MS", "GPU_US", "HOST_US", "TIMED", "VS_PEER", "GPU", "STATUS"],
                    rows, indent=""))
    if any(r.peer is not None for r in report.rows):
        print("VS_PEER: the high-precision op's default (op/BACKEND) and its time per call over this entry's, timed "
              "in turns on the same inputs (quantisation included); below 1x the fp8 op is slower on that key")
    print(report.summary())
    return 0


def _us(value: float | None) -> str:
    """A per-call time in microseconds as ``db show`` prints it; ``-`` where the entry has none."""
    return "-" if value is None else f"{value:.1f}"


def _peer(peer: str | None, ratio: float | None) -> str:
    """An entry's high-precision comparison as ``db show`` prints it, e.g. ``gemm/TORCH:0.97x``."""
    return "-" if peer is None or ratio is None else f"{peer}:{ratio:.2f}x"


def _cmd_validate(args: argparse.Namespace) -> int:
    from ..tuning.report import inspect, validate_problems

    status = 0
    for path in args.files:
        readable_db_file(path, "db validate")
    for path in args.files:
        report = inspect(path)
        problems = validate_problems(report)
        if problems:
            status = 1
            print(f"{path}: INVALID")
            for problem in problems:
                print(f"  {problem}")
        else:
            print(f"{path}: ok, {report.summary()}")
    return status


def _cmd_prune(args: argparse.Namespace) -> int:
    from ..tuning.report import prune

    readable_db_file(args.file, "db prune")
    if args.min_speedup is not None and not args.min_speedup > 0:
        raise UsageError(f"db prune: --min-speedup must be a positive number, got {args.min_speedup}")
    removed, kept = prune(args.file, foreign_too=args.foreign, min_speedup=args.min_speedup)
    print(f"{args.file}: removed {removed} entr{'y' if removed == 1 else 'ies'}, kept {kept}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from ..tuning.report import merge

    for path in args.inputs:
        readable_db_file(path, "db merge")
    written, warnings = merge(args.output, args.inputs)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"{args.output}: {written} entries after merging {len(args.inputs)} file(s)")
    return 0
