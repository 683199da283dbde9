"""``turbo-dispatch explain OP ...``: the Decision the resolver makes for one problem, built from
shapes alone (no data is allocated), e.g. ``explain gemm --m 8192 --n 4096 --k 4096 --fp8 rowwise`` or
``explain grouped_gemm --groups 16 --tokens 65536 --n 2048 --k 768 --fp8 blockwise``."""
from __future__ import annotations

import argparse

import torch

from .common import UsageError, device_arg, positive_int, size_arg

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_FP8_GRANULARITY = {"tensorwise": "tensorwise", "rowwise": "rowwise", "blockwise": "blockwise", "mx": "mx_blockwise"}
_DEFAULT_BLOCK = {"blockwise": 128, "mx": 32}


def add_parser(sub) -> None:
    """Adds the ``explain`` command (one sub-command per op) to the top-level subparsers ``sub``."""
    explain = sub.add_parser("explain", help="show the backend decision for one problem")
    explain.set_defaults(func=_cmd_explain)
    ops = explain.add_subparsers(dest="op", required=True, metavar="OP")
    _add_gemm(ops)
    _add_grouped_gemm(ops)


def _add_gemm(sub) -> None:
    p = sub.add_parser("gemm", help="gemm, or gemm_fp8 with --fp8", description=(
        "Explain C[m, n] = op(A)[m, k] @ op(B)[k, n]; with --fp8, the gemm_fp8 forward GEMM."))
    p.add_argument("--m", type=size_arg, required=True)
    p.add_argument("--n", type=size_arg, required=True)
    p.add_argument("--k", type=size_arg, required=True)
    p.add_argument("--dtype", choices=list(_DTYPES), default="bf16", help="input dtype (default: bf16)")
    p.add_argument("--out-dtype", choices=list(_DTYPES), default=None, help="default: the input dtype")
    p.add_argument("--trans-a", action="store_true", help="A is stored [k, m]")
    p.add_argument("--trans-b", action="store_true", help="B is stored [n, k]")
    _add_fp8_args(p)


def _add_fp8_args(p) -> None:
    p.add_argument("--fp8", choices=list(_FP8_GRANULARITY), default=None,
                   help="scaling granularity: selects the fp8 op")
    p.add_argument("--format", choices=["e4m3", "e5m2", "hybrid"], default=None, help="fp8 format (default: e4m3)")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="fp8 block size (default: 128 for blockwise, 32 for mx)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="platform to explain for (default: cuda when torch sees a GPU, else cpu)")


def _add_grouped_gemm(sub) -> None:
    p = sub.add_parser("grouped_gemm", help="grouped_gemm, or grouped_gemm_fp8 with --fp8", description=(
        "Explain out[tokens, n] = a[tokens, k] @ b[g]^T per group (b stored [groups, n, k]; [groups, k, n] with "
        "--weight-kn); with --fp8, the grouped_gemm_fp8 forward GEMM. The key holds the token count, not how the "
        "tokens split over the groups."))
    p.add_argument("--groups", type=size_arg, required=True, help="experts (groups) of the weight")
    p.add_argument("--tokens", type=size_arg, required=True, help="rows of a: the tokens of every group together")
    p.add_argument("--n", type=size_arg, required=True)
    p.add_argument("--k", type=size_arg, required=True)
    p.add_argument("--dtype", choices=list(_DTYPES), default="bf16", help="input dtype (default: bf16)")
    p.add_argument("--out-dtype", choices=list(_DTYPES), default=None,
                   help="with --fp8: the output dtype (default: the input dtype)")
    p.add_argument("--weight-kn", action="store_true", help="b is stored [groups, k, n] (trans_b=False)")
    _add_fp8_args(p)


def _fp8_config(args: argparse.Namespace):
    from ..low_precision import Float8QuantConfig

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
    from ..device_platform import platform_of
    from ..op_spec import get_op_spec

    device = device_arg(args.device)
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


def _grouped_gemm_problem(args: argparse.Namespace):
    """The grouped_gemm / grouped_gemm_fp8 problem key from shapes alone (meta operands, group
    lengths that are never read)."""
    from ..device_platform import platform_of
    from ..op_spec import get_op_spec

    device = device_arg(args.device)
    dtype, out_dtype = _DTYPES[args.dtype], _DTYPES.get(args.out_dtype)
    trans_b = not args.weight_kn
    a = torch.empty((args.tokens, args.k), dtype=dtype, device="meta")
    b = torch.empty((args.groups, args.n, args.k) if trans_b else (args.groups, args.k, args.n), dtype=dtype,
                    device="meta")
    lens = torch.empty((args.groups,), dtype=torch.int64, device="meta")
    config = _fp8_config(args)
    if config is None:
        if out_dtype is not None:
            raise UsageError("--out-dtype applies to the fp8 op; add --fp8 GRANULARITY")
        op, problem = "grouped_gemm", get_op_spec("grouped_gemm").problem_from_call(a, b, lens, trans_b=trans_b)
    else:
        op = "grouped_gemm_fp8"
        problem = get_op_spec(op).problem_from_call(a, b, lens, trans_b=trans_b, out_dtype=out_dtype, config=config)
    return op, problem._replace(platform=platform_of(device))


_PROBLEM_FROM_ARGS = {"gemm": _gemm_problem, "grouped_gemm": _grouped_gemm_problem}


def _cmd_explain(args: argparse.Namespace) -> int:
    from ..op_spec import get_op_spec
    from ..resolver import resolve

    op, problem = _PROBLEM_FROM_ARGS[args.op](args)
    print(resolve(get_op_spec(op), problem))
    return 0
