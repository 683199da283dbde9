"""Input checks and numeric checks shared by the ops."""
from __future__ import annotations

import math

import torch

HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)


def require_tensor(op: str, name: str, x: object, ndim: int, shape_hint: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor {shape_hint}; got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{op}: {name} must be a {ndim}-D tensor {shape_hint}; got shape {tuple(x.shape)}")
    return x


def require_dtype(op: str, name: str, dtype: object, allowed=HIGH_PRECISION) -> None:
    if dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{op}: {name} must be one of {names}; got {dtype}")


def require_bool(op: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool; got {value!r}")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.double()
    return float((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-30))


def snr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(signal / noise) in dB: inf for an exact match, -inf for any error on an all-zero
    reference (where a ratio says nothing; callers that expect zeros check them absolutely)."""
    ref64 = ref.double()
    noise = float((out.double() - ref64).pow(2).sum())
    signal = float(ref64.pow(2).sum())
    if noise == 0:
        return math.inf
    return -math.inf if signal == 0 else 10 * math.log10(signal / noise)


#: Relative-error gates per output dtype (bf16's 8-bit mantissa dominates its error).
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}


def check_rel(out: object, ref: torch.Tensor) -> str | None:
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return f"wrong output shape {getattr(out, 'shape', None)} (expected {tuple(ref.shape)})"
    if not torch.isfinite(out).all():
        return "output has NaN/inf"
    err, tol = rel_error(out, ref), REL_TOL.get(out.dtype, 5e-3)
    return None if err <= tol else f"relative error {err:.3e} > {tol:.0e}"


def check_snr(min_db: float):
    def check(out: object, ref: torch.Tensor) -> str | None:
        if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
            return f"wrong output shape {getattr(out, 'shape', None)} (expected {tuple(ref.shape)})"
        db = snr_db(out, ref)
        return None if db >= min_db else f"SNR {db:.1f} dB < {min_db} dB"

    return check
