"""The ``turbo-dispatch`` command line: inspect backends, explain decisions, tune and manage tuning DBs.

One module per command group, each adding its parser through ``add_parser(sub)``:

* ``backends`` (backends.py): every registered op x backend, whether it can run here and why
  not, each op's default per platform, plus the versions of everything a decision depends on.
* ``explain gemm --m 8192 --n 4096 --k 4096 --dtype bf16 [--fp8 rowwise]`` (explain.py): the
  Decision the resolver makes for one problem, built from shapes alone (no data is allocated).
* ``tune ...`` (tune.py) and ``db show|validate|prune|merge ...`` (db.py): the tuning database.

Errors a user can cause (a bad ``PRIMUS_TURBO_*`` value, a pinned backend that cannot serve the
problem, an invalid fp8 recipe) print ``error: <message>`` to stderr and exit with status 2.

Example:
    >>> from turbo_dispatch.cli import main
    >>> main(["explain", "gemm", "--m", "64", "--n", "32", "--k", "16", "--device", "cpu"])  # doctest: +ELLIPSIS
    op:      gemm
    ...
    0
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from ..errors import TurboDispatchError
from . import backends, db, explain, tune
from .common import UsageError

__all__ = ["UsageError", "build_parser", "main"]

log = logging.getLogger(__name__)

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def build_parser() -> argparse.ArgumentParser:
    """The full ``turbo-dispatch`` parser; each command's ``func`` default runs it."""
    parser = argparse.ArgumentParser(
        prog="turbo-dispatch",
        description="Inspect turbo_dispatch backends, explain backend decisions, tune and manage tuning DBs.")
    parser.add_argument("--log-level", choices=_LOG_LEVELS, default="warning",
                        help="logging level of turbo_dispatch's loggers (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (backends, explain, tune, db):
        group.add_parser(sub)
    return parser


def _setup_logging(level_name: str) -> None:
    level = getattr(logging, level_name.upper())
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("turbo_dispatch").setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status (0 ok, 2 usage or configuration error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad arguments
        return exc.code if isinstance(exc.code, int) else 2
    _setup_logging(args.log_level)
    try:
        return args.func(args)
    except (TurboDispatchError, UsageError, ValueError, TypeError, OSError) as exc:
        log.debug("%s failed", args.command, exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        return 2
