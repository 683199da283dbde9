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
#: Rows held in registers (several per program), rows of one element and single rows, rows
#: streamed in 512-wide chunks (1536), and rows longer than the register limit (9000: whole
#: chunks and two tail pieces; 18944, Qwen2.5-7B's FFN width).
SHAPES = [(7, 200), (3, 130), (2, 33), (1, 1), (5, 1536), (3, 9000), (2, 18944)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _away_from_zero(shape, lo, hi, gen):
    mag = lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    return mag * sign


def _rel_tol(dtype: torch.dtype, device: str) -> float:
    # On a GPU silu's exp and division are the fast ones (a few float32 ulps before the rounding
    # to the output's dtype): visible in float32 outputs only.
    return (16 if device == "cuda" and dtype == torch.float32 else 4) * torch.finfo(dtype).eps


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (fp8 compared through float32)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.float(), b.float()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _same_q(q, r, where: torch.Tensor | None = None) -> bool:
    """q and r alike: data (only ``where`` it is True, if given), scales and their recipe."""
    data_q, data_r = (q.data, r.data) if where is None else (q.data.float()[where], r.data.float()[where])
    return (_same(data_q, data_r) and _same(q.scale, r.scale) and q.granularity is r.granularity
            and q.axis == r.axis and q.block_size == r.block_size)


def _inputs(m: int, n: int, dt: torch.dtype, gen, device: str) -> dict:
    return {k: v.to(dt).to(device) for k, v in dict(
        x=_away_from_zero((m, n), 0.1, 3.0, gen), w=_away_from_zero((n,), 0.5, 1.5, gen),
        g=_away_from_zero((m, n), 0.25, 4.0, gen), u=_away_from_zero((m, n), 0.5, 1.5, gen)).items()}


def _runs(t: dict, gran, bs):
    """(name, float64 reference of the op, call(fp8 dtype, return_out)) per op."""
    from turbo_dispatch.backends.triton import fused_producers as fp

    xd = t["x"].double()
    norm_ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * t["w"].double()
    swiglu_ref = F.silu(t["g"].double()) * t["u"].double()
    return (("rms", norm_ref, lambda d, o: fp.rms_norm_quantize(t["x"], t["w"], 1e-6, d, gran, bs, return_out=o)),
            ("swiglu", swiglu_ref, lambda d, o: fp.swiglu_quantize(t["g"], t["u"], d, gran, bs, return_out=o)))


def _kernel_checks(device: str = "cpu", shapes=SHAPES, dtypes=DTYPES) -> list[dict]:
    """Per op, shape, dtype, recipe and fp8 dtype: the output within the rounding of its dtype of
    a float64 reference; q bit-equal to ``quantize`` of that output; q without the output asked
    for bit-equal to q with it."""
    from turbo_dispatch.low_precision import quantize

    gen = torch.Generator().manual_seed(0)
    results = []
    for (m, n) in shapes:
        for dname, dt in dtypes.items():
            t = _inputs(m, n, dt, gen, device)
            for gran, bs in RECIPES:
                for what, ref, run in _runs(t, gran, bs):
                    for fp8 in ((E4M3, torch.float8_e5m2) if gran == "ROWWISE" else (E4M3,)):
                        name = f"{what}[{m}x{n}-{dname}-{gran}-{bs}-{str(fp8).split('_')[-1]}]"
                        q, out = run(fp8, True)
                        q_alone, none = run(fp8, False)
                        r = quantize(out, fp8, gran, axis=1, block_size=bs)
                        ref = ref.to(out.device)
                        err = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()
                        same, alone = _same_q(q, r), _same_q(q_alone, q) and none is None
                        ok = same and alone and err <= _rel_tol(dt, device) and out.dtype == dt
                        results.append(dict(name=name, ok=ok, detail=f"bit-equal={same} without out={alone} "
                                                                      f"rel err={err:.3g}"))
    return results


def _edge_checks(device: str = "cpu") -> list[dict]:
    """Non-finite outputs (a NaN input row, an infinite one, SwiGLU's silu(-inf) = NaN) give what
    ``quantize`` gives for the kernel's output, in registers and along walked rows; M = 0 gives
    empty data and scales (TENSORWISE: scale 1). The interpreter's emulated fp8 cast does not
    carry NaN (quantize.py ``_round_to_fp8_grid``), so there the data is compared where the
    reference's is not NaN; a GPU compares all of it."""
    from turbo_dispatch.low_precision import quantize

    gen = torch.Generator().manual_seed(1)
    results = []
    for m, n in ((4, 200), (3, 9000)):
        t = _inputs(m, n, torch.bfloat16, gen, device)
        t["x"][0, 3], t["x"][1, n - 1] = float("nan"), float("inf")
        t["g"][0, 5], t["u"][1, 0], t["g"][2, n // 2] = float("nan"), float("inf"), float("-inf")
        for gran, bs in RECIPES[:3]:
            for what, _, run in _runs(t, gran, bs):
                q, out = run(E4M3, True)
                r = quantize(out, E4M3, gran, axis=1, block_size=bs)
                where = ~r.data.float().isnan() if device == "cpu" else None
                ok = _same_q(q, r, where) and _same_q(run(E4M3, False)[0], q) and bool(out.isnan().any())
                scales = f"scales {q.scale.flatten()[:4].tolist()} vs {r.scale.flatten()[:4].tolist()}"
                results.append(dict(name=f"nonfinite_{what}[{m}x{n}-{gran}-{bs}]", ok=ok, detail=scales))
    t = _inputs(0, 300, torch.bfloat16, gen, device)
    for gran, bs in RECIPES:
        for what, _, run in _runs(t, gran, bs):
            q, out = run(E4M3, True)
            want_scale = {"TENSORWISE": (), "ROWWISE": (0, 1)}.get(gran, (0, -(-300 // (bs or 1))))
            ok = (q.data.shape == (0, 300) and out.shape == (0, 300) and tuple(q.scale.shape) == want_scale
                  and (gran != "TENSORWISE" or q.scale.item() == 1.0))
            results.append(dict(name=f"empty_{what}[{gran}-{bs}]", ok=ok,
                                detail=f"data {tuple(q.data.shape)} scale {tuple(q.scale.shape)}"))
    return results


#: (hidden, out) of RMSNormLinear, (hidden, ffn) of SwiGLUMLP and the two inputs' shapes, for the
#: interpreter (small) and a GPU (GEMM-friendly).
MODULE_SIZES = {"cpu": ((160, 24), (40, 136), (2, 5, 160), (9, 40)),
                "cuda": ((256, 128), (128, 384), (2, 8, 256), (16, 128))}


def _module_checks(device: str = "cpu") -> list[dict]:
    """The modules' fused path against their unfused path (the kernel module hidden), forward
    without grad (no high-precision output written) and a training step (output, input grad,
    parameter grads), and that it ran."""
    from turbo_dispatch.backends.triton import fused_producers as fp
    from turbo_dispatch.modules import fused

    calls = {"n": 0}
    originals = {name: getattr(fp, name) for name in ("rms_norm_quantize", "swiglu_quantize")}
    for fn_name, original in originals.items():
        def counted(*a, _original=original, **k):
            calls["n"] += 1
            return _original(*a, **k)
        setattr(fp, fn_name, counted)
    try:
        return _compare_modules(fused, calls, device)
    finally:
        for fn_name, original in originals.items():
            setattr(fp, fn_name, original)


def _compare_modules(fused, calls: dict, device: str) -> list[dict]:
    """``_module_checks``' comparisons, with the kernel calls counted into ``calls``."""
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
    norm, mlp, norm_x, mlp_x = MODULE_SIZES[device]
    for gran, bs in RECIPES[:3]:
        cfg = Float8QuantConfig(granularity=gran, block_size=bs)
        for name, layer, x in ((f"module_rms[{gran}]", modules.RMSNormLinear(*norm, bias=True, fp8_config=cfg),
                                torch.randn(*norm_x)),
                               (f"module_swiglu[{gran}]", modules.SwiGLUMLP(*mlp, fp8_config=cfg),
                                torch.randn(*mlp_x))):
            layer, x = layer.to(device), x.to(device)
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


def _plain_swiglu_checks(device: str = "cpu") -> list[dict]:
    """The unquantised SwiGLU kernel (``swiglu``) against float64 (silu rounded to the dtype before
    the product, as ``F.silu(gate) * up``; within four units in the last place, see below), on halves of one projection and on rows of one element, M = 0 empty; and
    ``SwiGLUMLP`` without fp8 through it (``ops.swiglu``: ``swiglu``, then ``swiglu_backward``)
    against the torch expression (``PRIMUS_TURBO_SWIGLU_TRITON=0``): output, input and parameter
    gradients."""
    from turbo_dispatch.backends.triton import fused_producers as fp
    from turbo_dispatch.ops import activation as swiglu_op

    gen = torch.Generator().manual_seed(3)
    results = []
    for dname, dtype in DTYPES.items():
        for m, n in ((7, 200), (3, 4100), (1, 1), (0, 64)):
            gu = (4 * torch.rand((m, 2 * n), generator=gen, dtype=torch.float64) - 2).to(dtype).to(device)
            g, u = gu[:, :n], gu[:, n:]
            h = fp.swiglu(g, u)
            silu = (g.double() * torch.sigmoid(g.double())).to(dtype).double()
            want = silu * u.double()
            err = (h.double() - want).abs()
            # silu's fast division (2 float32 ulp) may move its rounding by one unit, the product's
            # rounding another (the interpreter truncates): four units of the dtype bound both
            bound = 4 * torch.finfo(dtype).eps * want.abs()
            ok = h.shape == (m, n) and h.is_contiguous() and bool((err <= bound + 1e-30).all())
            results.append(dict(name=f"swiglu[{m}x{n}-{dname}]", ok=ok,
                                detail=f"max err {float(err.max()) if err.numel() else 0.0:.3g}"))
    calls = []
    originals = {name: getattr(fp, name) for name in ("swiglu", "swiglu_backward")}
    for name, original in originals.items():
        setattr(fp, name, lambda *a, _o=original, _n=name: (calls.append(_n), _o(*a))[1])
    try:
        torch.manual_seed(4)
        mlp = modules.SwiGLUMLP(48, 300).to(device)
        x = torch.randn(2, 9, 48, device=device, requires_grad=True)
        out = mlp(x)
        got = [out, *torch.autograd.grad(out.square().sum(), [x, *mlp.parameters()])]
        os.environ[swiglu_op.TRITON_ENV] = "0"  # the torch expression
        try:
            ref = mlp(x)
            want = [ref, *torch.autograd.grad(ref.square().sum(), [x, *mlp.parameters()])]
        finally:
            del os.environ[swiglu_op.TRITON_ENV]
    finally:
        for name, original in originals.items():
            setattr(fp, name, original)
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]
    results.append(dict(name="module_swiglu[plain]", ok=calls == ["swiglu", "swiglu_backward"] and max(errs) < 1e-5,
                        detail=f"kernel calls {calls}, rel errs {[f'{e:.2g}' for e in errs]}"))
    return results


def _kernel_names(shapes) -> list[str]:
    return [f"{what}[{m}x{n}-{d}-{g}-{bs}-{fp8}]" for (m, n) in shapes for d in DTYPES for g, bs in RECIPES
            for what in ("rms", "swiglu") for fp8 in (("e4m3fn", "e5m2") if g == "ROWWISE" else ("e4m3fn",))]


KERNEL_NAMES = _kernel_names(SHAPES)
EDGE_NAMES = ([f"nonfinite_{w}[{m}x{n}-{g}-{bs}]" for m, n in ((4, 200), (3, 9000)) for g, bs in RECIPES[:3]
               for w in ("rms", "swiglu")] + [f"empty_{w}[{g}-{bs}]" for g, bs in RECIPES for w in ("rms", "swiglu")])
MODULE_NAMES = [f"module_{w}[{g}]" for g, _ in RECIPES[:3] for w in ("rms", "swiglu")]
PLAIN_NAMES = [f"swiglu[{m}x{n}-{d}]" for d in DTYPES for m, n in ((7, 200), (3, 4100), (1, 1), (0, 64))] + [
    "module_swiglu[plain]"]


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--interpreter-checks"], env=env, capture_output=True,
                          text=True, timeout=600)
    return collect_results(proc)


@pytest.mark.parametrize("name", KERNEL_NAMES + EDGE_NAMES + MODULE_NAMES + PLAIN_NAMES)
def test_interpreter(interpreter_results, name):
    assert_check_passed(interpreter_results, name)


#: The benchmark's row lengths (Llama-3.1-8B, Llama-3.1-70B TP8, Qwen2.5-7B) at an odd row count,
#: next to the interpreter's shapes: on a GPU every plan of ``fused_producers._plan`` runs.
GPU_SHAPES = SHAPES + [(37, 4096), (37, 8192), (37, 3584), (37, 14336), (37, 18944), (33, 16384)]


@pytest.fixture(scope="module")
def gpu_results() -> dict:
    results = {r["name"]: r for r in _kernel_checks("cuda", GPU_SHAPES) + _edge_checks("cuda")
               + _module_checks("cuda") + _plain_swiglu_checks("cuda")}
    torch.cuda.synchronize()
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("name", _kernel_names(GPU_SHAPES) + EDGE_NAMES + MODULE_NAMES + PLAIN_NAMES)
def test_gpu(gpu_results, name):
    """The interpreter's checks on a GPU (its own cast instruction, fast exp), at the benchmark's
    row lengths too, and the modules' fused path against their unfused one."""
    assert_check_passed(gpu_results, name)


def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """Every launch of the benchmark's cases compiles for sm_90 with no spill and at least
    ``FUSED_MIN_FIT`` programs per SM (tools/compile_sm90.py, family ``fused_producers``); rows
    longer than the register limit are walked, Qwen2.5-7B's 18944 included."""
    from test_compile_sm90 import _nvidia_toolchain

    why = _nvidia_toolchain()
    if why is not None:
        pytest.skip(why)
    out = tmp_path / "fused.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "compile_sm90.py"), "--only", "fused_producers",
                           "--json", str(out)], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["status"] == "PASS" and r["stack"] == 0 and r["fit"] >= 2 for r in rows), rows
    walked = {(r["config"][0], r["config"][1]) for r in rows if r["config"][8].startswith("walk")}
    assert ("swiglu", 18944) in walked and ("swiglu", 14336) in walked


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
    for check in (_kernel_checks, _edge_checks, _module_checks, _plain_swiglu_checks):
        try:
            for r in check():
                print("RESULT " + json.dumps(r), flush=True)
        except Exception as exc:  # noqa: BLE001 - reported per check group, the rest still runs
            import traceback
            traceback.print_exc()
            print(f"{check.__name__} raised {type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(0)
