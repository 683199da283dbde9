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

import dataclasses
import os
from typing import Callable, NamedTuple, Optional

import torch

from ..backend_type import PrecisionType
from ..device_platform import platform_of
from ..low_precision import Float8QuantConfig, QuantizedTensor, ScalingGranularity, dequantize, quantize
from ..op_spec import OpSpec, precision_of_dtype, register_op
from ..resolver import resolve
from ._common import check_rel, check_snr, require_bool, require_dtype, require_tensor
from .gemm import _check_prequantized, _data, _platform, _same_device

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


def _operand_dtype(name: str, x, fp8: torch.dtype, granularity: ScalingGranularity, block_size: Optional[int],
                   is_2d: bool, k_axis: int) -> torch.dtype:
    """The dtype an operand arrives in: high precision (quantised inside), or fp8 (== ``fp8``)
    when it is a QuantizedTensor made as the backend would have made it."""
    if isinstance(x, QuantizedTensor):
        _check_prequantized(name, x, fp8, granularity, block_size, is_2d, k_axis, op="grouped_gemm_fp8")
        return x.data.dtype
    require_dtype("grouped_gemm_fp8", f"{name}.dtype (high-precision input, or a QuantizedTensor)", x.dtype)
    return x.dtype


def grouped_gemm_fp8_problem(x, y, group_lens, group_offs, trans_b: bool, variable_k: bool,
                             out_dtype: Optional[torch.dtype], a_fp8: torch.dtype, b_fp8: torch.dtype,
                             granularity: ScalingGranularity, block_size: Optional[int],
                             b_2d: bool) -> GroupedGemmFp8Problem:
    """Validates one fp8 grouped GEMM's arguments and returns its problem key.

    Either operand may be a ``QuantizedTensor`` already quantised for this GEMM (the training
    step's reuse, see ``_quantize_for_step``): along the tokens for the wgrad (``axis=0``), along K
    for the forward's ``a`` (``axis=1``), in 2-D tiles for a ``b_2d`` weight. Its key dtype is
    then the fp8 dtype, so pre-quantised and high-precision calls keep separate decisions."""
    op = "grouped_gemm_fp8"
    if variable_k:
        g, m, n, k = _variable_shapes(op, _data(x), _data(y), group_lens, group_offs)
        a_axis = b_axis = 0
    else:
        g, m, n, k = _fixed_shapes(op, _data(x), _data(y), group_lens, group_offs, trans_b)
        a_axis, b_axis = 1, 2 if trans_b else 1
    require_dtype(op, "a_fp8", a_fp8, _FP8)
    require_dtype(op, "b_fp8", b_fp8, _FP8)
    if granularity is ScalingGranularity.MX_BLOCKWISE:
        raise ValueError(_MX_REFUSED)
    a_dtype = _operand_dtype("a", x, a_fp8, granularity, block_size, False, a_axis)
    b_dtype = _operand_dtype("b", y, b_fp8, granularity, block_size, b_2d and not variable_k, b_axis)
    if out_dtype is None:
        if a_dtype in _FP8:
            raise TypeError(f"{op}: out_dtype is required when a arrives pre-quantised")
        out_dtype = a_dtype
    require_dtype(op, "out_dtype", out_dtype)
    return GroupedGemmFp8Problem(g, m, n, k, trans_b and not variable_k, variable_k, a_dtype, b_dtype, out_dtype,
                                 a_fp8, b_fp8, granularity, block_size, b_2d, _platform(_data(x)))


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


#: How far a group of ``_near_balanced_lens`` may stray from an even share, either way.
TIMING_JITTER = 0.25


def _near_balanced_lens(total: int, g: int) -> torch.Tensor:
    """``total`` tokens over ``g`` groups, each within ``TIMING_JITTER`` of an even share (before
    rounding): the routing a load-balanced MoE layer meets, which the tuner times on."""
    if g == 0:
        return torch.zeros(0, dtype=_I64)
    weights = 1.0 + TIMING_JITTER * (2.0 * torch.rand(g, dtype=torch.float64) - 1.0)
    lens = torch.floor(weights / weights.sum() * total).to(_I64)
    lens[: total - int(lens.sum())] += 1  # the rounding remainder, at most g - 1 tokens
    return lens


def _make_inputs(p, device, split: Callable[[int, int], torch.Tensor] = _random_lens) -> tuple[torch.Tensor, ...]:
    a_dtype = getattr(p, "a_dtype", None) or p.dtype
    b_dtype = getattr(p, "b_dtype", None) or p.dtype
    if p.variable_k:
        x = torch.randn((p.k, p.m), device=device, dtype=a_dtype)
        y = torch.randn((p.k, p.n), device=device, dtype=b_dtype)
        lens = split(p.k, p.g).to(device)
    else:
        x = torch.randn((p.m, p.k), device=device, dtype=a_dtype)
        y = torch.randn((p.g, p.n, p.k) if p.trans_b else (p.g, p.k, p.n), device=device, dtype=b_dtype)
        lens = split(p.m, p.g).to(device)
    return x, y, lens, _offsets(lens, x.shape[0])


def _timing_inputs(p, device) -> tuple[torch.Tensor, ...]:
    return _make_inputs(p, device, _near_balanced_lens)


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


def _kmajor(data: torch.Tensor, k_dim: int) -> torch.Tensor:
    """``data`` with the same shape and values, stored with dim ``k_dim`` contiguous and its rows
    padded to 16 elements, as the step's quantisers store their outputs (``padded_rows``): the
    TMA kernels need that row stride, so inputs laid out otherwise would time a refusal that the
    step never meets."""
    from turbo_dispatch.backends.quantizer import padded_rows

    last = data.dim() - 1
    return padded_rows(data.transpose(k_dim, last)).transpose(k_dim, last)


def _quantized_kmajor(t: torch.Tensor, dtype: torch.dtype, p: GroupedGemmFp8Problem, k_dim: int,
                      block_2d: bool) -> QuantizedTensor:
    """``t`` quantised for ``p`` along ``k_dim`` (or in 2-D tiles), its data stored K-major."""
    q = quantize(t, dtype, p.granularity, axis=k_dim, block_size=p.block_size, block_2d=block_2d)
    return dataclasses.replace(q, data=_kmajor(q.data, k_dim))


def _fp8_make_inputs(p: GroupedGemmFp8Problem, device,
                     split: Callable[[int, int], torch.Tensor] = _random_lens) -> tuple:
    """Inputs for a grouped_gemm_fp8 key. An operand whose key dtype is fp8 arrives pre-quantised
    as the training step passes it (``_quantize_for_step``): K-major data, token runs for the
    wgrad, 2-D tiles for a ``b_2d`` weight."""
    hp = p._replace(a_dtype=torch.float32 if p.a_dtype in _FP8 else p.a_dtype,
                    b_dtype=torch.float32 if p.b_dtype in _FP8 else p.b_dtype)
    x, y, lens, offs = _make_inputs(hp, device, split)
    k_a, k_b = (0, 0) if p.variable_k else (1, 2 if p.trans_b else 1)
    if p.a_dtype in _FP8:
        x = _quantized_kmajor(x, p.a_fp8, p, k_a, False)
    if p.b_dtype in _FP8:
        y = _quantized_kmajor(y, p.b_fp8, p, k_b, p.b_2d and not p.variable_k)
    return x, y, lens, offs


def _fp8_timing_inputs(p: GroupedGemmFp8Problem, device) -> tuple:
    return _fp8_make_inputs(p, device, _near_balanced_lens)


def _fp8_reference(p: GroupedGemmFp8Problem, inputs) -> torch.Tensor:
    # A pre-quantised operand's exact value is its dequantisation (its rounding already happened).
    x, y = (dequantize(t) if isinstance(t, QuantizedTensor) else t for t in inputs[:2])
    return grouped_reference(p, (x, y, *inputs[2:]))


def _fp8_check(p: GroupedGemmFp8Problem, out, ref):
    return check_snr(20.0 if torch.float8_e5m2 in (p.a_fp8, p.b_fp8) else 25.0)(out, ref)


def _token_bucketed(p):
    """The problem whose decision ``p`` shares: its token count (M_total, or the K of a variable-K
    weight gradient) rounded up to its bucket (``tuning.buckets``), since routing moves it every
    step. No adapter's ``supports`` reads that count; the resolver checks the shared choice
    against ``p`` anyway."""
    from turbo_dispatch.tuning.buckets import token_bucket

    return p._replace(k=token_bucket(p.k)) if p.variable_k else p._replace(m=token_bucket(p.m))


GROUPED_GEMM = register_op(OpSpec(
    name="grouped_gemm",
    keys_vary_across_ranks=True,
    problem_type=GroupedGemmProblem,
    precision_of=lambda p: precision_of_dtype(p.dtype),
    make_inputs=_make_inputs,
    make_timing_inputs=_timing_inputs,
    reference=grouped_reference,
    check=lambda p, out, ref: check_rel(out, ref),
    flops=lambda p: 2.0 * p.m * p.n * p.k,
    problem_from_call=lambda *args, **kwargs: grouped_gemm_problem(*args, **kwargs),
    shared_problem=_token_bucketed,
))

GROUPED_GEMM_FP8 = register_op(OpSpec(
    name="grouped_gemm_fp8",
    keys_vary_across_ranks=True,
    problem_type=GroupedGemmFp8Problem,
    precision_of=lambda p: PrecisionType.FP8,
    make_inputs=_fp8_make_inputs,
    make_timing_inputs=_fp8_timing_inputs,
    reference=_fp8_reference,
    check=_fp8_check,
    flops=lambda p: 2.0 * p.m * p.n * p.k,
    problem_from_call=lambda *args, **kwargs: _explain_grouped_gemm_fp8(*args, **kwargs),
    shared_problem=_token_bucketed,
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
                       need_b: bool, a_dtype: Optional[torch.dtype] = None, b_dtype: Optional[torch.dtype] = None,
                       runs_both: Optional[Callable] = None, block_size: Optional[int] = None):
    """Like _grouped_grads with the recipe's roles (as gemm_fp8's _fp8_grads): the gradient is
    quantised as ``bwd`` (E5M2 under HYBRID); under BLOCKWISE the weight keeps its 2-D tiles in
    dgrad, and both wgrad operands use 1-D runs along the tokens, that GEMM's reduction dimension.

    In a step that reuses its quantisations (``_step_reuses_quantization``), ``a`` and ``b`` are
    what the forward saved (``_quantize_for_step``): a's token runs and b's tiles stored for the
    dgrad, both QuantizedTensors, and ``a_dtype``/``b_dtype`` name the gradients' dtypes. Then
    ``runs_both`` (``quantize_runs_both`` or its custom op) quantises the gradient for both GEMMs
    from one read when both gradients are needed; otherwise each GEMM's backend quantises it."""
    a_dtype = a.dtype if a_dtype is None else a_dtype
    b_dtype = b.dtype if b_dtype is None else b_dtype
    w2d = granularity is ScalingGranularity.BLOCKWISE
    g_rows = g_cols = grad
    if runs_both is not None and need_a and need_b:
        g_rows, g_cols = runs_both(grad, bwd, block_size)

    def dgrad():
        return mm8(g_rows, b, group_lens, group_offs, not trans_b, a_dtype, bwd, fwd, w2d)

    def wgrad():
        if trans_b:
            return mm8_k(g_cols, a, group_lens, group_offs, b_dtype, bwd, fwd)
        return mm8_k(a, g_cols, group_lens, group_offs, b_dtype, fwd, bwd)

    from turbo_dispatch.backends.quantizer import overlappable, side_by_side

    if need_a and need_b and BACKWARD_SIDE_BY_SIDE and overlappable(grad):
        # The dgrad goes on the side stream, launched first; the wgrad's programs take SMs as
        # the dgrad's finish (its work items come from a counter), and the other way round.
        grad_b, grad_a = side_by_side(wgrad, dgrad, grad.device)
        return grad_a, grad_b
    return dgrad() if need_a else None, wgrad() if need_b else None


#: Whether the fp8 backward runs its dgrad on a side stream beside its wgrad where it needs both
#: (``backends.quantizer.side_by_side``): each kernel's last wave then shares the GPU with the
#: other's programs. H100, round 103, whole blockwise step in turns, bit-identical: 1.003-1.019x
#: at the EP8 bench's DeepSeek-V3, GPT-OSS-20B and Qwen3-30B-A3B sizes, balanced and skewed
#: (one 0.999x). Only where ``overlappable`` allows it (real eager CUDA tensors): round 104 had it
#: behind an is_compiling-only gate, and AOT autograd traced the backward's ``record_stream``
#: (five GPU tests failed); behind ``overlappable``, round 105 passed test_grouped_gemm.py's GPU
#: tests (111) and the CUDA-graph, full-op and every-recipe tests (12). Probes set it.
BACKWARD_SIDE_BY_SIDE = True


# -- the blockwise training step: every operand quantised once, for both GEMMs that read it ----------------
def _step_reuses_quantization(cfg: Float8QuantConfig) -> bool:
    """Whether a training step quantises a, b and the gradient once each (BLOCKWISE with a block
    the one-read quantiser takes) instead of once per GEMM. The results are bit-identical either
    way: the forward's and dgrad's 2-D weight tiles are the same tiles, and the wgrad's token
    runs are computed from the same values, so this changes traffic, not math."""
    from turbo_dispatch.backends.quantizer import DUAL_BLOCK_SIZES

    return cfg.granularity is ScalingGranularity.BLOCKWISE and cfg.block_size in DUAL_BLOCK_SIZES


def _quantize_for_step(a, b, cfg: Float8QuantConfig, need_a: bool, need_b: bool, runs_both: Callable,
                       tiles_both: Callable, reuse: bool = False):
    """(forward a, forward b, a saved for the wgrad, b saved for the dgrad). Where a gradient is
    needed, its saved operand is quantised with the forward's in one read; an operand no
    backward GEMM reads stays high precision, for the forward's backend to quantise. With
    ``reuse`` (the eager path), b's tiles come from and go to an enclosing
    ``low_precision.reuse_quantized_weights`` block."""
    fwd, bs = cfg.format.fwd_dtype(), cfg.block_size
    from turbo_dispatch.low_precision import weight_reuse

    kept = weight_reuse.lookup(b, fwd, bs) if need_a and reuse else None
    qa, qb, a_saved, b_saved = _quantize_both_operands(a, b, fwd, bs, need_a and kept is None, need_b, runs_both,
                                                       tiles_both)
    if kept is not None:
        return qa, kept[0], a_saved, kept[1]
    if need_a and reuse:
        weight_reuse.keep(b, fwd, bs, (qb, b_saved))
    return qa, qb, a_saved, b_saved


def _quantize_both_operands(a, b, fwd: torch.dtype, bs: int, need_a: bool, need_b: bool, runs_both: Callable,
                            tiles_both: Callable):
    """``_quantize_for_step``'s quantisations: a's runs where the wgrad reads them, b's tiles
    where the dgrad reads them."""
    from turbo_dispatch.backends.quantizer import overlappable, side_by_side

    if need_a and need_b and overlappable(a):
        # The two quantisers are memory-bound and neither reaches the memory's rate alone: the
        # weight's tiles beside the activation's runs (backends.quantizer.side_by_side).
        (qa, a_saved), (qb, b_saved) = side_by_side(lambda: runs_both(a, fwd, bs), lambda: tiles_both(b, fwd, bs),
                                                    a.device)
        return qa, qb, a_saved, b_saved
    qa, a_saved = runs_both(a, fwd, bs) if need_b else (a, None)
    qb, b_saved = tiles_both(b, fwd, bs) if need_a else (b, None)
    return qa, qb, a_saved, b_saved


def _step_forward_problem(problem: GroupedGemmFp8Problem, qa, qb) -> GroupedGemmFp8Problem:
    """The forward's key once ``_quantize_for_step`` quantised its operands: the inputs' key with
    the fp8 dtypes of the operands that now arrive pre-quantised (the inputs are validated
    already, and our own quantiser made qa and qb)."""
    return problem._replace(a_dtype=_data(qa).dtype, b_dtype=_data(qb).dtype)


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
        ctx.problem, ctx.config = problem, config
        ctx.dtypes = (a.dtype, b.dtype)
        ctx.reuse = _step_reuses_quantization(config)
        if not ctx.reuse:
            ctx.save_for_backward(a, b, group_lens, group_offs)
            return _run_fp8(problem, a, b, group_lens, group_offs)
        from turbo_dispatch.backends.quantizer import quantize_runs_both, quantize_tiles_both

        need_a, need_b = ctx.needs_input_grad[:2]
        qa, qb, a_saved, b_saved = _quantize_for_step(a, b, config, need_a, need_b, quantize_runs_both,
                                                      quantize_tiles_both, reuse=True)
        ctx.quantized = (_layout(a_saved), _layout(b_saved))  # their tensors go through save_for_backward
        ctx.save_for_backward(*_unpack(a_saved), *_unpack(b_saved), group_lens, group_offs)
        return _run_fp8(_step_forward_problem(problem, qa, qb), qa, qb, group_lens, group_offs)

    @staticmethod
    def backward(ctx, grad):
        cfg = ctx.config
        flags = (ctx.problem.trans_b, cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.granularity,
                 *ctx.needs_input_grad[:2])
        if not ctx.reuse:
            a, b, group_lens, group_offs = ctx.saved_tensors
            grad_a, grad_b = _grouped_fp8_grads(*_eager_fp8_mms(cfg), a, b, grad, group_lens, group_offs, *flags)
            return grad_a, grad_b, None, None, None, None
        from turbo_dispatch.backends.quantizer import quantize_runs_both

        a_data, a_scale, b_data, b_scale, group_lens, group_offs = ctx.saved_tensors
        a_saved, b_saved = (_repack(q, d, s) for q, d, s in zip(ctx.quantized, (a_data, b_data), (a_scale, b_scale)))
        grad_a, grad_b = _grouped_fp8_grads(*_eager_fp8_mms(cfg), a_saved, b_saved, grad, group_lens, group_offs,
                                            *flags, a_dtype=ctx.dtypes[0], b_dtype=ctx.dtypes[1],
                                            runs_both=quantize_runs_both, block_size=cfg.block_size)
        return grad_a, grad_b, None, None, None, None


def _unpack(q: Optional[QuantizedTensor]) -> tuple:
    return (None, None) if q is None else (q.data, q.scale)


def _layout(q: Optional[QuantizedTensor]) -> Optional[tuple]:
    return None if q is None else (q.granularity, q.axis, q.block_size, q.block_2d)


def _repack(layout: Optional[tuple], data, scale) -> Optional[QuantizedTensor]:
    """A saved QuantizedTensor rebuilt from its ``_layout`` and the tensors save_for_backward
    kept (which guard them against in-place changes and let saved-tensor hooks move them)."""
    if layout is None:
        return None
    granularity, axis, block_size, block_2d = layout
    return QuantizedTensor(data=data, scale=scale, granularity=granularity, axis=axis, block_size=block_size,
                           block_2d=block_2d)


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


def _prequantized(t: torch.Tensor, scale: Optional[torch.Tensor], granularity: ScalingGranularity,
                  block_size: Optional[int], axis: int, block_2d: bool):
    """A custom op cannot take a QuantizedTensor: it gets (fp8 data, scale) and rebuilds it."""
    if scale is None:
        return t
    return QuantizedTensor(data=t, scale=scale, granularity=granularity, axis=axis, block_size=block_size,
                           block_2d=block_2d)


@torch.library.custom_op("turbo_dispatch::grouped_gemm_fp8_raw", mutates_args=())
def _grouped_gemm_fp8_raw_op(x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor,
                             group_offs: Optional[torch.Tensor], trans_b: bool, variable_k: bool,
                             out_dtype: torch.dtype, a_fp8: torch.dtype, b_fp8: torch.dtype, granularity: str,
                             block_size: Optional[int], b_2d: bool, a_scale: Optional[torch.Tensor] = None,
                             b_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One fp8 GEMM of the backward. With ``a_scale`` (``b_scale``), ``x`` (``y``) is fp8 data
    already quantised for this GEMM (as grouped_gemm_fp8_problem describes), with that scale."""
    offs = _offsets(group_lens, x.shape[0]) if group_offs is None else group_offs
    gran = ScalingGranularity(granularity)
    x = _prequantized(x, a_scale, gran, block_size, 0 if variable_k else 1, False)
    y = _prequantized(y, b_scale, gran, block_size, 0 if variable_k else (2 if trans_b else 1),
                      b_2d and not variable_k)
    p = grouped_gemm_fp8_problem(x, y, group_lens, offs, trans_b, variable_k, out_dtype, a_fp8, b_fp8, gran,
                                 block_size, b_2d)
    return _run_fp8(p, x, y, group_lens, offs)


@_grouped_gemm_fp8_raw_op.register_fake
def _grouped_gemm_fp8_raw_fake(x, y, group_lens, group_offs, trans_b, variable_k, out_dtype, a_fp8, b_fp8,
                               granularity, block_size, b_2d, a_scale=None, b_scale=None):
    if variable_k:
        g, m, n, _ = _variable_shapes("grouped_gemm_fp8", x, y, group_lens, group_offs)
        return x.new_empty((g, m, n), dtype=out_dtype)
    _, m, n, _ = _fixed_shapes("grouped_gemm_fp8", x, y, group_lens, group_offs, trans_b)
    return x.new_empty((m, n), dtype=out_dtype)


def _raw_mms(cfg: Float8QuantConfig) -> tuple[Callable, Callable]:
    """The backward's fp8 GEMMs through the raw custom op, unpacking QuantizedTensor operands."""
    raw = torch.ops.turbo_dispatch.grouped_gemm_fp8_raw
    gran, bs = cfg.granularity.value, cfg.block_size

    def scale(t) -> Optional[torch.Tensor]:
        return t.scale if isinstance(t, QuantizedTensor) else None

    def mm8(x, y, lens, offs, trans_b, out_dtype, x_fp8, y_fp8, y_2d):
        return raw(_data(x), _data(y), lens, offs, trans_b, False, out_dtype, x_fp8, y_fp8, gran, bs, y_2d, scale(x),
                   scale(y))

    def mm8_k(x, y, lens, offs, out_dtype, x_fp8, y_fp8):
        return raw(_data(x), _data(y), lens, offs, False, True, out_dtype, x_fp8, y_fp8, gran, bs, False, scale(x),
                   scale(y))

    return mm8, mm8_k


# -- the compiled blockwise training step (see _step_reuses_quantization) ---------------------------------
@torch.library.custom_op("turbo_dispatch::fp8_quantize_both", mutates_args=())
def _fp8_quantize_both_op(x: torch.Tensor, dtype: torch.dtype, block_size: int,
                          tile_2d: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_both_tensors`` of ``x`` ([T, C] runs, or [G, R, C] tiles) as (data, scale, data_t,
    scale_t), the fp8 data in storage order (rows padded to 16 bytes)."""
    from turbo_dispatch.backends.quantizer import quantize_both_tensors

    out = quantize_both_tensors(x if tile_2d else x.unsqueeze(0), dtype, block_size, tile_2d)
    if tile_2d:
        return out[0], out[1], out[2], out[3].clone(memory_format=torch.contiguous_format)  # a view of out[1]
    return tuple(t[0] for t in out)


@_fp8_quantize_both_op.register_fake
def _fp8_quantize_both_fake(x, dtype, block_size, tile_2d):
    *lead, r, c = x.shape
    n_r, n_c = -(-r // block_size), -(-c // block_size)
    from turbo_dispatch.backends.quantizer import empty_padded_rows

    data = empty_padded_rows(x, (*lead, r, c), dtype)
    data_t = empty_padded_rows(x, (*lead, c, r), dtype)
    if tile_2d:
        return data, x.new_empty((*lead, n_r, n_c), dtype=torch.float32), data_t, \
            x.new_empty((*lead, n_c, n_r), dtype=torch.float32)
    return data, empty_padded_rows(x, (r, n_c), torch.float32), data_t, x.new_empty((n_r, c), dtype=torch.float32)


def _runs_both_op(x: torch.Tensor, dtype: torch.dtype, block_size: int):
    from turbo_dispatch.backends.quantizer import runs_from_tensors

    return runs_from_tensors(*torch.ops.turbo_dispatch.fp8_quantize_both(x, dtype, block_size, False), block_size)


def _tiles_both_op(w: torch.Tensor, dtype: torch.dtype, block_size: int):
    from turbo_dispatch.backends.quantizer import tiles_from_tensors

    data, scale, data_t, _ = torch.ops.turbo_dispatch.fp8_quantize_both(w, dtype, block_size, True)
    return tiles_from_tensors(data, scale, data_t, block_size)


@torch.library.custom_op("turbo_dispatch::grouped_gemm_fp8_step", mutates_args=())
def _grouped_gemm_fp8_step_op(a: torch.Tensor, b: torch.Tensor, group_lens: torch.Tensor, group_offs: torch.Tensor,
                              trans_b: bool, out_dtype: Optional[torch.dtype], format: str, block_size: int,
                              scale_dtype: str, need_a: bool, need_b: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The BLOCKWISE forward of a training step: (out, a's token-run data stored [K, T] and
    scale [nT, K], b's tiles stored for the dgrad and scale [G, nR, nC]); an unneeded pair is
    empty. As the eager _GroupedFp8Function.forward."""
    from turbo_dispatch.backends.quantizer import quantize_runs_both, quantize_tiles_both

    cfg = Float8QuantConfig(format, ScalingGranularity.BLOCKWISE, scale_dtype, block_size)
    qa, qb, a_saved, b_saved = _quantize_for_step(a, b, cfg, need_a, need_b, quantize_runs_both, quantize_tiles_both)
    problem = _forward_fp8_problem(a, b, group_lens, group_offs, trans_b, out_dtype, cfg)
    out = _run_fp8(_step_forward_problem(problem, qa, qb), qa, qb, group_lens, group_offs)
    a_pair, b_pair = ((a.new_empty(0, dtype=torch.float32), a.new_empty(0, dtype=torch.float32)) for _ in range(2))
    if a_saved is not None:
        a_pair = (a_saved.data.t(), a_saved.scale)
    if b_saved is not None:
        b_pair = (b_saved.data.transpose(1, 2), b_saved.scale)
    return out, *a_pair, *b_pair


@_grouped_gemm_fp8_step_op.register_fake
def _grouped_gemm_fp8_step_fake(a, b, group_lens, group_offs, trans_b, out_dtype, format, block_size, scale_dtype,
                                need_a, need_b):
    _, m, n, _ = _fixed_shapes("grouped_gemm_fp8", a, b, group_lens, group_offs, trans_b)
    fwd = Float8QuantConfig(format, ScalingGranularity.BLOCKWISE, scale_dtype, block_size).format.fwd_dtype()
    out = a.new_empty((m, n), dtype=a.dtype if out_dtype is None else out_dtype)
    a_pair, b_pair = ((a.new_empty(0, dtype=torch.float32), a.new_empty(0, dtype=torch.float32)) for _ in range(2))
    # What the real op returns of fp8_quantize_both's outputs: a's (data_t, scale_t), b's (data_t, scale).
    if need_b:
        a_pair = _fp8_quantize_both_fake(a, fwd, block_size, False)[2:]
    if need_a:
        _, scale, data_t, _ = _fp8_quantize_both_fake(b, fwd, block_size, True)
        b_pair = (data_t, scale)
    return out, *a_pair, *b_pair


def _grouped_fp8_step_setup(ctx, inputs, output):
    a, b, group_lens, group_offs, trans_b, _, fmt, block_size, scale_dtype, need_a, need_b = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[1:], group_lens, group_offs)
    ctx.trans_b, ctx.needs = trans_b, (need_a, need_b)
    ctx.dtypes = (a.dtype, b.dtype)
    ctx.config = Float8QuantConfig(fmt, ScalingGranularity.BLOCKWISE, scale_dtype, block_size)


def _grouped_fp8_step_backward(ctx, grad, *_unused):
    a_data_t, a_scale, b_data_t, b_scale, group_lens, group_offs = ctx.saved_tensors
    cfg = ctx.config
    need_a, need_b = ctx.needs
    a_saved = _repack((cfg.granularity, 0, cfg.block_size, False), a_data_t.t(), a_scale) if need_b else None
    b_saved = _repack((cfg.granularity, 2, cfg.block_size, True), b_data_t.transpose(1, 2), b_scale) if need_a else None
    grad_a, grad_b = _grouped_fp8_grads(*_raw_mms(cfg), a_saved, b_saved, grad, group_lens, group_offs, ctx.trans_b,
                                        cfg.format.fwd_dtype(), cfg.format.bwd_dtype(), cfg.granularity,
                                        need_a and ctx.needs_input_grad[0], need_b and ctx.needs_input_grad[1],
                                        a_dtype=ctx.dtypes[0], b_dtype=ctx.dtypes[1], runs_both=_runs_both_op,
                                        block_size=cfg.block_size)
    return grad_a, grad_b, None, None, None, None, None, None, None, None, None


_grouped_gemm_fp8_step_op.register_autograd(_grouped_fp8_step_backward, setup_context=_grouped_fp8_step_setup)


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
    grad_a, grad_b = _grouped_fp8_grads(*_raw_mms(cfg), a, b, grad, group_lens, group_offs, ctx.trans_b,
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
    With gradients, a BLOCKWISE step (block 32, 64 or 128) quantises each operand once for both
    GEMMs that read it and saves fp8 ``a`` and ``b`` for the backward instead of the inputs; the
    results are bit-identical to quantising per GEMM (docs/architecture.md).
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
        if _needs_grad(a, b) and _step_reuses_quantization(cfg):
            return torch.ops.turbo_dispatch.grouped_gemm_fp8_step(
                a, b, group_lens, offs, trans_b, out_dtype, cfg.format.value, cfg.block_size, cfg.scale_dtype.value,
                a.requires_grad, b.requires_grad)[0]
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
