"""Launchers of the grouped-GEMM Triton kernels (``grouped_kernels``): the grid, the TMA
descriptors and the scale strides for one call, and the zeroing of a padded output's tail rows.
Policy (which config, which backend) stays in ``grouped_gemm``, the adapter module."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from turbo_dispatch.ops.grouped_gemm_compute_units import current_compute_unit_limit

from .interpret import interpreting as _interpreting
from .prebound import CallKeyedKernel

#: A grouped config: (BM, BN, BK, GROUP_M, num_stages, num_warps, tma[, occupancy[, kernel]]).
Config = tuple

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.lru_cache(maxsize=None)
def _triton_reason() -> str | None:
    try:
        import triton
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return f"triton is not importable ({exc})"
    return None if hasattr(triton, "jit") else "triton is installed without triton.jit"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _programs(device: torch.device) -> int:
    """Persistent programs: one per SM (4 under the CPU interpreter, enough to exercise the walk)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _offsets(group_lens: torch.Tensor, group_offs: Optional[torch.Tensor]) -> torch.Tensor:
    if group_offs is not None:
        return group_offs
    return torch.nn.functional.pad(torch.cumsum(group_lens, 0, dtype=torch.int64), (1, 0))


def _upcast(*dtypes: torch.dtype) -> int:
    """UPCAST constexpr: fp32 under the interpreter (its bf16 dot is wrong); fp16 for mixed fp8
    operands, whose MMA not every Triton/GPU pairing accepts (fp16 holds every fp8 value exactly)."""
    if _interpreting():
        return 1
    if dtypes[0] in _FP8 and len(set(dtypes)) > 1 and not _MIXED_FP8_MMA:
        return 2
    return 0


#: Whether tl.dot is given e4m3 x e5m2 operands directly (HYBRID recipes): on CUDA it matches the
#: exact fp16 route and is faster (docs/kernels.md); ROCm keeps the fp16 route (unmeasured).
#: TURBO_TRITON_MIXED_FP8_MMA=0/1 overrides.
_MIXED_FP8_MMA = os.environ.get("TURBO_TRITON_MIXED_FP8_MMA",
                                "0" if getattr(torch.version, "hip", None) else "1") == "1"


def _tma_ok(t: torch.Tensor, rows_stride: int) -> bool:
    """A 2-D TMA view with this row stride (elements) is legal for ``t``'s storage."""
    return t.data_ptr() % 16 == 0 and (rows_stride * t.element_size()) % 16 == 0


def _tma_descriptor_cls():
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # pragma: no cover - older Triton: the pointer path serves
        return None
    return TensorDescriptor


# -- launchers ------------------------------------------------------------------------------------------
def launch_fixed_k(a: torch.Tensor, b_gnk: torch.Tensor, out: torch.Tensor, offs: torch.Tensor, cfg: Config, *,
                   scale: int = 0, sa: Optional[torch.Tensor] = None, sa_strides=(0, 0),
                   sb: Optional[torch.Tensor] = None, sb_strides=(0, 0, 0), qblock: int = 128, sb_ndiv: int = 1,
                   upcast: int = 0) -> torch.Tensor:
    """out[s_g:e_g] = a[s_g:e_g] @ b_gnk[g].T for every group (b_gnk is a [G, N, K] *view*, any strides),
    and zeros in the rows past the last group (``offs[G] < M``: a padded buffer).

    ``sa_strides`` are (row, k-block) strides of a's scale, ``sb_strides`` (group, n-index, k-block)
    of b's scale, whose n-index is ``col // sb_ndiv``.
    """
    from .grouped_kernels import grouped_fixed_k_kernel

    m, k = a.shape
    g, n, _ = b_gnk.shape
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bm, bn, bk, group_m, stages, warps, tma = cfg[:7]
    occupancy = cfg[7] if len(cfg) > 7 else 1
    a_desc = b_desc = None
    use_tma = (bool(tma) and not _interpreting() and a.is_cuda and torch.version.hip is None
               and _tma_descriptor_cls() is not None)
    b_kmajor = b_gnk.stride(2) == 1
    if use_tma:
        desc = _tma_descriptor_cls()
        a_ok = a.stride(1) == 1 and _tma_ok(a, a.stride(0))
        if b_kmajor:
            b_ok = b_gnk.stride(0) == n * b_gnk.stride(1) and _tma_ok(b_gnk, b_gnk.stride(1))
        else:
            b_ok = (b_gnk.stride(1) == 1 and b_gnk.stride(0) == k * b_gnk.stride(2) and k % bk == 0
                    and _tma_ok(b_gnk, b_gnk.stride(2)))
        use_tma = a_ok and b_ok
        if use_tma:
            a_desc = desc(a, [m, k], [a.stride(0), 1], [bm, bk])
            if b_kmajor:
                b_desc = desc(b_gnk, [g * n, k], [b_gnk.stride(1), 1], [bn, bk])
            else:
                b_desc = desc(b_gnk, [g * k, n], [b_gnk.stride(2), 1], [bk, bn])
    num_n = -(-n // bn)
    bound = (-(-m // bm) + g + 1) * num_n  # most tiles any routing can give (the +1: the padded tail)
    progs = max(1, min(_programs(a.device) * occupancy, bound))
    cap = current_compute_unit_limit()  # the caller's num_cu: one SM per program at most
    if cap is not None:
        progs = min(progs, cap)
    sa = a if sa is None else sa
    sb = a if sb is None else sb
    grouped_fixed_k_kernel[(progs,)](
        a, b_gnk, out, offs, sa, sb, a_desc, b_desc,
        g, m, n, k, progs,
        a.stride(0), a.stride(1), b_gnk.stride(0), b_gnk.stride(1), b_gnk.stride(2), out.stride(0), out.stride(1),
        *sa_strides, *sb_strides,
        SCALE=scale, QBLOCK=qblock, SB_NDIV=sb_ndiv, BM=bm, BN=bn, BK=bk, GROUP_M=group_m,
        EVEN_K=(k % bk == 0), USE_TMA=use_tma, B_KMAJOR=b_kmajor, UPCAST=upcast,
        num_stages=stages, num_warps=warps,
    )
    return out


def zero_padded_tail(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[offs[-1]:] = 0`` for an ``[M, N]`` output whose kernel wrote only its groups' rows,
    with the boundary read on the device (no host sync, capturable): the padded-tail contract of
    the fixed-K grouped GEMM for kernels that do not keep it themselves."""
    prepare_zero_padded_tail(out, offs)
    return out


def prepare_zero_padded_tail(out: torch.Tensor, offs: torch.Tensor):
    """``zero_padded_tail(out, offs)`` now, and ``rezero(out, offs)`` for later calls whose tensors
    match these in dtype, shape, device and 16-byte alignment: through this call's pre-bound
    plan, without the per-call key."""
    m, n = out.shape
    if not (m and n):
        return lambda out, offs: None
    bm, bn = 64, 128
    return _zero_rows_launcher().launch_and_plan(
        (-(-m // bm),), (out, offs, offs.shape[0] - 1, m, n, out.stride(0), out.stride(1)), dict(BM=bm, BN=bn))


@functools.lru_cache(maxsize=None)
def _zero_rows_launcher() -> CallKeyedKernel:
    """``zero_rows_past_kernel``'s pre-bound launcher (it runs on every call of the TORCH grouped
    GEMMs with a padded tail and of the Gluon varlen attention: per-call binding would be host
    time on every step)."""
    from .grouped_kernels import zero_rows_past_kernel

    return CallKeyedKernel(zero_rows_past_kernel, ("c_ptr", "offs_ptr"))


def _vk_descriptor(t: torch.Tensor, bc: int, bk: int):
    """TMA descriptor over a ``[T, cols]`` wgrad operand and whether it is token-contiguous, or
    (None, False) when its layout is not TMA-legal (then the pointer path serves).

    Token-contiguous operands (token stride 1: the fp8 quantiser's output) are described as
    ``[cols, T]`` with ``[bc, bk]`` boxes, token-major ones (column stride 1) as ``[T, cols]`` with
    ``[bk, bc]`` boxes. The other stride must be 16-byte aligned, and so must the base.
    """
    desc = _tma_descriptor_cls()
    tokens, cols = t.shape
    if desc is None:
        return None, False
    if t.stride(0) == 1 and _tma_ok(t, t.stride(1)):
        return desc(t, [cols, tokens], [t.stride(1), 1], [bc, bk]), True
    if t.stride(1) == 1 and _tma_ok(t, t.stride(0)):
        return desc(t, [tokens, cols], [t.stride(0), 1], [bk, bc]), False
    return None, False


def launch_variable_k(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor, offs: torch.Tensor, cfg: Config, *,
                      scale: int = 0, sx: Optional[torch.Tensor] = None, sx_strides=(0, 0),
                      sy: Optional[torch.Tensor] = None, sy_strides=(0, 0), qblock: int = 128,
                      upcast: int = 0, tma_in_interpreter: bool = False) -> torch.Tensor:
    """out[g] = x_g^T @ y_g over each group's tokens; x [T, M], y [T, N] are views with any strides.

    ``sx_strides``/``sy_strides`` are the (token-block, column) strides of the scales. Every
    element of ``out`` is written (empty groups get zeros). With ``tma`` set in the config and
    both operands TMA-legal (token-contiguous or token-major, 16-byte aligned strides and base)
    both are loaded through TMA descriptors; otherwise both take the pointer path, which accepts
    any strides. ``tma_in_interpreter`` lets tests run the descriptor path under the CPU
    interpreter (which otherwise always takes pointers).
    """
    from .grouped_kernels import grouped_variable_k_kernel

    g, m, n = out.shape
    if g * m * n == 0:
        return out
    if x.shape[0] == 0:
        return out.zero_()
    bm, bn, bk, group_m, stages, warps, tma = cfg[:7]
    x_desc = y_desc = None
    x_tc = y_tc = False
    if tma and (tma_in_interpreter if _interpreting() else (x.is_cuda and torch.version.hip is None)):
        x_desc, x_tc = _vk_descriptor(x, bm, bk)
        y_desc, y_tc = _vk_descriptor(y, bn, bk)
        if x_desc is None or y_desc is None:
            x_desc = y_desc = None
            x_tc = y_tc = False
    sx = x if sx is None else sx
    sy = x if sy is None else sy
    grid = (g * -(-m // bm) * -(-n // bn),)
    grouped_variable_k_kernel[grid](
        x, y, out, offs, sx, sy, x_desc, y_desc, m, n,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), out.stride(0), out.stride(1), out.stride(2),
        *sx_strides, *sy_strides,
        SCALE=scale, QBLOCK=qblock, BM=bm, BN=bn, BK=bk, GROUP_M=group_m, UPCAST=upcast,
        USE_TMA=x_desc is not None, X_TCONTIG=x_tc, Y_TCONTIG=y_tc,
        num_stages=stages, num_warps=warps,
    )
    return out


# -- configs ---------------------------------------------------------------------------------------------
