"""The ``turbo-dispatch`` command line: inspect backends and explain decisions.

Subcommands (one ``_cmd_*`` function each):

* ``turbo-dispatch backends``: every registered op x backend, whether it can run here and why
  not, each op's default per platform, plus the versions of everything a decision depends on.
* ``turbo-dispatch explain gemm --m 8192 --n 4096 --k 4096 --dtype bf16 [--fp8 rowwise]``: the
  Decision the resolver makes for one problem, built from shapes alone (no data is allocated).
* ``turbo-dispatch tune ...`` and ``turbo-dispatch db show|validate|prune|merge ...``: the tuning
  database (cli_tune.py).

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
import platform as _py_platform
import sys
from typing import Callable, Sequence

import torch

from .errors import TurboDispatchError

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_FP8_GRANULARITY = {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "blockwise", "mx": "mx_blockwise"}
_DEFAULT_BLOCK = {"blockwise": 128, "mx": 32}
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class UsageError(Exception):
    """A command-line combination that makes no sense; reported like any other error."""


# -- helpers -----------------------------------------------------------------------------------------
def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """Plain-text table with left-aligned columns (the last column is not padded)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [str(c).ljust(w) for c, w in zip(cells[:-1], widths)] + [str(cells[-1])]
        return (indent + "  ".join(padded)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _safe(call: Callable[[], str]) -> str:
    """The result of a probe, or a short note when the probe itself fails."""
    try:
        return str(call())
    except Exception as exc:  # an adapter or library probe must not take the listing down
        return f"? ({type(exc).__name__}: {exc})"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


# -- backends ----------------------------------------------------------------------------------------
def _versions() -> list[tuple[str, str]]:
    """Everything a backend decision (and a tuning result) depends on, as (name, value) rows."""
    from . import __version__
    from .device_platform import default_platform

    if getattr(torch.version, "hip", None):
        runtime = f"HIP {torch.version.hip}"
    elif torch.version.cuda:
        runtime = f"CUDA {torch.version.cuda}"
    else:
        runtime = "none (CPU-only torch build)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    except Exception as exc:  # e.g. a broken install: report it, do not crash
        triton_version = f"import failed ({type(exc).__name__}: {exc})"
    rows = [
        ("turbo_dispatch", __version__),
        ("python", _py_platform.python_version()),
        ("torch", torch.__version__),
        ("torch GPU runtime", runtime),
        ("triton", triton_version),
    ]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index in range(gpus):
        props = torch.cuda.get_device_properties(index)
        arch = getattr(props, "gcnArchName", None) if torch.version.hip else None
        arch = arch or f"compute capability {props.major}.{props.minor}"
        rows.append((f"gpu {index}", f"{props.name}, {arch}, {props.multi_processor_count} SMs"))
    if not gpus:
        rows.append(("gpu", "none visible to torch"))
    rows.append(("platform", f"{default_platform()} ({_py_platform.platform()})"))
    return rows


def _cmd_backends(args: argparse.Namespace) -> int:
    from .op_spec import KNOWN_OPS
    from .device_platform import default_platform
    from .registry import get_registry

    registry = get_registry()
    here = default_platform()
    rows = []
    for op in sorted(registry.entries):
        for entry in registry.backends(op):
            if here not in entry.platforms:
                status, reason = "no", f"not registered for platform {here}"
            else:
                reason = entry.available()
                status = "available" if reason is None else "unavailable"
            default_on = [p for p in entry.platforms if registry.default(op, p) == entry.name]
            mark = "*" if here in default_on else ""
            library = str(getattr(entry.adapter, "library", "unknown"))
            rows.append([mark, op, entry.name, ",".join(entry.platforms), status,
                         ",".join(default_on) or "-", library, _safe(entry.adapter.version), reason or ""])
    print(f"backends (this machine's platform: {here}; * = the op's default here)")
    if rows:
        headers = ["", "OP", "BACKEND", "PLATFORMS", "STATUS", "DEFAULT ON", "LIBRARY", "VERSION", "REASON"]
        print(_table(headers, rows))
    else:
        print("  (no backend registered)")

    missing = sorted(KNOWN_OPS - set(registry.entries))
    if missing:
        print("\nnot implemented yet (no registered backend):")
        print("\n".join(f"  {op}" for op in missing))

    print("\nversions:")
    print(_table(["COMPONENT", "VERSION"], _versions()))
    return 0


# -- explain -----------------------------------------------------------------------------------------
def _device_arg(requested: str | None) -> str:
    """The device type of a ``--device`` option (explain, tune): the GPU when torch sees one, else
    the CPU; asking for cuda without a GPU is a usage error."""
    if requested is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        # Adapters probe the live device (arch, library) to decide, so there is nothing to ask.
        raise UsageError("--device cuda: torch sees no GPU on this machine (torch.cuda.is_available() is False)")
    return requested


def _fp8_config(args: argparse.Namespace):
    from .low_precision import Float8QuantConfig

    if args.fp8 is None:
        if args.format is not None or args.block_size is not None:
            raise UsageError("--format and --block-size describe an fp8 recipe; add --fp8 GRANULARITY")
        return None
    block_size = args.block_size if args.block_size is not None else _DEFAULT_BLOCK.get(args.fp8)
    return Float8QuantConfig(
        format=args.format or "e4m3",
        granularity=_FP8_GRANULARITY[args.fp8],
        scale_dtype="e8m0" if args.fp8 == "mx" else "fp32",
        block_size=block_size,
    )


def _gemm_problem(args: argparse.Namespace):
    """The gemm / gemm_fp8 problem key from shapes alone: operands live on the meta device."""
    from .device_platform import platform_of
    from .op_spec import get_op_spec

    device = _device_arg(args.device)
    dtype, out_dtype = _DTYPES[args.dtype], _DTYPES.get(args.out_dtype)
    a = torch.empty((args.k, args.m) if args.trans_a else (args.m, args.k), dtype=dtype, device="meta")
    b = torch.empty((args.n, args.k) if args.trans_b else (args.k, args.n), dtype=dtype, device="meta")
    config = _fp8_config(args)
    if config is None:
        op, problem = "gemm", get_op_spec("gemm").problem_from_call(a, b, args.trans_a, args.trans_b, out_dtype)
    else:
        op = "gemm_fp8"
        problem = get_op_spec(op).problem_from_call(a, b, args.trans_a, args.trans_b, out_dtype, config=config)
    # The builders take the platform from the operands' device, which is "meta" here.
    return op, problem._replace(platform=platform_of(device))


_PROBLEM_FROM_ARGS = {"gemm": _gemm_problem}


def _cmd_explain(args: argparse.Namespace) -> int:
    from .op_spec import get_op_spec
    from .resolver import resolve

    op, problem = _PROBLEM_FROM_ARGS[args.op](args)
    print(resolve(get_op_spec(op), problem))
    return 0


# -- parser and entry point --------------------------------------------------------------------------
def _add_gemm_explain(sub) -> None:
    p = sub.add_parser("gemm", help="gemm, or gemm_fp8 with --fp8", description=(
        "Explain C[m, n] = op(A)[m, k] @ op(B)[k, n]; with --fp8, the gemm_fp8 forward GEMM."))
    p.add_argument("--m", type=_positive_int, required=True)
    p.add_argument("--n", type=_positive_int, required=True)
    p.add_argument("--k", type=_positive_int, required=True)
    p.add_argument("--dtype", choices=list(_DTYPES), default="bf16", help="input dtype (default: bf16)")
    p.add_argument("--out-dtype", choices=list(_DTYPES), default=None, help="default: the input dtype")
    p.add_argument("--trans-a", action="store_true", help="A is stored [k, m]")
    p.add_argument("--trans-b", action="store_true", help="B is stored [n, k]")
    p.add_argument("--fp8", choices=list(_FP8_GRANULARITY), default=None, help="scaling granularity: selects gemm_fp8")
    p.add_argument("--format", choices=["e4m3", "e5m2", "hybrid"], default=None, help="fp8 format (default: e4m3)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="fp8 block size (default: 128 for blockwise, 32 for mx)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="platform to explain for (default: cuda when torch sees a GPU, else cpu)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turbo-dispatch",
        description="Inspect turbo_dispatch backends, explain backend decisions, tune and manage tuning DBs.")
    parser.add_argument("--log-level", choices=_LOG_LEVELS, default="warning",
                        help="logging level of turbo_dispatch's loggers (default: warning)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    backends = sub.add_parser("backends", help="list backends per op, their availability, and versions")
    backends.set_defaults(func=_cmd_backends)

    explain = sub.add_parser("explain", help="show the backend decision for one problem")
    explain.set_defaults(func=_cmd_explain)
    ops = explain.add_subparsers(dest="op", required=True, metavar="OP")
    _add_gemm_explain(ops)

    from .cli_tune import add_parsers

    add_parsers(sub)
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


if __name__ == "__main__":
    raise SystemExit(main())
