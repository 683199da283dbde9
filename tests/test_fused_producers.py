"""Fused fp8 producers (backends/triton/fused_producers.py) and the modules that use them.

CPU (no marker): the kernels run under the Triton interpreter in a subprocess (TRITON_INTERPRET
must be set before triton is imported). The checks: the high-precision output against a float64
reference within the rounding of its dtype; the fp8 data and scales bit-equal to
``low_precision.quantize`` of that output; the modules' fused (no-grad) forward against the
unfused pair. In process: the modules' unfused path, forward and backward, and state_dict
interchange against the unfused pair, and the plain-torch backwards against autograd.

Inputs keep |value / scale| above 2**-9 (e4m3's smallest subnormal): the interpreter emulates
the fp8 cast in integer arithmetic (backends/triton/quantize.py ``_round_to_fp8_grid``), which
mis-rounds values below that step; GPUs cast with their own instruction.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from subprocess_results import assert_check_passed, collect_results  # noqa: E402

from turbo_dispatch import modules  # noqa: E402
from turbo_dispatch.low_precision import Float8QuantConfig  # noqa: E402

E4M3 = torch.float8_e4m3fn
RECIPES = [("TENSORWISE", None), ("ROWWISE", None), ("BLOCKWISE", 128), ("BLOCKWISE", 32)]
SHAPES = [(7, 200), (3, 130), (2, 33)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _away_from_zero(shape, lo, hi, gen):
    mag = lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    return mag * sign


def _rel_tol(dtype: torch.dtype) -> float:
    return 4 * torch.finfo(dtype).eps


def _kernel_checks() -> list[dict]:
    from turbo_dispatch.backends.triton import fused_producers as fp
    from turbo_dispatch.low_precision import quantize

    gen = torch.Generator().manual_seed(0)
    results = []
    for (m, n) in SHAPES:
        for dname, dt in DTYPES.items():
            x = _away_from_zero((m, n), 0.1, 3.0, gen).to(dt)
            w = _away_from_zero((n,), 0.5, 1.5, gen).to(dt)
            g = _away_from_zero((m, n), 0.25, 4.0, gen).to(dt)
            u = _away_from_zero((m, n), 0.5, 1.5, gen).to(dt)
            xd = x.double()
            norm_ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
            swiglu_ref = F.silu(g.double()) * u.double()
            for gran, bs in RECIPES:
                for what, ref, run in (
                    ("rms", norm_ref, lambda d: fp.rms_norm_quantize(x, w, 1e-6, d, gran, bs, return_out=True)),
                    ("swiglu", swiglu_ref, lambda d: fp.swiglu_quantize(g, u, d, gran, bs, return_out=True)),
                ):
                    for fp8 in ((E4M3, torch.float8_e5m2) if gran == "ROWWISE" else (E4M3,)):
                        name = f"{what}[{m}x{n}-{dname}-{gran}-{bs}-{str(fp8).split('_')[-1]}]"
                        q, out = run(fp8)
                        r = quantize(out, fp8, gran, axis=1, block_size=bs)
                        err = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
                        same = (torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8))
                                and torch.equal(q.scale, r.scale) and q.granularity is r.granularity
                                and q.axis == r.axis and q.block_size == r.block_size)
                        ok = same and err <= _rel_tol(dt) and out.dtype == dt
                        results.append(dict(name=name, ok=ok, detail=f"bit-equal={same} rel err={err:.3g}"))
    return results


def _module_checks() -> list[dict]:
    """The modules' fused path against their unfused path (the kernel module hidden), forward
    without grad and a training step (output, input grad, parameter grads), and that it ran."""
    from turbo_dispatch.backends.triton import fused_producers as fp
    from turbo_dispatch.modules import fused

    calls = {"n": 0}
    for fn_name in ("rms_norm_quantize", "swiglu_quantize"):
        original = getattr(fp, fn_name)

        def counted(*a, _original=original, **k):
            calls["n"] += 1
            return _original(*a, **k)
        setattr(fp, fn_name, counted)
    kernels = fused._kernels

    def step(layer, x, unfused: bool):
        fused._kernels = (lambda: None) if unfused else kernels
        try:
            with torch.no_grad():
                inference = layer(x)
            out, dx, dparams = _forward_backward(layer, x)
        finally:
            fused._kernels = kernels
        return [inference, out, dx, *dparams.values()]

    torch.manual_seed(0)
    results = []
    for gran, bs in RECIPES[:3]:
        cfg = Float8QuantConfig(granularity=gran, block_size=bs)
        for name, layer, x in ((f"module_rms[{gran}]", modules.RMSNormLinear(160, 24, bias=True, fp8_config=cfg),
                                torch.randn(2, 5, 160)),
                               (f"module_swiglu[{gran}]", modules.SwiGLUMLP(40, 136, fp8_config=cfg),
                                torch.randn(9, 40))):
            with torch.no_grad():
                for p in layer.parameters():
                    p.add_(0.5 * torch.sign(p))  # norm weights away from zero, as in the kernel checks
            before = calls["n"]
            got = step(layer, x, unfused=False)
            ran = calls["n"] == before + 2
            want = step(layer, x, unfused=True)
            errs = [((g - w).norm() / w.norm()).item() for g, w in zip(got, want)]
            ok = ran and calls["n"] == before + 2 and max(errs) < 5e-3
            detail = f"fused kernel ran={ran} rel errs={[f'{e:.2g}' for e in errs]}"
            results.append(dict(name=name, ok=ok, detail=detail))
    return results


KERNEL_NAMES = [f"{what}[{m}x{n}-{d}-{g}-{bs}-{fp8}]" for (m, n) in SHAPES for d in DTYPES for g, bs in RECIPES
                for what in ("rms", "swiglu") for fp8 in (("e4m3fn", "e5m2") if g == "ROWWISE" else ("e4m3fn",))]
MODULE_NAMES = [f"module_{w}[{g}]" for g, _ in RECIPES[:3] for w in ("rms", "swiglu")]


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--interpreter-checks"], env=env, capture_output=True,
                          text=True, timeout=240)
    return collect_results(proc)


@pytest.mark.parametrize("name", KERNEL_NAMES + MODULE_NAMES)
def test_interpreter(interpreter_results, name):
    assert_check_passed(interpreter_results, name)


class _NormLinearPair(torch.nn.Module):
    """The unfused pair under the names RMSNormLinear documents."""

    def __init__(self, hidden, out, bias, fp8_config=None):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-6)
        self.linear = modules.Linear(hidden, out, bias=bias, fp8_config=fp8_config)

    def forward(self, x):
        return self.linear(self.norm(x))


class _LlamaMLP(torch.nn.Module):
    def __init__(self, hidden, ffn):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.up_proj = torch.nn.Linear(hidden, ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _forward_backward(layer, x):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out.detach(), x.grad, {k: p.grad for k, p in layer.named_parameters()}


def _assert_same_step(a, b):
    for ta, tb in ((a[0], b[0]), (a[1], b[1])):
        torch.testing.assert_close(ta, tb, rtol=1e-5, atol=1e-6)
    assert a[2].keys() == b[2].keys()
    for k in a[2]:
        torch.testing.assert_close(a[2][k], b[2][k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_rms_norm_linear_matches_the_pair(bias):
    torch.manual_seed(1)
    pair = _NormLinearPair(48, 20, bias)
    with torch.no_grad():
        pair.norm.weight.uniform_(0.5, 1.5)
    fused = modules.RMSNormLinear(48, 20, eps=1e-6, bias=bias)
    fused.load_state_dict(pair.state_dict())
    x = torch.randn(3, 7, 48)
    _assert_same_step(_forward_backward(fused, x), _forward_backward(pair, x))
    back = _NormLinearPair(48, 20, bias)
    back.load_state_dict(fused.state_dict())
    assert sorted(back.state_dict()) == sorted(fused.state_dict())


def test_swiglu_mlp_matches_the_llama_mlp():
    torch.manual_seed(2)
    ref = _LlamaMLP(24, 40)
    mlp = modules.SwiGLUMLP(24, 40)
    mlp.load_state_dict(ref.state_dict())
    x = torch.randn(11, 24)
    _assert_same_step(_forward_backward(mlp, x), _forward_backward(ref, x))
    _LlamaMLP(24, 40).load_state_dict(mlp.state_dict())


def test_fp8_modules_on_cpu_take_the_unfused_path(monkeypatch):
    """Without a GPU or the interpreter the fp8 modules are the unfused pair, with or without grad."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(3)
    cfg = Float8QuantConfig(granularity="rowwise")
    layer, pair = modules.RMSNormLinear(64, 16, fp8_config=cfg), _NormLinearPair(64, 16, False, fp8_config=cfg)
    pair.load_state_dict(layer.state_dict())
    mlp = modules.SwiGLUMLP(64, 96, fp8_config=cfg)
    x = torch.randn(5, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), pair(x), rtol=0, atol=0)
        assert mlp(x).shape == x.shape
    _assert_same_step(_forward_backward(layer, x), _forward_backward(pair, x))


def test_plain_torch_backwards_match_autograd():
    fp = pytest.importorskip("turbo_dispatch.backends.triton.fused_producers")
    torch.manual_seed(4)
    x, w, dy = torch.randn(6, 37, dtype=torch.float64), torch.rand(37, dtype=torch.float64) + 0.5, torch.randn(6, 37)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr).backward(dy.double())
    dx, dw = fp.rms_norm_backward(x, w, 1e-6, dy)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, wr.grad, rtol=1e-5, atol=1e-6)
    g, u = torch.randn(6, 37, dtype=torch.float64, requires_grad=True), torch.randn(6, 37, dtype=torch.float64,
                                                                                     requires_grad=True)
    (F.silu(g) * u).backward(dy.double())
    dg, du = fp.swiglu_backward(g.detach(), u.detach(), dy)
    torch.testing.assert_close(dg, g.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(du, u.grad, rtol=1e-5, atol=1e-6)


def test_doctests(monkeypatch):
    import doctest

    from turbo_dispatch.modules import fused
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = doctest.testmod(fused)
    assert result.attempted and not result.failed


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    for check in (_kernel_checks, _module_checks):
        try:
            for r in check():
                print("RESULT " + json.dumps(r), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported per check group, the rest still runs
            import traceback
            traceback.print_exc()
            print(f"{check.__name__} raised {type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(0)
