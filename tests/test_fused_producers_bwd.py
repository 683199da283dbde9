"""Backwards of the fused fp8 producers (backends/triton/fused_producers_bwd.py).

CPU: the kernels run under the Triton interpreter in a subprocess (TRITON_INTERPRET must be set
before triton is imported) against float64 autograd of the same ops, on random inputs away from
zero, odd widths (one row wider than a SwiGLU program's columns), a single row, strided views
(gate and up halves of one projection), bf16, fp16 and fp32; in process: bad shapes raise
naming the arguments, zero-size inputs give zero-size gradients.

GPU (marker ``gpu``): the same checks on the GPU at model widths.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from subprocess_results import assert_check_passed, interpreter_checks  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SWIGLU_SHAPES = [(7, 200), (3, 2100), (1, 1)]
RMS_SHAPES = [(7, 200), (33, 130), (1, 5), (5, 1024)]


def _away_from_zero(shape, lo, hi, gen):
    mag = lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)
    return mag * torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """Normwise within 2 ulps of ``dtype`` and every element within one ulp of the largest."""
    eps = torch.finfo(dtype).eps if dtype != torch.float32 else 1e-6
    diff = (got.double() - ref).abs()
    norm_err = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
    max_err = (diff.max() / ref.abs().max().clamp_min(1e-30)).item() if ref.numel() else 0.0
    ok = got.dtype == dtype and norm_err <= 2 * eps and max_err <= 2 * eps
    return ok, f"normwise {norm_err:.3g}, max {max_err:.3g} (eps {eps:.3g})"


def _swiglu_reference(g, u, d):
    g64, u64 = (t.double().requires_grad_() for t in (g, u))
    (F.silu(g64) * u64).backward(d.double())
    return g64.grad, u64.grad


def _rms_reference(x, w, dy, eps):
    x64, w64 = (t.double().requires_grad_() for t in (x, w))
    (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64).backward(dy.double())
    return x64.grad, w64.grad


def checks(device: str) -> list[dict]:
    from turbo_dispatch.backends.triton import fused_producers_bwd as fpb

    gen = torch.Generator().manual_seed(0)
    results = []
    for (m, f) in SWIGLU_SHAPES:
        for dname, dt in DTYPES.items():
            both = _away_from_zero((m, 2 * f), 0.25, 4.0, gen).to(dt)
            g, u = both[:, :f], both[:, f:]  # halves of one projection: row stride 2F
            d = _away_from_zero((m, f), 0.5, 1.5, gen).to(dt)
            ref = _swiglu_reference(g, u, d)
            got = fpb.swiglu_backward(g.to(device), u.to(device), d.to(device))
            verdicts = [_close(a.cpu(), b, dt) for a, b in zip(got, ref)]
            results.append(dict(name=f"swiglu[{m}x{f}-{dname}]", ok=all(v[0] for v in verdicts),
                                detail="; ".join(v[1] for v in verdicts)))
    for (m, n) in RMS_SHAPES:
        for dname, dt in DTYPES.items():
            x = _away_from_zero((m, n), 0.1, 3.0, gen).to(dt)
            w = _away_from_zero((n,), 0.5, 1.5, gen).to(dt)
            dy = _away_from_zero((m, n), 0.5, 1.5, gen).to(dt)
            ref = _rms_reference(x, w, dy, 1e-6)
            got = fpb.rms_norm_backward(x.to(device), w.to(device), 1e-6, dy.to(device))
            # dweight sums M rows: its rounding grows with M in float32 before the final cast
            verdicts = [_close(got[0].cpu(), ref[0], dt), _close(got[1].cpu(), ref[1], dt)]
            results.append(dict(name=f"rms[{m}x{n}-{dname}]", ok=all(v[0] for v in verdicts),
                                detail="; ".join(v[1] for v in verdicts)))
    return results


NAMES = ([f"swiglu[{m}x{f}-{d}]" for (m, f) in SWIGLU_SHAPES for d in DTYPES]
         + [f"rms[{m}x{n}-{d}]" for (m, n) in RMS_SHAPES for d in DTYPES])


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    return interpreter_checks(__file__)


@pytest.mark.parametrize("name", NAMES)
def test_interpreter(interpreter_results, name):
    assert_check_passed(interpreter_results, name)


def test_bad_shapes_name_the_arguments():
    from turbo_dispatch.backends.triton import fused_producers_bwd as fpb

    with pytest.raises(ValueError, match="gate, up, dh"):
        fpb.swiglu_backward(torch.ones(2, 3), torch.ones(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="x, dy"):
        fpb.rms_norm_backward(torch.ones(2, 3), torch.ones(3), 1e-6, torch.ones(3))
    with pytest.raises(ValueError, match="weight"):
        fpb.rms_norm_backward(torch.ones(2, 3), torch.ones(4), 1e-6, torch.ones(2, 3))


def test_zero_size_inputs_give_zero_size_gradients():
    from turbo_dispatch.backends.triton import fused_producers_bwd as fpb

    dg, du = fpb.swiglu_backward(*(torch.ones(0, 5, dtype=torch.bfloat16) for _ in range(3)))
    assert dg.shape == du.shape == (0, 5) and dg.dtype == torch.bfloat16
    dx, dw = fpb.rms_norm_backward(torch.ones(0, 5), torch.ones(5), 1e-6, torch.ones(0, 5))
    assert dx.shape == (0, 5) and torch.equal(dw, torch.zeros(5))


def test_rows_past_max_row_take_the_torch_formula():
    from turbo_dispatch.backends.triton import fused_producers_bwd as fpb

    n = fpb.MAX_ROW + 3
    gen = torch.Generator().manual_seed(1)
    x, dy = _away_from_zero((2, n), 0.1, 3.0, gen).float(), _away_from_zero((2, n), 0.5, 1.5, gen).float()
    w = _away_from_zero((n,), 0.5, 1.5, gen).float()
    ref = _rms_reference(x, w, dy, 1e-6)
    got = fpb.rms_norm_backward(x, w, 1e-6, dy)
    assert all(_close(a, b, torch.float32)[0] for a, b in zip(got, ref))


@pytest.mark.gpu
def test_gpu_matches_reference():
    from turbo_dispatch.backends.triton import fused_producers_bwd as fpb

    if not torch.cuda.is_available() or fpb.available() is not None:
        pytest.skip("needs a GPU with triton")
    for r in checks("cuda"):
        assert r["ok"], (r["name"], r["detail"])


@pytest.mark.gpu
@pytest.mark.parametrize("m, n", [(8192, 4096), (8192, 14336), (4095, 8192)])
def test_gpu_model_widths(m, n):
    from turbo_dispatch.backends.triton import fused_producers_bwd as fpb

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gen = torch.Generator().manual_seed(2)
    x, dy = (_away_from_zero((m, n), 0.1, 3.0, gen).bfloat16() for _ in range(2))
    w = _away_from_zero((n,), 0.5, 1.5, gen).bfloat16()
    ref = _rms_reference(x, w, dy, 1e-5)
    got = fpb.rms_norm_backward(x.cuda(), w.cuda(), 1e-5, dy.cuda())
    assert all(_close(a.cpu(), b, torch.bfloat16)[0] for a, b in zip(got, ref))
    ref = _swiglu_reference(x, dy, w.expand(m, n).contiguous())
    got = fpb.swiglu_backward(x.cuda(), dy.cuda(), w.expand(m, n).contiguous().cuda())
    assert all(_close(a.cpu(), b, torch.bfloat16)[0] for a, b in zip(got, ref))


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    import json

    for r in checks("cpu"):
        print("RESULT " + json.dumps(r), flush=True)
