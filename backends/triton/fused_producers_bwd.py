"""Backwards of the fused fp8 producers in Triton: RMSNorm and SwiGLU, one read of each input.

``rms_norm_backward`` and ``swiglu_backward`` compute in float32 and round to the inputs' dtypes,
the gradients of the float32 ops ``y = x * rsqrt(mean(x^2) + eps) * weight`` and
``h = silu(gate) * up``. Written as torch expressions in float32 these are a dozen elementwise
passes, each reading and writing float32 copies of ``[tokens, width]`` tensors; here each input
is read once and each gradient written once:

* SwiGLU: an elementwise kernel over ``[M, F]`` tiles (gate and up may be views of one
  ``[M, 2F]`` projection: only the last stride must be 1);
* RMSNorm: each program walks a contiguous run of rows with the whole row in registers,
  recomputes the row's rstd from x (cheaper than storing it in the forward), writes dx and keeps
  its rows' share of ``dweight`` in float32 registers; the shares (one row per program) are
  summed by torch. Rows longer than ``MAX_ROW`` go to the float32 torch formula.

Tensors the kernels cannot run on (CPU tensors without ``TRITON_INTERPRET=1``) take the float32
torch formulas, with the same results up to float32 rounding. Both return fresh contiguous tensors; zero-size inputs give zero-size gradients (and a zero
``dweight``).
"""
from __future__ import annotations

import torch

from .quantize import _interpreting, _next_pow2, available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["MAX_ROW", "available", "rms_norm_backward", "serves", "swiglu_backward"]

#: The longest RMSNorm row one program holds in registers (16 warps: 32 float32 values per
#: thread per row tensor).
MAX_ROW = 16384
#: Columns per SwiGLU program: 8 warps of 16-byte bf16 vectors, twice over.
_SWIGLU_BLOCK = 2048
#: RMSNorm programs per SM: each keeps one float32 ``dweight`` share, so more programs cost more
#: share rows to sum, fewer leave the GPU idle on short batches.
_RMS_PROGRAMS_PER_SM = 4

if triton is not None:

    @triton.jit
    def _swiglu_bwd_kernel(g_ptr, u_ptr, d_ptr, dg_ptr, du_ptr, F, sg, su, sd, sdg, sdu, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + row * sd + cols, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        dgate = d * u * sig * (1.0 + g * (1.0 - sig))
        dup = d * g * sig
        tl.store(dg_ptr + row * sdg + cols, dgate.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + row * sdu + cols, dup.to(du_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, M, N, sx, sdy, sdx, rows_per_program, eps,
                             BLOCK_N: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        first = pid.to(tl.int64) * rows_per_program  # int64 rows: row * stride may pass 2**31
        last = tl.minimum(first + rows_per_program, M)
        for row in range(first, last):
            x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
            xhat = x * rstd
            wdy = dy * w
            c = tl.sum(wdy * xhat, axis=0) / N
            dx = rstd * (wdy - xhat * c)
            tl.store(dx_ptr + row * sdx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * xhat
        tl.store(dw_ptr + pid.to(tl.int64) * N + cols, dw, mask=mask)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_pair(name: str, **tensors: torch.Tensor) -> None:
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    if any(t.dim() != 2 for t in tensors.values()) or len(set(shapes.values())) != 1:
        raise ValueError(f"{name}: {', '.join(tensors)} must be 2-D of one shape; got {shapes}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{name}: {', '.join(tensors)} must be on one device; got {sorted(map(str, devices))}")


def serves(x: torch.Tensor) -> bool:
    """Whether the producers' kernels (fused_producers.py and these) can run on ``x``'s device
    here (a GPU tensor, or any under the interpreter); ``available()`` must also be None."""
    return x.is_cuda or _interpreting()


def _kernels_run_on(t: torch.Tensor) -> bool:
    return triton is not None and serves(t)


def _program_count(device: torch.device, rows: int) -> int:
    if device.type != "cuda":  # the interpreter: few programs, each walking many rows
        return max(1, min(rows, 4))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(rows, _RMS_PROGRAMS_PER_SM * sms))


def swiglu_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of ``h = silu(gate) * up`` for ``[M, F]`` tensors, in float32 math, each in
    its input's dtype."""
    _check_pair("swiglu_backward", gate=gate, up=up, dh=dh)
    if not _kernels_run_on(gate):
        return _swiglu_backward_torch(gate, up, dh)
    gate, up, dh = (_rows_contiguous(t) for t in (gate, up, dh))
    m, f = gate.shape
    dgate = torch.empty((m, f), dtype=gate.dtype, device=gate.device)
    dup = torch.empty((m, f), dtype=up.dtype, device=up.device)
    if m and f:
        _swiglu_bwd_kernel[(m, triton.cdiv(f, _SWIGLU_BLOCK))](
            gate, up, dh, dgate, dup, f, gate.stride(0), up.stride(0), dh.stride(0), dgate.stride(0), dup.stride(0),
            BLOCK=_SWIGLU_BLOCK, num_warps=8)
    return dgate, dup


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) of ``y = x * rsqrt(mean(x^2) + eps) * weight`` over the last dim of
    ``x[M, N]``, in float32 math; dx in x's dtype, dweight (summed over the rows) in weight's."""
    _check_pair("rms_norm_backward", x=x, dy=dy)
    m, n = x.shape
    if weight.shape != (n,):
        raise ValueError(f"rms_norm_backward: weight must have shape ({n},); got {tuple(weight.shape)}")
    if n > MAX_ROW or not _kernels_run_on(x):
        return _rms_norm_backward_torch(x, weight, eps, dy)
    x, dy, weight = _rows_contiguous(x), _rows_contiguous(dy), weight.contiguous()
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return dx, torch.zeros_like(weight)
    programs = _program_count(x.device, m)
    rows_per_program = -(-m // programs)
    programs = -(-m // rows_per_program)
    shares = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    block_n = _next_pow2(n)
    _rms_norm_bwd_kernel[(programs,)](x, weight, dy, dx, shares, m, n, x.stride(0), dy.stride(0), dx.stride(0),
                                      rows_per_program, float(eps), BLOCK_N=block_n,
                                      num_warps=max(1, min(16, block_n // 256)))
    return dx, shares.sum(0).to(weight.dtype)


def _rms_norm_backward_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, dy: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    xf, wf, dyf = x.float(), weight.float(), dy.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    dxhat = dyf * wf
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def _swiglu_backward_torch(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, d = gate.float(), up.float(), dh.float()
    sig = torch.sigmoid(g)
    dgate = d * u * sig * (1.0 + g * (1.0 - sig))
    dup = d * g * sig
    return dgate.to(gate.dtype), dup.to(up.dtype)
