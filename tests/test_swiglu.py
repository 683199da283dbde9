"""``ops.swiglu``: ``silu(gate) * up`` through the fused producers' kernels, forward and backward.

Checked against float64 (silu rounded to the dtype before the product, as ``F.silu(gate) * up``
rounds it; four units in the last place: silu's fast division and the interpreter's truncating
cast) on random inputs of odd sizes: leading dimensions, halves of one projection (strided rows),
a single element, each dtype; gradients against float64 autograd of the same expression.
CPU: the torch path in process, the kernels under the interpreter in a subprocess (each check
also asserts the kernels ran). GPU (``gpu``): the same on CUDA tensors.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from subprocess_results import assert_all_passed, assert_check_passed, interpreter_checks  # noqa: E402

from turbo_dispatch.ops import activation, swiglu  # noqa: E402

#: (leading shape, F, whether gate and up are halves of one [..., 2F] projection)
CASES = [((7,), 200, True), ((2, 5), 300, False), ((1,), 1, True), ((3, 1, 4), 4100, True)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = [f"swiglu[{'x'.join(map(str, lead))}x{f}-{'halves' if halves else 'pair'}-{d}]"
         for d in DTYPES for lead, f, halves in CASES]


def _checks(device: str, kernel_expected: bool) -> list[dict]:
    from turbo_dispatch.backends.triton import fused_producers as fp

    calls = []
    originals = {name: getattr(fp, name) for name in ("swiglu", "swiglu_backward")}
    for name, original in originals.items():
        setattr(fp, name, lambda *a, _o=original, _n=name: (calls.append(_n), _o(*a))[1])
    gen = torch.Generator().manual_seed(0)
    results = []
    try:
        for dname, dtype in DTYPES.items():
            for lead, f, halves in CASES:
                name = f"swiglu[{'x'.join(map(str, lead))}x{f}-{'halves' if halves else 'pair'}-{dname}]"
                if halves:
                    both = (6 * torch.rand((*lead, 2 * f), generator=gen, dtype=torch.float64) - 3).to(dtype)
                    both = both.to(device).requires_grad_(True)
                    gate, up = both[..., :f], both[..., f:]
                    leaves = [both]
                else:
                    gate, up = ((6 * torch.rand((*lead, f), generator=gen, dtype=torch.float64) - 3).to(dtype)
                                .to(device).requires_grad_(True) for _ in range(2))
                    leaves = [gate, up]
                del calls[:]
                h = swiglu(gate, up)
                dh = torch.randn(h.shape, generator=gen).to(dtype).to(device)
                grads = torch.autograd.grad(h, leaves, dh)
                g64, u64 = gate.detach().double(), up.detach().double()
                silu = (g64 * torch.sigmoid(g64)).to(dtype).double()
                want = silu * u64
                err = (h.detach().double() - want).abs()
                ok_h = h.shape == gate.shape and bool((err <= 4 * torch.finfo(dtype).eps * want.abs() + 1e-30).all())
                leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
                g, u = (leaves64[0][..., :f], leaves64[0][..., f:]) if halves else leaves64
                want_g = torch.autograd.grad(torch.nn.functional.silu(g) * u, leaves64, dh.double())
                snr = min(float(10 * torch.log10(w.pow(2).sum() / (a.double() - w).pow(2).sum().clamp_min(1e-300)))
                          for a, w in zip(grads, want_g))
                ran = calls == ["swiglu", "swiglu_backward"]
                ok = ok_h and snr >= (40 if dtype != torch.float32 else 100) and (ran or not kernel_expected)
                results.append(dict(name=name, ok=ok, detail=f"max err {float(err.max()):.3g}, grad SNR {snr:.1f} dB, "
                                                             f"kernel calls {calls}"))
    finally:
        for name, original in originals.items():
            setattr(fp, name, original)
    return results


def test_the_torch_path_matches_float64():
    assert_all_passed(_checks("cpu", kernel_expected=False), NAMES)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    return interpreter_checks(__file__, timeout=600)


@pytest.mark.parametrize("name", NAMES)
def test_the_kernels_under_the_interpreter(interpreter_results, name):
    assert_check_passed(interpreter_results, name)


@pytest.mark.gpu
def test_gpu_kernels_match_float64(monkeypatch):
    monkeypatch.delenv(activation.TRITON_ENV, raising=False)
    assert_all_passed(_checks("cuda", kernel_expected=True), NAMES)


def test_zero_size_and_the_switch(monkeypatch):
    out = swiglu(torch.ones(0, 5, requires_grad=True), torch.ones(0, 5))
    assert out.shape == (0, 5)
    monkeypatch.setenv(activation.TRITON_ENV, "0")
    g, u = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(swiglu(g, u), torch.nn.functional.silu(g) * u)
    monkeypatch.setenv(activation.TRITON_ENV, "sometimes")
    with pytest.raises(Exception, match=activation.TRITON_ENV):
        swiglu(g, u)


def test_traced_calls_take_the_torch_path(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from turbo_dispatch.backends.triton import fused_producers as fp

    monkeypatch.setattr(fp, "available", lambda: None)
    monkeypatch.setattr(fp, "serves", lambda x: True)
    monkeypatch.setattr(fp, "swiglu", lambda *a: pytest.fail("the kernel ran on fake tensors"))
    with FakeTensorMode():
        assert swiglu(torch.empty(2, 3, 8), torch.empty(2, 3, 8)).shape == (2, 3, 8)


@pytest.mark.parametrize("call, match", [
    (lambda: swiglu(torch.randn(2, 3), torch.randn(2, 4)), "one shape"),
    (lambda: swiglu(torch.randn(2, 3), torch.randn(2, 3).double()), "one shape, dtype"),
    (lambda: swiglu([1.0], torch.randn(1)), "gate must be a torch.Tensor"),
    (lambda: swiglu(torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)), "gate must be a floating"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_doctests():
    import doctest

    assert doctest.testmod(activation).failed == 0


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    import json

    os.environ.pop(activation.TRITON_ENV, None)  # the checks are of the kernels
    for result in _checks("cpu", kernel_expected=True):
        print("RESULT " + json.dumps(result), flush=True)
