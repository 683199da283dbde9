"""Rotary position embedding: ``ops.apply_rotary_emb`` and ``ops.split_qkv_rotary_emb``.

Every case is checked against a float64 evaluation of the rotation, forward and gradient (the
gradient of a rotation is the rotation by the opposite angle), on random inputs of odd sizes:
rotate-half and interleaved pairs, full and partial rotary, ``[S, R]`` / ``[1, S, R]`` /
``[B, S, R]`` tables, packed ``[T, H, D]`` input, a non-contiguous input view, each dtype.

CPU (no marker): the torch path in process, and the Triton kernel under the interpreter in a
subprocess (TRITON_INTERPRET must be set before triton is imported; each check also asserts the
kernel ran). The interpreter rounds float32 to bf16/fp16 toward zero where a GPU rounds to
nearest, so the bound allows one unit in the last place of the output's dtype.
GPU (``gpu``): the same checks through the kernel on CUDA tensors.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from subprocess_results import assert_all_passed, assert_check_passed, interpreter_checks  # noqa: E402

from turbo_dispatch.ops import apply_rotary_emb, split_qkv_rotary_emb  # noqa: E402
from turbo_dispatch.ops import rotary  # noqa: E402

#: (B, S, H, D, R, interleaved, table) with table "s" = [S, R], "1" = [1, S, R], "b" = [B, S, R],
#: "t" = packed [T, H, D] input with a [T, R] table.
CASES = [(2, 7, 3, 16, 8, False, "s"), (2, 7, 3, 16, 8, True, "b"), (1, 5, 2, 10, 3, False, "1"),
         (3, 1, 1, 6, 3, True, "s"), (2, 33, 5, 64, 16, False, "b"), (1, 19, 4, 128, 64, False, "s"),
         (1, 13, 3, 24, 6, True, "t"), (1, 9, 2, 32, 16, False, "t")]
#: (lead shape, q heads, kv heads, D, R, interleaved): [B, S] or packed [T].
SPLIT_CASES = [((2, 9), 4, 2, 16, 8, False), ((13,), 3, 1, 8, 2, True), ((1, 17), 8, 1, 128, 64, False),
               ((3, 5), 2, 2, 12, 4, True)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotation of ``x [B, S, H, D]`` in float64 by ``[S, R]`` / ``[Bc, S, R]`` tables."""
    x, c, s = x.double(), cos.double(), sin.double()
    c, s = (c if c.dim() == 3 else c[None])[:, :, None], (s if s.dim() == 3 else s[None])[:, :, None]
    half = cos.shape[-1]
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out, rest), dim=-1)


def _within(got: torch.Tensor, want64: torch.Tensor, source: torch.Tensor) -> tuple[bool, float]:
    """Whether ``got`` is ``want64`` rounded to got's dtype: one unit in its last place, plus
    float32 arithmetic's error on the inputs' magnitude (a pair's difference may cancel)."""
    eps = torch.finfo(got.dtype).eps
    err = (got.detach().double() - want64).abs()
    bound = eps * want64.abs() + 4 * torch.finfo(torch.float32).eps * source.detach().double().abs().amax() + 1e-30
    worst = float((err / bound).max()) if err.numel() else 0.0
    return got.shape == want64.shape and worst <= 1.0, worst


def _tables(b: int, s: int, r: int, kind: str, device: str, gen: torch.Generator):
    shape = {"s": (s, r), "1": (1, s, r), "b": (b, s, r), "t": (b * s, r)}[kind]
    angle = 10 * torch.rand(shape, generator=gen, dtype=torch.float64) - 5
    return angle.cos().float().to(device), angle.sin().float().to(device)


def _checks(device: str, kernel_expected: bool) -> list[dict]:
    """Every case and dtype: forward and gradient within ``_within``, and (``kernel_expected``)
    the kernel launched for each."""
    from turbo_dispatch.backends.triton import rotary as kernel

    launched = {"n": 0}
    original = kernel.rotate_into

    def counted(*args, **kw):
        launched["n"] += 1
        return original(*args, **kw)

    kernel.rotate_into = counted
    results = []
    try:
        gen = torch.Generator().manual_seed(0)
        for dname, dtype in DTYPES.items():
            for case in CASES:
                b, s, h, d, r, inter, kind = case
                name = f"apply[{dname}-{b}x{s}x{h}x{d}-r{r}-{'il' if inter else 'half'}-{kind}]"
                base = torch.randn((b, h, s, d), generator=gen).to(dtype).to(device)
                x = base.transpose(1, 2) if kind != "t" else base.reshape(b * s, h, d)  # a strided view
                x.requires_grad_(True)
                cos, sin = _tables(b, s, r, kind, device, gen)
                before = launched["n"]
                out = apply_rotary_emb(x, cos, sin, interleaved=inter)
                grad = torch.randn(out.shape, generator=gen).to(dtype).to(device)
                (gx,) = torch.autograd.grad(out, x, grad)
                x4, g4 = (x, grad) if kind != "t" else (x[None], grad[None])
                c4, s4 = (cos, sin) if kind != "t" else (cos[None], sin[None])
                want = _rotate64(x4.detach(), c4, s4, inter)
                want_g = _rotate64(g4, c4, -s4, inter)
                ok1, w1 = _within(out, want.squeeze(0) if kind == "t" else want, x)
                ok2, w2 = _within(gx, want_g.squeeze(0) if kind == "t" else want_g, grad)
                ran = launched["n"] - before == 2
                ok = ok1 and ok2 and out.is_contiguous() and (ran or not kernel_expected)
                results.append(dict(name=name, ok=ok, detail=f"worst/bound fwd {w1:.3g} grad {w2:.3g}, "
                                                             f"kernel launches {launched['n'] - before}"))
            for lead, hq, hkv, d, r, inter in SPLIT_CASES:
                name = f"split[{dname}-{'x'.join(map(str, lead))}-{hq}/{hkv}x{d}-r{r}-{'il' if inter else 'half'}]"
                width = (hq + 2 * hkv) * d
                wide = torch.randn((*lead, width + 5), generator=gen).to(dtype).to(device)
                qkv = wide[..., 3:3 + width]  # rows strided wider than the projection
                qkv.requires_grad_(True)
                seq = lead[-1] if len(lead) == 2 else lead[0]
                cos, sin = _tables(1, seq, r, "s", device, gen)
                before = launched["n"]
                q, k, v = split_qkv_rotary_emb(qkv, hq, hkv, cos, sin, interleaved=inter)
                grads = [torch.randn(t.shape, generator=gen).to(dtype).to(device) for t in (q, k, v)]
                (gqkv,) = torch.autograd.grad((q, k, v), qkv, grads)
                heads4 = qkv.detach().reshape(*lead, hq + 2 * hkv, d)
                heads4 = heads4 if len(lead) == 2 else heads4[None]
                wants = [_rotate64(heads4[:, :, :hq], cos, sin, inter), _rotate64(heads4[:, :, hq:hq + hkv], cos,
                                                                                   sin, inter),
                         heads4[:, :, hq + hkv:].double()]
                g4 = [g if len(lead) == 2 else g[None] for g in grads]
                want_g = torch.cat([_rotate64(g4[0], cos, -sin, inter).flatten(-2),
                                    _rotate64(g4[1], cos, -sin, inter).flatten(-2), g4[2].double().flatten(-2)], -1)
                squeeze = (lambda t: t) if len(lead) == 2 else (lambda t: t.squeeze(0))
                checks = [_within(o, squeeze(w), qkv) for o, w in zip((q, k, v), wants)]
                checks.append(_within(gqkv, squeeze(want_g), torch.cat([g.flatten() for g in grads])))
                ran = launched["n"] - before == 6
                ok = all(c[0] for c in checks) and all(t.is_contiguous() for t in (q, k, v)) and \
                    (ran or not kernel_expected)
                results.append(dict(name=name, ok=ok, detail=f"worst/bound {[round(c[1], 3) for c in checks]}, "
                                                             f"kernel launches {launched['n'] - before}"))
    finally:
        kernel.rotate_into = original
    return results


def _names() -> list[str]:
    names = []
    for dname in DTYPES:
        names += [f"apply[{dname}-{b}x{s}x{h}x{d}-r{r}-{'il' if i else 'half'}-{k}]" for b, s, h, d, r, i, k in CASES]
        names += [f"split[{dname}-{'x'.join(map(str, lead))}-{hq}/{hkv}x{d}-r{r}-{'il' if i else 'half'}]"
                  for lead, hq, hkv, d, r, i in SPLIT_CASES]
    return names


NAMES = _names()


def test_the_torch_path_matches_float64():
    assert_all_passed(_checks("cpu", kernel_expected=False), NAMES)


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    return interpreter_checks(__file__, timeout=600)


@pytest.mark.parametrize("name", NAMES)
def test_the_kernel_under_the_interpreter(interpreter_results, name):
    assert_check_passed(interpreter_results, name)


@pytest.mark.gpu
def test_gpu_kernel_matches_float64(monkeypatch):
    monkeypatch.delenv(rotary.TRITON_ENV, raising=False)
    assert_all_passed(_checks("cuda", kernel_expected=True), NAMES)


@pytest.mark.gpu
def test_gpu_kernel_and_torch_path_agree_at_llama_sizes(monkeypatch):
    """Llama-3.1-8B's attention input (B2 S4096, 32/8 heads of 128): the kernel's q, k, v and
    packed gradient against the torch path's, one rounding apart at most."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn((2, 4096, 48 * 128), generator=gen, device="cuda").bfloat16().requires_grad_(True)
    angle = torch.outer(torch.arange(4096.0, device="cuda"), 500000.0 ** (-torch.arange(0, 128, 2, device="cuda")
                                                                             / 128))
    cos, sin = angle.cos(), angle.sin()
    grads = [torch.randn(s, generator=gen, device="cuda").bfloat16() for s in ((2, 4096, 32, 128),
                                                                               (2, 4096, 8, 128), (2, 4096, 8, 128))]
    got = []
    for switch in ("1", "0"):
        monkeypatch.setenv(rotary.TRITON_ENV, switch)
        outs = split_qkv_rotary_emb(qkv, 32, 8, cos, sin)
        got.append([*outs, *torch.autograd.grad(outs, qkv, grads)])
    for a, b in zip(*got):
        ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(1e-3)
        assert ((a.float() - b.float()).abs() <= ulp).all()


def test_the_kernel_compiles_for_sm90_and_gfx942(tmp_path):
    """Every launch form (rotate-half and interleaved, forward and inverse, copy) compiles for
    sm_90 without spills (tools/compile_sm90.py, family ``rotary``) and for MI300's gfx942
    (tools/compile_rocm.py); a machine whose triton lacks either toolchain skips that half."""
    from test_compile_sm90 import _nvidia_toolchain

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ran = []
    if _nvidia_toolchain() is None:
        out = tmp_path / "sm90.json"
        proc = subprocess.run([sys.executable, os.path.join(root, "tools", "compile_sm90.py"), "--only", "rotary",
                               "--json", str(out)], capture_output=True, text=True, env=env, cwd=root, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        rows = json.loads(out.read_text())["rows"]
        assert len(rows) == 32 and all(r["status"] == "PASS" and r["stack"] == 0 for r in rows), rows
        ran.append("sm_90")
    out = tmp_path / "rocm.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "compile_rocm.py"), "--only",
                           "rotary_fwd,rotary_bwd,rotary_copy", "--json", str(out)], capture_output=True, text=True,
                          env=dict(env, TRITON_CACHE_DIR=str(tmp_path / "cache")), cwd=root, timeout=600)
    if proc.returncode != 77:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        rows = json.loads(out.read_text())["rows"]
        assert len(rows) == 6 and all(r["status"] == "PASS" and r["scratch"] == 0 for r in rows), rows
        ran.append("gfx942")
    if not ran:
        pytest.skip("this triton compiles for neither sm_90 nor gfx942 here")


def test_torch_compile_traces_both_ops_without_graph_breaks():
    """Under torch.compile the ops are torch ops (Inductor fuses them): fullgraph tracing works and
    gives the eager results, gradients included."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((2, 6, 3, 16), generator=gen, requires_grad=True)
    angle = torch.randn((6, 5), generator=gen)
    cos, sin = angle.cos(), angle.sin()
    compiled = torch.compile(lambda t: apply_rotary_emb(t, cos, sin, interleaved=True), fullgraph=True)
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    eager = apply_rotary_emb(x, cos, sin, interleaved=True)
    (eager_grad,) = torch.autograd.grad(eager.square().sum(), x)
    assert torch.allclose(out, eager, atol=1e-6) and torch.allclose(grad, eager_grad, atol=1e-5)
    qkv = torch.randn((2, 6, 4 * 16), generator=gen)
    split = torch.compile(lambda t: split_qkv_rotary_emb(t, 2, 1, cos, sin), fullgraph=True)
    for a, b in zip(split(qkv), split_qkv_rotary_emb(qkv, 2, 1, cos, sin)):
        assert torch.allclose(a, b, atol=1e-6)


def test_the_kernel_paths_second_derivative_raises_instead_of_being_wrong():
    """Under the interpreter (a subprocess) the kernel path's backward refuses to be
    differentiated again rather than handing back a graph without the rotation."""
    pytest.importorskip("triton")
    code = ("import torch\nfrom turbo_dispatch.ops import apply_rotary_emb\n"
            "x = torch.randn(1, 3, 2, 8, requires_grad=True)\na = torch.randn(3, 4)\n"
            "y = apply_rotary_emb(x, a.cos(), a.sin())\n"
            "(g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)\n"
            "try:\n    g.sum().backward()\nexcept RuntimeError as exc:\n    print('raised', 'twice' in str(exc))\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop(rotary.TRITON_ENV, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "raised True", proc.stdout + proc.stderr[-2000:]


def test_traced_calls_take_the_torch_path(monkeypatch):
    """Under a fake-tensor mode (as AOT autograd and export trace) the kernel is never launched,
    even where it would serve the call: the torch expression gives the shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from turbo_dispatch.backends.triton import rotary as kernel

    monkeypatch.setattr(kernel, "available", lambda: None)
    monkeypatch.setattr(kernel, "serves", lambda x: True)
    monkeypatch.setattr(kernel, "rotate_into", lambda *a, **k: pytest.fail("the kernel ran on fake tensors"))
    with FakeTensorMode():
        q, k, v = split_qkv_rotary_emb(torch.empty(2, 9, 64), 2, 1, torch.empty(9, 4), torch.empty(9, 4))
        assert (q.shape, k.shape, v.shape) == ((2, 9, 2, 16), (2, 9, 1, 16), (2, 9, 1, 16))


def test_zero_size_inputs_give_empty_results():
    cos, sin = torch.ones(0, 4), torch.zeros(0, 4)
    x = torch.randn(2, 0, 3, 8, requires_grad=True)
    out = apply_rotary_emb(x, cos, sin)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape
    q, k, v = split_qkv_rotary_emb(torch.randn(0, 32), 2, 1, cos, sin)
    assert (q.shape, k.shape, v.shape) == ((0, 2, 8), (0, 1, 8), (0, 1, 8))


def test_angle_zero_leaves_the_input_and_the_switch_is_read_per_call(monkeypatch):
    x = torch.randn(2, 5, 3, 8)
    zero = torch.zeros(5, 4)
    monkeypatch.setenv(rotary.TRITON_ENV, "0")
    assert torch.equal(apply_rotary_emb(x, zero.cos(), zero.sin()), x)
    monkeypatch.setenv(rotary.TRITON_ENV, "maybe")
    with pytest.raises(Exception, match=rotary.TRITON_ENV):
        apply_rotary_emb(x, zero.cos(), zero.sin())


@pytest.mark.parametrize("call, match", [
    (lambda: apply_rotary_emb(torch.randn(2, 5, 8), torch.ones(4, 2), torch.ones(4, 2)), "T = 2"),
    (lambda: apply_rotary_emb(torch.randn(5, 8), torch.ones(5, 2), torch.ones(5, 2)), "x must be"),
    (lambda: apply_rotary_emb(torch.ones(1, 5, 2, 8, dtype=torch.int32), torch.ones(5, 2), torch.ones(5, 2)),
     "x must be a floating-point"),
    (lambda: apply_rotary_emb(torch.randn(1, 5, 2, 8), torch.ones(5, 5), torch.ones(5, 5)), "1 <= 2R <= head dim"),
    (lambda: apply_rotary_emb(torch.randn(1, 5, 2, 8), torch.ones(5, 2), torch.ones(5, 3)), "one shape"),
    (lambda: apply_rotary_emb(torch.randn(1, 5, 2, 8), torch.ones(6, 2), torch.ones(6, 2)), "S = 5"),
    (lambda: apply_rotary_emb(torch.randn(2, 5, 2, 8), torch.ones(3, 5, 2), torch.ones(3, 5, 2)), "B = 1 or 2"),
    (lambda: apply_rotary_emb(torch.randn(1, 5, 2, 8), [1.0], torch.ones(5, 2)), "cos must be a torch.Tensor"),
    (lambda: apply_rotary_emb(torch.randn(1, 5, 2, 8), torch.ones(5, 2, requires_grad=True), torch.ones(5, 2)),
     "cos requires grad"),
    (lambda: apply_rotary_emb(torch.randn(1, 5, 2, 8), torch.ones(5, 2), torch.ones(5, 2), interleaved=1),
     "interleaved must be a bool"),
    (lambda: split_qkv_rotary_emb(torch.randn(1, 5, 30), 2, 1, torch.ones(5, 2), torch.ones(5, 2)),
     r"\(q_heads \+ 2 \* kv_heads\) = 4"),
    (lambda: split_qkv_rotary_emb(torch.randn(1, 5, 32), 0, 1, torch.ones(5, 2), torch.ones(5, 2)),
     "q_heads must be a positive int"),
    (lambda: split_qkv_rotary_emb(torch.randn(1, 5, 32), 2, True, torch.ones(5, 2), torch.ones(5, 2)),
     "kv_heads must be a positive int"),
    (lambda: split_qkv_rotary_emb(torch.randn(32), 2, 1, torch.ones(5, 2), torch.ones(5, 2)), "qkv must be"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_doctests():
    import doctest

    from turbo_dispatch.ops import rotary as module

    assert doctest.testmod(module).failed == 0


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    os.environ.pop(rotary.TRITON_ENV, None)  # the checks are of the kernel
    for result in _checks("cpu", kernel_expected=True):
        print("RESULT " + json.dumps(result), flush=True)
