"""grouped_gemm and grouped_gemm_fp8: validation, problem keys, custom ops and autograd.

A grouped GEMM multiplies G row blocks of ``a`` (the tokens routed to each expert, laid out one
group after another) by G weight matrices: ``out[s_i:e_i] = a[s_i:e_i] @ op(b[i])``, with
``e_i - s_i = group_lens[i]``. Its backward has two shapes:

* dgrad is again a grouped GEMM: ``grad_a = grouped_gemm(grad, b, trans_b=not trans_b)``;
* wgrad is a *variable-K* grouped GEMM: ``grad_b[i] = a_i^T @ grad_i`` ([G, K, N]) or
  ``grad_i^T @ a_i`` ([G, N, K], trans_b), a reduction over each group's tokens. An empty group
  gets an exactly-zero weight gradient.

Both shapes are problems of the ``grouped_gemm`` op (``variable_k`` tells them apart), so the
resolver picks a backend for each GEMM of the step separately.

Group lengths are data: the problem key never reads them. It holds host-side facts only (G,
M_total, N, K, dtypes, trans_b, fp8 recipe, platform), so calls with different routings share
one key and one decision, and building the key works under CUDA graph capture and torch.compile.
The one check that needs the values (lengths non-negative, summing to M_total, group_offs
consistent) is ``check_group_lens_values``: eager calls run it (free on the CPU; one device->host
read on a GPU), and it is skipped while torch.compile traces or a CUDA graph is being captured.

Like gemm.py: eager calls take a fast path (resolve + run, or a torch.autograd.Function when
gradients are needed); under torch.compile the work goes through registered custom ops with fake
implementations and registered autograd. Both paths share the problem builders and the gradient
formulas.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple, Optional

import torch

from ..backend_type import PrecisionType
from ..device_platform import platform_of
from ..low_precision import Float8QuantConfig, ScalingGranularity
from ..op_spec import OpSpec, precision_of_dtype, register_op
from ..resolver import resolve
from ._common import check_rel, check_snr, require_bool, require_dtype, require_tensor
from .gemm import _platform, _same_device

_I64 = torch.int64
_HP = frozenset((torch.bfloat16, torch.float16, torch.float32))
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_new = tuple.__new__


class GroupedGemmProblem(NamedTuple):
    """Key of one grouped GEMM (bf16/fp16/fp32). Two kinds, told apart by ``variable_k``:

    * ``variable_k=False`` (forward, dgrad): ``a[m, k]`` with its m rows split into g groups,
      ``b[g, k, n]`` (``[g, n, k]`` with trans_b); out ``[m, n]``. m is M_total.
    * ``variable_k=True`` (wgrad): ``a[k, m]`` and ``b[k, n]``, both token-major with the k tokens
      split into g groups; out ``[g, m, n]``, ``out[i] = a_i^T @ b_i``. k is M_total; trans_b False.

    In both, 2*m*n*k is the FLOP count. Group lengths are not part of the key.
    """

    g: int
    m: int
    n: int
    k: int
    trans_b: bool
    variable_k: bool
    dtype: torch.dtype
    platform: str


class GroupedGemmFp8Problem(NamedTuple):
    """Key of one fp8 grouped GEMM; shapes as in GroupedGemmProblem.

    ``a_dtype``/``b_dtype`` are the high-precision inputs (quantised inside), ``a_fp8``/``b_fp8``
    their float8 dtypes (HYBRID backward mixes them). ``b_2d`` marks the weight quantised in
    block_size x block_size tiles per group (BLOCKWISE forward and dgrad); ``a`` is always quantised
    in 1 x block_size runs along the reduction dimension (K, or the tokens for variable_k).
    """

    g: int
    m: int
    n: int
    k: int
    trans_b: bool
    variable_k: bool
    a_dtype: torch.dtype
    b_dtype: torch.dtype
    out_dtype: torch.dtype
    a_fp8: torch.dtype
    b_fp8: torch.dtype
    granularity: ScalingGranularity
    block_size: Optional[int]
    b_2d: bool
    platform: str


_MX_REFUSED = ("grouped_gemm_fp8: config.granularity=MX_BLOCKWISE is not supported for grouped GEMMs; "
               "use TENSORWISE, ROWWISE or BLOCKWISE")
_A_HINT = "[M_total, K]"
_B_HINT = "[G, K, N] (or [G, N, K] with trans_b=True)"
_LENS_HINT = "[G] of int64 (tokens per group)"


# -- validation -----------------------------------------------------------------------------------
def _check_group_tensors(op: str, group_lens, group_offs, ref: torch.Tensor, ref_name: str) -> int:
    """Host-side checks of group_lens / group_offs (type, rank, dtype, device, length); returns G."""
    require_tensor(op, "group_lens", group_lens, 1, _LENS_HINT)
    if group_lens.dtype != _I64:
        raise TypeError(f"{op}: group_lens must be an int64 tensor {_LENS_HINT}; got {group_lens.dtype}")
    if group_lens.device != ref.device:
        raise ValueError(f"{op}: group_lens must be on {ref_name}'s device ({ref.device}); got {group_lens.device}")
    g = group_lens.shape[0]
    if group_offs is not None:
        hint = f"[G + 1] = [{g + 1}] of int32 or int64 (exclusive prefix sums of group_lens)"
        require_tensor(op, "group_offs", group_offs, 1, hint)
        if group_offs.dtype not in _OFFS_DTYPES:
            raise TypeError(f"{op}: group_offs must be an int32 or int64 tensor {hint}; got {group_offs.dtype}")
        if group_offs.shape[0] != g + 1:
            raise ValueError(f"{op}: group_offs must have G + 1 = {g + 1} entries; got shape {tuple(group_offs.shape)}")
        if group_offs.device != ref.device:
            raise ValueError(f"{op}: group_offs must be on {ref_name}'s device ({ref.device}); got {group_offs.device}")
    return g


def _fixed_shapes(op: str, a, b, group_lens, group_offs, trans_b) -> tuple[int, int, int, int]:
    """(g, m, n, k) of a fixed-K grouped GEMM, with every shape/type check that needs no tensor data."""
    require_tensor(op, "a", a, 2, _A_HINT)
    require_tensor(op, "b", b, 3, _B_HINT)
    require_bool(op, "trans_b", trans_b)
    if a.device != b.device:
        raise ValueError(f"{op}: a and b must be on the same device; got a on {a.device}, b on {b.device}")
    g = _check_group_tensors(op, group_lens, group_offs, a, "a")
    if b.shape[0] != g:
        raise ValueError(f"{op}: b has G={b.shape[0]} groups (b.shape[0]) but group_lens has {g} entries")
    n, k_b = (b.shape[1], b.shape[2]) if trans_b else (b.shape[2], b.shape[1])
    if a.shape[1] != k_b:
        raise ValueError(f"{op}: inner dimensions differ: a{tuple(a.shape)} gives K={a.shape[1]}, "
                         f"b{tuple(b.shape)} with trans_b={trans_b} gives K={k_b}")
    return g, a.shape[0], n, a.shape[1]


def _variable_shapes(op: str, x, y, group_lens, group_offs) -> tuple[int, int, int, int]:
    """(g, m, n, k) of a variable-K grouped GEMM: x[k, m], y[k, n] token-major, out [g, m, n]."""
    require_tensor(op, "a", x, 2, "[M_total, P] (token-major)")
    require_tensor(op, "b", y, 2, "[M_total, Q] (token-major)")
    if x.device != y.device:
        raise ValueError(f"{op}: a and b must be on the same device; got a on {x.device}, b on {y.device}")
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{op}: a{tuple(x.shape)} and b{tuple(y.shape)} must have the same number of tokens (dim 0)")
    g = _check_group_tensors(op, group_lens, group_offs, x, "a")
    return g, x.shape[1], y.shape[1], x.shape[0]


def _validated_problem(a, b, group_lens, group_offs, trans_b) -> GroupedGemmProblem:
    """The full checks, each with its own message; the slow path of grouped_gemm_problem."""
    g, m, n, k = _fixed_shapes("grouped_gemm", a, b, group_lens, group_offs, trans_b)
    require_dtype("grouped_gemm", "a.dtype", a.dtype)
    if b.dtype != a.dtype:
        raise TypeError(f"grouped_gemm: a and b must have the same dtype; got a={a.dtype}, b={b.dtype}")
    return GroupedGemmProblem(g, m, n, k, trans_b, False, a.dtype, platform_of(a.device.type))


def grouped_gemm_problem(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                         group_offs: Optional[torch.Tensor] = None, trans_b: bool = False) -> GroupedGemmProblem:
    """Validates grouped_gemm's arguments (host-side facts only) and returns its problem key.

    Runs on every eager call, so the common case is one combined check; anything unusual goes
    through ``_validated_problem``, which names what is wrong. The *values* of group_lens are not
    read here (see ``check_group_lens_values``).
    """
    if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(group_lens, torch.Tensor)
            and a.dim() == 2 and b.dim() == 3 and group_lens.dim() == 1):
        dtype = a.dtype
        g = b.shape[0]
        if (b.dtype is dtype and dtype in _HP and group_lens.dtype is _I64 and trans_b.__class__ is bool
                and group_lens.shape[0] == g and _same_device(a, b) and _same_device(a, group_lens)
                and (group_offs is None or (isinstance(group_offs, torch.Tensor) and group_offs.dim() == 1
                                            and group_offs.dtype in _OFFS_DTYPES and group_offs.shape[0] == g + 1
                                            and _same_device(a, group_offs)))):
            m, k = a.shape
            _, b1, b2 = b.shape
            n, k_b = (b1, b2) if trans_b else (b2, b1)
            if k == k_b:
                return _new(GroupedGemmProblem, (g, m, n, k, trans_b, False, dtype, _platform(a)))
    return _validated_problem(a, b, group_lens, group_offs, trans_b)


def variable_k_problem(x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor,
                       group_offs: Optional[torch.Tensor] = None) -> GroupedGemmProblem:
    """Problem of the wgrad GEMM ``out[i] = x_i^T @ y_i`` (x [M_total, P], y [M_total, Q])."""
    g, m, n, k = _variable_shapes("grouped_gemm", x, y, group_lens, group_offs)
    require_dtype("grouped_gemm", "a.dtype", x.dtype)
    if y.dtype != x.dtype:
        raise TypeError(f"grouped_gemm: a and b must have the same dtype; got a={x.dtype}, b={y.dtype}")
    return GroupedGemmProblem(g, m, n, k, False, True, x.dtype, _platform(x))


def grouped_gemm_fp8_problem(x, y, group_lens, group_offs, trans_b: bool, variable_k: bool,
                             out_dtype: Optional[torch.dtype], a_fp8: torch.dtype, b_fp8: torch.dtype,
                             granularity: ScalingGranularity, block_size: Optional[int],
                             b_2d: bool) -> GroupedGemmFp8Problem:
    """Validates one fp8 grouped GEMM's arguments and returns its problem key."""
    op = "grouped_gemm_fp8"
    if variable_k:
        g, m, n, k = _variable_shapes(op, x, y, group_lens, group_offs)
    else:
        g, m, n, k = _fixed_shapes(op, x, y, group_lens, group_offs, trans_b)
    require_dtype(op, "a.dtype (high-precision input; it is quantised inside)", x.dtype)
    require_dtype(op, "b.dtype (high-precision input; it is quantised inside)", y.dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    require_dtype(op, "out_dtype", out_dtype)
    require_dtype(op, "a_fp8", a_fp8, _FP8)
    require_dtype(op, "b_fp8", b_fp8, _FP8)
    if granularity is ScalingGranularity.MX_BLOCKWISE:
        raise ValueError(_MX_REFUSED)
    return GroupedGemmFp8Problem(g, m, n, k, trans_b and not variable_k, variable_k, x.dtype, y.dtype, out_dtype,
                                 a_fp8, b_fp8, granularity, block_size, b_2d, _platform(x))


#: Opt-in on GPUs: checking group_lens values there costs a device->host sync per call.
VALIDATE_ENV = "PRIMUS_TURBO_VALIDATE_GROUP_LENS"


def _value_check_skipped(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    if x.is_cpu:
        return False  # free on the CPU
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    return os.environ.get(VALIDATE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


def check_group_lens_values(op: str, group_lens: torch.Tensor, group_offs: Optional[torch.Tensor],
                            total: int) -> None:
    """The validation slow path that reads tensor data: group_lens non-negative and summing to
    ``total`` (M_total, a.shape[0]); a given group_offs equal to ``[0, cumsum(group_lens)]``.

    It reads device memory: free on the CPU, one device->host read (a sync) on a GPU, so on a GPU
    it runs only when PRIMUS_TURBO_VALIDATE_GROUP_LENS=1 (a debugging aid; the fast path must not
    sync). It is skipped -- returns without reading anything -- while torch.compile traces (the values do not
    exist yet) and while a CUDA graph is being captured (a read would break the capture); there
    wrong lengths are the caller's responsibility (the per-group loop path still checks them for
    free from its own host copy; torch._grouped_mm cannot). Never part of the problem key.
    """
    if _value_check_skipped(group_lens):
        return
    g = group_lens.shape[0]
    if g == 0:
        if total:
            raise ValueError(f"{op}: group_lens is empty (G=0) but a has M_total={total} rows")
        return
    parts = [group_lens.sum(), group_lens.min()]
    if group_offs is not None:
        bad = (group_offs[0] != 0) | (group_offs[1:] - group_offs[:-1] != group_lens).any()
        parts.append(bad.to(_I64))
    got, smallest, *bad_offs = torch.stack(parts).tolist()
    if smallest < 0:
        raise ValueError(f"{op}: group_lens must be non-negative; got a minimum of {smallest}")
    if got != total:
        raise ValueError(f"{op}: group_lens must sum to M_total = a.shape[0] = {total}; got sum {got}")
    if bad_offs and bad_offs[0]:
        raise ValueError(f"{op}: group_offs must be the exclusive prefix sums of group_lens, [0, cumsum(group_lens)]")


_OFFS_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1


def _offsets(group_lens: torch.Tensor, total: int) -> torch.Tensor:
    """group_offs from group_lens on the device: [0, cumsum(group_lens)], G + 1 entries.

    int32 whenever the ``total`` tokens fit: that is the dtype torch._grouped_mm takes, so the
    TORCH backend uses the offsets as they are instead of launching a conversion per GEMM (three
    per training step), which costs several percent at small expert batches."""
    dtype = torch.int32 if total <= _INT32_MAX else _I64
    return torch.nn.functional.pad(torch.cumsum(group_lens, 0, dtype=dtype), (1, 0))


# -- op specs (what the resolver and autotuner know) -------------------------------------------------
def _random_lens(total: int, g: int) -> torch.Tensor:
    """A random split of ``total`` tokens into ``g`` groups (some may be empty)."""
    if g == 0:
        return torch.zeros(0, dtype=_I64)
    cuts = torch.randint(0, total + 1, (g - 1,), dtype=_I64).sort().values
    return torch.diff(torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), total)]))


def _make_inputs(p, device) -> tuple[torch.Tensor, ...]:
    a_dtype = getattr(p, "a_dtype", None) or p.dtype
    b_dtype = getattr(p, "b_dtype", None) or p.dtype
    if p.variable_k:
        x = torch.randn((p.k, p.m), device=device, dtype=a_dtype)
        y = torch.randn((p.k, p.n), device=device, dtype=b_dtype)
        lens = _random_lens(p.k, p.g).to(device)
    else:
        x = torch.randn((p.m, p.k), device=device, dtype=a_dtype)
        y = torch.randn((p.g, p.n, p.k) if p.trans_b else (p.g, p.k, p.n), device=device, dtype=b_dtype)
        lens = _random_lens(p.m, p.g).to(device)
    return x, y, lens, _offsets(lens, x.shape[0])


def grouped_reference(p, inputs) -> torch.Tensor:
    """The same math per group in float64 on the CPU (float32 on the device for GPU inputs)."""
    x, y, lens = inputs[:3]
    wide = torch.float64 if x.device.type == "cpu" else torch.float32
    x, y = x.to(wide), y.to(wide)
    outs, start = [], 0
    for i, length in enumerate(lens.tolist()):
        end = start + length
        if p.variable_k:
            outs.append(x[start:end].t() @ y[start:end])
        else:
            outs.append(x[start:end] @ (y[i].t() if p.trans_b else y[i]))
        start = end
    if p.variable_k:
        return torch.stack(outs) if outs else x.new_zeros((0, p.m, p.n))
    return torch.cat(outs) if outs else x.new_zeros((0, p.n))


def _fp8_check(p: GroupedGemmFp8Problem, out, ref):
    return check_snr(20.0 if torch.float8_e5m2 in (p.a_fp8, p.b_fp8) else 25.0)(out, ref)


GROUPED_GEMM = register_op(OpSpec(
    name="grouped_gemm",
    keys_vary_across_ranks=True,
    problem_type=GroupedGemmProblem,
    precision_of=lambda p: precision_of_dtype(p.dtype),
    make_inputs=_make_inputs,
    reference=grouped_reference,
    check=lambda p, out, ref: check_rel(out, ref),
    flops=lambda p: 2.0 * p.m * p.n * p.k,
    problem_from_call=lambda *args, **kwargs: grouped_gemm_problem(*args, **kwargs),
))

GROUPED_GEMM_FP8 = register_op(OpSpec(
    name="grouped_gemm_fp8",
    keys_vary_across_ranks=True,
    problem_type=GroupedGemmFp8Problem,
    precision_of=lambda p: PrecisionType.FP8,
    make_inputs=_make_inputs,
    reference=grouped_reference,
    check=_fp8_check,
    flops=lambda p: 2.0 * p.m * p.n * p.k,
    problem_from_call=lambda *args, **kwargs: _explain_grouped_gemm_fp8(*args, **kwargs),
))


def _run(p: GroupedGemmProblem, x, y, group_lens, group_offs) -> torch.Tensor:
    decision = resolve(GROUPED_GEMM, p)
    return decision.entry.adapter.run(p, x, y, group_lens, group_offs, config=decision.config)


def _run_fp8(p: GroupedGemmFp8Problem, x, y, group_lens, group_offs) -> torch.Tensor:
    decision = resolve(GROUPED_GEMM_FP8, p)
    return decision.entry.adapter.run(p, x, y, group_lens, group_offs, config=decision.config)


# -- gradient formulas, shared by the eager and the compiled path -------------------------------------
def _grouped_grads(mm: Callable, mm_k: Callable, a, b, grad, group_lens, group_offs, trans_b: bool,
                   need_a: bool, need_b: bool):
    """dA is a grouped GEMM against b with trans_b flipped; dB a variable-K grouped GEMM whose
    operand order yields b's own layout ([G, K, N], or [G, N, K] with trans_b)."""
    g = grad if grad.dtype == a.dtype else grad.to(a.dtype)
    grad_a = grad_b = None
    if need_a:
        grad_a = mm(g, b, group_lens, group_offs, not trans_b)
    if need_b:
        grad_b = mm_k(g, a, group_lens, group_offs) if trans_b else mm_k(a, g, group_lens, group_offs)
    return grad_a, grad_b


def _grouped_fp8_grads(mm8: Callable, mm8_k: Callable, a, b, grad, group_lens, group_offs, trans_b: bool,
                       fwd: torch.dtype, bwd: torch.dtype, granularity: ScalingGranularity, need_a: bool,
                       need_b: bool):
    """Like _grouped_grads with the recipe's roles (as gemm_fp8's _fp8_grads): the gradient is
    quantised as ``bwd`` (E5M2 under HYBRID); under BLOCKWISE the weight keeps its 2-D tiles in
    dgrad, and both wgrad operands use 1-D runs along the tokens, that GEMM's reduction dimension."""
    w2d = granularity is ScalingGranularity.BLOCKWISE
    grad_a = grad_b = None
    if need_a:
        grad_a = mm8(grad, b, group_lens, group_offs, not trans_b, a.dtype, bwd, fwd, w2d)
    if need_b:
        if trans_b:
            grad_b = mm8_k(grad, a, group_lens, group_offs, b.dtype, bwd, fwd)
        else:
            grad_b = mm8_k(a, grad, group_lens, group_offs, b.dtype, fwd, bwd)
    return grad_a, grad_b


# -- eager path --------------------------------------------------------------------------------------
def _eager_mm(x, y, group_lens, group_offs, trans_b):
    return _run(grouped_gemm_problem(x, y, group_lens, group_offs, trans_b), x, y, group_lens, group_offs)


def _eager_mm_k(x, y, group_lens, group_offs):
    return _run(variable_k_problem(x, y, group_lens, group_offs), x, y, group_lens, group_offs)


class _GroupedGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_lens, group_offs, problem):
        ctx.save_for_backward(a, b, group_lens, group_offs)
        ctx.problem = problem
        return _run(problem, a, b, group_lens, group_offs)

    @staticmethod
    def backward(ctx, grad):
        a, b, group_lens, group_offs = ctx.saved_tensors
        grad_a, grad_b = _grouped_grads(_eager_mm, _eager_mm_k, a, b, grad, group_lens, group_offs,
                                        ctx.problem.trans_b, *ctx.needs_input_grad[:2])
        return grad_a, grad_b, None, None, None


def _eager_fp8_mms(cfg: Float8QuantConfig):
    def mm8(x, y, lens, offs, trans_b, out_dtype, x_fp8, y_fp8, y_2d):
        q = grouped_gemm_fp8_problem(x, y, lens, offs, trans_b, False, out_dtype, x_fp8, y_fp8, cfg.granularity,
                                     cfg.block_size, y_2d)
        return _run_fp8(q, x, y, lens, offs)

    def mm8_k(x, y, lens, offs, out_dtype, x_fp8, y_fp8):
        q = grouped_gemm_fp8_problem(x, y, lens, offs, False, True, out_dtype, x_fp8, y_fp8, cfg.granularity,
                                     cfg.block_size, False)
        return _run_fp8(q, x, y, lens, offs)

    return mm8, mm8_k


class _GroupedFp8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_lens, group_offs, problem, config):
        ctx.save_for_backward(a, b, group_lens, group_offs)
        ctx.problem, ctx.config = problem, config
        return _run_fp8(problem, a, b, group_lens, group_offs)

    @staticmethod
    def backward(ctx, grad):
        a, b, group_lens, group_offs = ctx.saved_tensors
        cfg = ctx.config
        grad_a, grad_b = _grouped_fp8_grads(*_eager_fp8_mms(cfg), a, b, grad, group_lens, group_offs,
                                            ctx.problem.trans_b, cfg.format.fwd_dtype(), cfg.format.bwd_dtype(),
                                            cfg.granularity, *ctx.needs_input_grad[:2])
        return grad_a, grad_b, None, None, None, None


# -- custom ops (the torch.compile path) ----------------------------------------------------------------
# The custom ops never read group_lens values themselves (the backend may, see its describe()):
# their fake implementations need only shapes, so torch.compile traces them with data-dependent
# routing and M_total marked dynamic.
@torch.library.custom_op("turbo_dispatch::grouped_gemm", mutates_args=())
def _grouped_gemm_op(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor, group_offs: Optional[torch.Tensor],
                     trans_b: bool) -> torch.Tensor:
    offs = _offsets(group_lens, a.shape[0]) if group_offs is None else group_offs
    return _run(grouped_gemm_problem(a, b, group_lens, offs, trans_b), a, b, group_lens, offs)


@_grouped_gemm_op.register_fake
def _grouped_gemm_fake(a, b, group_lens, group_offs, trans_b):
    _, m, n, _ = _fixed_shapes("grouped_gemm", a, b, group_lens, group_offs, trans_b)
    return a.new_empty((m, n))


@torch.library.custom_op("turbo_dispatch::grouped_gemm_variable_k", mutates_args=())
def _grouped_gemm_variable_k_op(x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor,
                                group_offs: Optional[torch.Tensor]) -> torch.Tensor:
    offs = _offsets(group_lens, x.shape[0]) if group_offs is None else group_offs
    return _run(variable_k_problem(x, y, group_lens, offs), x, y, group_lens, offs)


@_grouped_gemm_variable_k_op.register_fake
def _grouped_gemm_variable_k_fake(x, y, group_lens, group_offs):
    g, m, n, _ = _variable_shapes("grouped_gemm", x, y, group_lens, group_offs)
    return x.new_empty((g, m, n))


def _grouped_setup(ctx, inputs, output):
    a, b, group_lens, group_offs, trans_b = inputs
    ctx.save_for_backward(a, b, group_lens, group_offs)
    ctx.trans_b = trans_b


def _grouped_backward(ctx, grad):
    a, b, group_lens, group_offs = ctx.saved_tensors
    ops = torch.ops.turbo_dispatch
    grad_a, grad_b = _grouped_grads(ops.grouped_gemm, ops.grouped_gemm_variable_k, a, b, grad, group_lens,
                                    group_offs, ctx.trans_b, *ctx.needs_input_grad[:2])
    return grad_a, grad_b, None, None, None


_grouped_gemm_op.register_autograd(_grouped_backward, setup_context=_grouped_setup)


@torch.library.custom_op("turbo_dispatch::grouped_gemm_fp8_raw", mutates_args=())
def _grouped_gemm_fp8_raw_op(x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor,
                             group_offs: Optional[torch.Tensor], trans_b: bool, variable_k: bool,
                             out_dtype: torch.dtype, a_fp8: torch.dtype, b_fp8: torch.dtype, granularity: str,
                             block_size: Optional[int], b_2d: bool) -> torch.Tensor:
    offs = _offsets(group_lens, x.shape[0]) if group_offs is None else group_offs
    p = grouped_gemm_fp8_problem(x, y, group_lens, offs, trans_b, variable_k, out_dtype, a_fp8, b_fp8,
                                 ScalingGranularity(granularity), block_size, b_2d)
    return _run_fp8(p, x, y, group_lens, offs)


@_grouped_gemm_fp8_raw_op.register_fake
def _grouped_gemm_fp8_raw_fake(x, y, group_lens, group_offs, trans_b, variable_k, out_dtype, a_fp8, b_fp8,
                               granularity, block_size, b_2d):
    if variable_k:
        g, m, n, _ = _variable_shapes("grouped_gemm_fp8", x, y, group_lens, group_offs)
        return x.new_empty((g, m, n), dtype=out_dtype)
    _, m, n, _ = _fixed_shapes("grouped_gemm_fp8", x, y, group_lens, group_offs, trans_b)
    return x.new_empty((m, n), dtype=out_dtype)


@torch.library.custom_op("turbo_dispatch::grouped_gemm_fp8", mutates_args=())
def _grouped_gemm_fp8_op(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                         group_offs: Optional[torch.Tensor], trans_b: bool, out_dtype: Optional[torch.dtype],
                         format: str, granularity: str, block_size: Optional[int], scale_dtype: str) -> torch.Tensor:
    cfg = Float8QuantConfig(format, granularity, scale_dtype, block_size)
    offs = _offsets(group_lens, a.shape[0]) if group_offs is None else group_offs
    p = _forward_fp8_problem(a, b, group_lens, offs, trans_b, out_dtype, cfg)
    return _run_fp8(p, a, b, group_lens, offs)


@_grouped_gemm_fp8_op.register_fake
def _grouped_gemm_fp8_fake(a, b, group_lens, group_offs, trans_b, out_dtype, format, granularity, block_size,
                           scale_dtype):
    _, m, n, _ = _fixed_shapes("grouped_gemm_fp8", a, b, group_lens, group_offs, trans_b)
    return a.new_empty((m, n), dtype=a.dtype if out_dtype is None else out_dtype)


def _grouped_fp8_setup(ctx, inputs, output):
    a, b, group_lens, group_offs, trans_b, _, fmt, gran, block_size, scale_dtype = inputs
    ctx.save_for_backward(a, b, group_lens, group_offs)
    ctx.trans_b = trans_b
    ctx.config = Float8QuantConfig(fmt, gran, scale_dtype, block_size)


def _grouped_fp8_backward(ctx, grad):
    a, b, group_lens, group_offs = ctx.saved_tensors
    cfg = ctx.config
    raw = torch.ops.turbo_dispatch.grouped_gemm_fp8_raw
    gran, bs = cfg.granularity.value, cfg.block_size

    def mm8(x, y, lens, offs, trans_b, out_dtype, x_fp8, y_fp8, y_2d):
        return raw(x, y, lens, offs, trans_b, False, out_dtype, x_fp8, y_fp8, gran, bs, y_2d)

    def mm8_k(x, y, lens, offs, out_dtype, x_fp8, y_fp8):
        return raw(x, y, lens, offs, False, True, out_dtype, x_fp8, y_fp8, gran, bs, False)

    grad_a, grad_b = _grouped_fp8_grads(mm8, mm8_k, a, b, grad, group_lens, group_offs, ctx.trans_b,
                                        cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.granularity,
                                        *ctx.needs_input_grad[:2])
    return grad_a, grad_b, None, None, None, None, None, None, None, None


_grouped_gemm_fp8_op.register_autograd(_grouped_fp8_backward, setup_context=_grouped_fp8_setup)


def _forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype,
                         cfg: Float8QuantConfig) -> GroupedGemmFp8Problem:
    """The forward GEMM's problem; reuses grouped_gemm's fast checks where the dtypes allow."""
    fwd = cfg.format.fwd_dtype()
    granularity = cfg.granularity
    if granularity is ScalingGranularity.MX_BLOCKWISE:
        raise ValueError(_MX_REFUSED)
    w2d = granularity is ScalingGranularity.BLOCKWISE
    if (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and b.dtype is a.dtype
            and (out_dtype is None or out_dtype in _HP)):
        try:
            p = grouped_gemm_problem(a, b, group_lens, group_offs, trans_b)
        except (TypeError, ValueError):
            pass  # the full fp8 checks below give the fp8-specific message
        else:
            return _new(GroupedGemmFp8Problem, (p.g, p.m, p.n, p.k, trans_b, False, p.dtype, p.dtype,
                                                p.dtype if out_dtype is None else out_dtype, fwd, fwd, granularity,
                                                cfg.block_size, w2d, p.platform))
    return grouped_gemm_fp8_problem(a, b, group_lens, group_offs, trans_b, False, out_dtype, fwd, fwd, granularity,
                                    cfg.block_size, w2d)


_DEFAULT_FP8 = Float8QuantConfig()


def _needs_grad(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.requires_grad or b.requires_grad) and torch.is_grad_enabled()


# -- public API --------------------------------------------------------------------------------------------
def grouped_gemm(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                 group_offs: Optional[torch.Tensor] = None, trans_b: bool = False) -> torch.Tensor:
    """Grouped GEMM: ``out[s_i:e_i] = a[s_i:e_i] @ op(b[i])`` for each group i; forward and backward.

    ``a`` is [M_total, K]; ``b`` is [G, K, N] ([G, N, K] with ``trans_b=True``), same dtype as ``a``
    (bf16/fp16/fp32); ``group_lens`` is int64 [G] on a's device, the tokens of each group in
    order (zeros allowed), summing to M_total; ``group_offs`` (optional) is its exclusive prefix
    sum [G + 1] (int32 or int64; int32 saves the TORCH backend a conversion per GEMM), computed on
    the device when None: pass it when several GEMMs share one routing. Returns [M_total, N] in a's dtype. The backward
    gives ``a`` a grouped GEMM with b transposed and ``b`` a variable-K grouped GEMM (zero for
    empty groups), each resolved to a backend of its own.

    Checks and host syncs: everything about shapes, dtypes and devices is checked from host-side
    facts. That group_lens is non-negative and sums to M_total (and that a given group_offs
    matches it) needs a device read: eager CPU calls do it for free; on a GPU it would cost a
    device->host sync, so it runs only with PRIMUS_TURBO_VALIDATE_GROUP_LENS=1. It is skipped
    while torch.compile traces and while a CUDA graph is captured; without the check, wrong
    lengths are the caller's responsibility. The problem key never reads group_lens values,
    so routings with the same G and M_total share one decision. Whether the chosen backend
    itself reads group_lens on the host is shown by ``turbo_dispatch.explain`` (TORCH: no with
    torch._grouped_mm on sm_90/sm_100 bf16, yes with its per-group loop).

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> a, b = torch.randn(7, 8), torch.randn(3, 8, 5)
        >>> turbo.ops.grouped_gemm(a, b, torch.tensor([2, 0, 5])).shape
        torch.Size([7, 5])
    """
    if torch.compiler.is_compiling():
        offs = _offsets(group_lens, a.shape[0]) if group_offs is None else group_offs
        return torch.ops.turbo_dispatch.grouped_gemm(a, b, group_lens, offs, trans_b)
    problem = grouped_gemm_problem(a, b, group_lens, group_offs, trans_b)
    check_group_lens_values("grouped_gemm", group_lens, group_offs, problem.m)
    offs = _offsets(group_lens, a.shape[0]) if group_offs is None else group_offs
    if _needs_grad(a, b):
        return _GroupedGemmFunction.apply(a, b, group_lens, offs, problem)
    return _run(problem, a, b, group_lens, offs)


def grouped_gemm_fp8(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor,
                     group_offs: Optional[torch.Tensor] = None, trans_b: bool = True,
                     out_dtype: Optional[torch.dtype] = None,
                     config: Optional[Float8QuantConfig] = None) -> torch.Tensor:
    """FP8 grouped GEMM from high-precision inputs: quantise per ``config`` (default E4M3
    TENSORWISE), multiply per group, return ``out_dtype`` (default: a's dtype).

    Shapes and group arguments as in ``grouped_gemm`` (note ``trans_b`` defaults to True here: b is
    [G, N, K]). Recipe roles: TENSORWISE has one scale per tensor (for b: one for all groups);
    ROWWISE one per row of ``a`` and per (group, output column) of ``b``; BLOCKWISE 1 x block_size
    runs of ``a`` along K and block_size x block_size tiles per group of ``b``. The backward
    quantises the gradient too (as E5M2 under Format.HYBRID); the weight keeps its tiles in dgrad,
    and wgrad quantises both operands in runs along the tokens (a run may straddle two groups;
    its one scale serves both). MX_BLOCKWISE is not supported for grouped GEMMs (ValueError).
    The group_lens value check and its host sync behave as in ``grouped_gemm``.

    Example:
        >>> import torch, turbo_dispatch as turbo
        >>> from turbo_dispatch.low_precision import Float8QuantConfig
        >>> a, w = torch.randn(12, 32), torch.randn(2, 16, 32)
        >>> cfg = Float8QuantConfig(granularity="rowwise")
        >>> turbo.ops.grouped_gemm_fp8(a, w, torch.tensor([5, 7]), config=cfg).shape
        torch.Size([12, 16])
    """
    cfg = _DEFAULT_FP8 if config is None else config
    if not isinstance(cfg, Float8QuantConfig):
        raise TypeError(f"grouped_gemm_fp8: config must be a Float8QuantConfig or None; got {type(config).__name__}")
    if cfg.granularity is ScalingGranularity.MX_BLOCKWISE:
        raise ValueError(_MX_REFUSED)
    if torch.compiler.is_compiling():
        offs = _offsets(group_lens, a.shape[0]) if group_offs is None else group_offs
        return torch.ops.turbo_dispatch.grouped_gemm_fp8(a, b, group_lens, offs, trans_b, out_dtype, cfg.format.value,
                                                         cfg.granularity.value, cfg.block_size, cfg.scale_dtype.value)
    problem = _forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype, cfg)
    check_group_lens_values("grouped_gemm_fp8", group_lens, group_offs, problem.m)
    offs = _offsets(group_lens, a.shape[0]) if group_offs is None else group_offs
    if _needs_grad(a, b):
        return _GroupedFp8Function.apply(a, b, group_lens, offs, problem, cfg)
    return _run_fp8(problem, a, b, group_lens, offs)


def _explain_grouped_gemm_fp8(a, b, group_lens, group_offs=None, trans_b=True, out_dtype=None,
                              config=None) -> GroupedGemmFp8Problem:
    return _forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype,
                                _DEFAULT_FP8 if config is None else config)
