"""TRITON gemm / gemm_fp8: the fused fp8 quantiser, the bf16 and fp8 GEMM kernels and adapters.

CPU (no marker): the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``). That
variable must be set before triton is imported, so the checks run in one subprocess
(``_interpreter_results``, a module-scoped fixture) that executes this file's
``_interpreter_checks()`` and prints one JSON line per check; each parametrized test then asserts
its line. Shapes are small and odd (every M/N/K edge masked). Interpreter facts this relies on,
tested first by ``interp_facts``:

* ``tl.dot`` on bf16 operands returns garbage in the interpreter (triton 3.9, CPU), fp16 and
  fp8 are right; the bf16 GEMM kernel therefore upcasts its tiles to fp32 under the interpreter
  (``UPCAST``), and the fact itself is checked so the workaround is dropped when triton fixes it.
* The interpreter's float32 -> fp8 cast mis-rounds values whose rounding carries into the
  exponent; the quantiser rounds to the fp8 grid itself under the interpreter (``EMULATE_CAST``),
  so the bit-exact comparison with the torch quantiser still tests our scale/divide/saturate.

GPU (``@pytest.mark.gpu``): the quantiser bit-exact vs torch on larger odd shapes and transposed
views; gemm over all layouts/dtypes/odd sizes (rel err <= 2e-2 bf16, 5e-3 fp16/fp32); fp8 forward
plus the exact dgrad/wgrad problems of the op's backward for every granularity, SNR >= 25 dB
(20 dB when an operand is e5m2) against the float64 product of the *high-precision* inputs.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from subprocess_results import assert_check_passed, collect_results

G_NAMES = ("TENSORWISE", "ROWWISE", "BLOCKWISE")


# -- the interpreter side (runs in the subprocess) ----------------------------------------------------
def _emit(name: str, ok: bool, detail: str = "") -> None:
    print("RESULT " + json.dumps({"name": name, "ok": bool(ok), "detail": detail}), flush=True)


def _snr(out, ref) -> float:
    noise = float((out.double() - ref).pow(2).sum())
    return math.inf if noise == 0 else 10 * math.log10(float(ref.pow(2).sum()) / noise)


def _interpreter_checks() -> None:  # pragma: no cover - runs in the subprocess
    import triton
    import triton.language as tl

    from turbo_dispatch.backends.triton import quantize as Q
    from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK
    from turbo_dispatch.backends.triton import gemm_kernels as GK
    from turbo_dispatch.backends.triton.configs import TileConfig
    from turbo_dispatch.backends.triton.gemm import TritonGemm, TritonGemmFp8
    from turbo_dispatch.backends.torch.gemm import TorchGemmFp8
    from turbo_dispatch.low_precision import ScalingGranularity as G, quantize
    from turbo_dispatch.ops.gemm import gemm_fp8_problem, gemm_problem
    from turbo_dispatch.ops.gemm_grads import fp8_grads

    torch.manual_seed(1234)
    E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2

    # 1. interpreter facts
    @triton.jit
    def _dot(a_ptr, b_ptr, c_ptr):
        o = tl.arange(0, 16)
        a = tl.load(a_ptr + o[:, None] * 16 + o[None, :])
        b = tl.load(b_ptr + o[:, None] * 16 + o[None, :])
        tl.store(c_ptr + o[:, None] * 16 + o[None, :], tl.dot(a, b))

    errs = {}
    for dt in (torch.bfloat16, torch.float16):
        a, b = torch.randn(16, 16).to(dt), torch.randn(16, 16).to(dt)
        c = torch.empty(16, 16)
        _dot[(1,)](a, b, c)
        ref = a.double() @ b.double()
        errs[str(dt)] = float((c.double() - ref).norm() / ref.norm())
    _emit("interp_facts", errs["torch.float16"] < 1e-3, json.dumps(errs))
    # bf16 dot is wrong in the interpreter: if this starts passing, UPCAST can go.
    _emit("interp_facts_bf16_dot_broken", errs["torch.bfloat16"] > 1e-2, json.dumps(errs))

    # 2. quantiser bit-exact vs turbo_dispatch.low_precision.quantize
    Q._ROW_SINGLE_MAX = 64  # so the (37, 70) and (70, 37) rows also take the two-kernel path
    grans = [(G.TENSORWISE, None, False), (G.ROWWISE, None, False), (G.BLOCKWISE, 32, False),
             (G.BLOCKWISE, 24, False), (G.BLOCKWISE, 16, True)]
    for shape, xdt in [((37, 70), torch.bfloat16), ((9, 40), torch.float32)]:
        x = torch.randn(shape) * 3
        x[1] = 0  # zero row -> scale 1
        x[2, :5] = 1e-39  # float32 subnormals -> clamp_min(tiny)
        x = x.to(xdt)
        for g, bs, b2 in grans:
            bad = []
            for view, fdt, axis in itertools.product([False, True], [E4, E5], [0, 1]):
                xv = x.t() if view else x
                r = quantize(xv, fdt, g, axis=axis, block_size=bs, block_2d=b2)
                q, qt = Q.quantize_fp8_with_transpose(xv, fdt, g, axis=axis, block_size=bs, block_2d=b2)
                q2 = Q.quantize_fp8(xv, fdt, g, axis=axis, block_size=bs, block_2d=b2)
                rt = quantize(xv.t(), fdt, g, axis=1 - axis, block_size=bs, block_2d=b2)
                for got, want in ((q, r), (q2, r), (qt, rt)):
                    if not (got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
                            and torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
                            and torch.equal(got.scale, want.scale) and got.axis == want.axis):
                        bad.append(f"view={view} {fdt} axis={axis}")
            _emit(f"quantize[{shape}-{xdt}-{g.name}-{bs}-{b2}]", not bad, "; ".join(bad[:4]))
        # Both quantisations of a step's activation or gradient from the fused pair of kernels.
        for g in (G.TENSORWISE, G.ROWWISE):
            bad = []
            for view, fdt in itertools.product([False, True], [E4, E5]):
                xv = x.t() if view else x
                rows, cols = Q.quantize_fp8_both(xv, fdt, g)
                for got, axis in ((rows, 1), (cols, 0)):
                    want = quantize(xv, fdt, g, axis=axis)
                    if not (got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
                            and torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
                            and torch.equal(got.scale, want.scale) and got.axis == want.axis):
                        bad.append(f"view={view} {fdt} axis={axis}")
                if cols.data.stride(0) != 1:
                    bad.append(f"view={view}: the axis-0 data is not stored transposed")
                # The same pair one at a time, from the shared amax pass (the backward's form).
                for got, axis in zip((f() for f in Q.quantize_fp8_in_turn(xv, fdt, g)), (1, 0)):
                    want = quantize(xv, fdt, g, axis=axis)
                    if not (got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
                            and torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
                            and torch.equal(got.scale, want.scale) and got.axis == want.axis):
                        bad.append(f"in turn: view={view} {fdt} axis={axis}")
            _emit(f"quantize_both[{shape}-{xdt}-{g.name}]", not bad, "; ".join(bad[:4]))
    # The GPU form of the scale (amax * float32(1/FP8_MAX), what torch computes on CUDA), checked
    # here against the reference with its _fp_scale patched to that form.
    LQ = sys.modules["turbo_dispatch.low_precision.quantize"]  # the module (the package attr is the function)

    orig_fp_scale = LQ._fp_scale

    def gpu_fp_scale(amax, fp8_max):
        recip = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(fp8_max, dtype=torch.float32)
        scale = (amax * recip).clamp_min(torch.finfo(torch.float32).tiny)
        return torch.where(amax == 0, torch.ones_like(scale), scale)

    LQ._fp_scale, Q.SCALE_BY_DIVISION = gpu_fp_scale, False
    try:
        bad, differs = [], 0
        x = torch.randn(64, 96) * 7
        for fdt, (g, bs, b2), axis in itertools.product([E4, E5], grans, [0, 1]):
            r = quantize(x, fdt, g, axis=axis, block_size=bs, block_2d=b2)
            q = Q.quantize_fp8(x, fdt, g, axis=axis, block_size=bs, block_2d=b2)
            Q.SCALE_BY_DIVISION = True  # the CPU form must give other scales somewhere,
            differs += int(not torch.equal(Q.quantize_fp8(x, fdt, g, axis=axis, block_size=bs, block_2d=b2).scale,
                                           r.scale))
            Q.SCALE_BY_DIVISION = False  # or this check could not tell the two forms apart
            if not (torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8)) and torch.equal(q.scale, r.scale)):
                bad.append(f"{fdt} {g.name} {bs} {b2} axis={axis}")
        _emit("quantize_gpu_scale_form", not bad and differs > 0, f"{differs} cases differ from division; " + "; ".join(bad[:4]))
    finally:
        LQ._fp_scale, Q.SCALE_BY_DIVISION = orig_fp_scale, None

    x = torch.randn(8, 40)
    x[3, 5] = float("nan")
    q = Q.quantize_fp8(x, E4, G.ROWWISE, axis=1)
    r = quantize(x, E4, G.ROWWISE, axis=1)
    _emit("quantize_nan_row", torch.equal(torch.isnan(q.scale), torch.isnan(r.scale)) and bool(torch.isnan(q.scale[3])))

    # values far below the fp8 grid's smallest step round to zero (or the nearest subnormal), as the cast does
    x = torch.randn(16, 96) * torch.logspace(-9, 2, 96)
    x[0, :3] = torch.tensor([448.0, 8.7e-5, -5e-5])
    bad = [f"{fdt} {g.name}" for fdt in (E4, E5) for g in (G.TENSORWISE, G.ROWWISE)
           if not torch.equal(Q.quantize_fp8(x, fdt, g, axis=1).data.view(torch.uint8),
                              quantize(x, fdt, g, axis=1).data.view(torch.uint8))]
    _emit("quantize_tiny_values", not bad, "; ".join(bad))

    # 3. gemm kernel: every layout, odd sizes, TMA and pointer paths, out dtypes
    cfg = TileConfig(32, 32, 32, 2, 2, 4)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        bad = []
        for (m, n, k), ta, tb, tma in itertools.product([(37, 50, 72), (5, 3, 33)], [False, True], [False, True],
                                                         [None, False]):
            a = torch.randn((k, m) if ta else (m, k)).to(dt)
            b = torch.randn((n, k) if tb else (k, n)).to(dt)
            ref = (a.t() if ta else a).double() @ (b.t() if tb else b).double()
            for od in {dt, torch.float32}:
                out = GK.gemm(a, b, ta, tb, od, cfg, use_tma=tma)
                err = float((out.double() - ref).norm() / ref.norm())
                tol = 2e-2 if od == torch.bfloat16 else 5e-3
                if not (err <= tol and out.shape == (m, n) and out.dtype == od):
                    bad.append(f"{m}x{n}x{k} ta={ta} tb={tb} tma={tma} out={od} err={err:.2e}")
        _emit(f"gemm_kernel[{dt}]", not bad, "; ".join(bad[:4]))
    # occupancy (programs per SM) changes only how the persistent programs split the 16 tiles
    a, b = torch.randn(100, 72, dtype=torch.float16), torch.randn(72, 110, dtype=torch.float16)
    one = GK.gemm(a, b, False, False, torch.float32, cfg)
    three = GK.gemm(a, b, False, False, torch.float32, cfg._replace(occupancy=3))
    qa = Q.quantize_kmajor(torch.randn(100, 128), E4, G.BLOCKWISE, 32, False)
    qb = Q.quantize_kmajor(torch.randn(110, 128), E4, G.BLOCKWISE, 32, True)
    f8cfg = TileConfig(32, 32, 32, 2, 2, 4)
    f8 = [FK.fp8_gemm(qa[0], qb[0], qa[1], qb[1], FK.SCALE_BLOCK, torch.float32, f8cfg._replace(occupancy=o),
                      a_group=1, b_group=32) for o in (1, 3)]
    _emit("occupancy_same_bits", torch.equal(one, three) and torch.equal(f8[0], f8[1]),
          f"gemm {float((one - three).abs().max())}, fp8 blockwise {float((f8[0] - f8[1]).abs().max())}")
    # the adapter with its default config and with every config it offers
    ad = TritonGemm()
    a, b = torch.randn(40, 24, dtype=torch.float16), torch.randn(24, 20, dtype=torch.float16)
    p = gemm_problem(a, b, False, False, torch.float32)
    ref = a.double() @ b.double()
    errs = [float((ad.run(p, a, b, config=c).double() - ref).norm() / ref.norm()) for c in [None] + ad.configs(p)[:2]]
    _emit("gemm_adapter_configs", max(errs) < 5e-3 and ad.supports(p) is None, str(errs))

    # 4. fp8 adapter: forward + the exact dgrad/wgrad problems of the op, vs float64 of the inputs
    fad, tad = TritonGemmFp8(), TorchGemmFp8()
    m, n, k = 48, 40, 96
    for (g, bs), (ta, tb), fmt in itertools.product([(G.TENSORWISE, None), (G.ROWWISE, None), (G.BLOCKWISE, 32)],
                                                    itertools.product([False, True], [False, True]), ["e4m3", "hybrid"]):
        if fmt == "hybrid" and (ta or tb):
            continue  # hybrid only changes dtypes; one layout is enough on the CPU
        fwd, bwd = E4, (E5 if fmt == "hybrid" else E4)
        a = torch.randn((k, m) if ta else (m, k))
        b = torch.randn((n, k) if tb else (k, n))
        grad = torch.randn(m, n)
        msgs, ok = [], True

        def mm8(x, y, xta, ytb, od, xf, yf, x2d, y2d):
            nonlocal ok
            p = gemm_fp8_problem(x, y, xta, ytb, od, xf, yf, g, bs, x2d, y2d)
            out = fad.run(p, x, y)
            ref = (x.t() if xta else x).double() @ (y.t() if ytb else y).double()
            gate = 20.0 if E5 in (xf, yf) else 25.0
            s = _snr(out, ref)
            emu = tad.run(p, x, y).double()  # dequantise + matmul on the same quantised values
            agree = float((out.double() - emu).norm() / emu.norm())
            ok &= s >= gate and agree < 1e-5 and out.shape == (p.m, p.n)
            msgs.append(f"{p.m}x{p.n}x{p.k} 2d={int(x2d)}{int(y2d)} snr={s:.1f} vs_emul={agree:.1e}")
            return out

        mm8(a, b, ta, tb, torch.float32, fwd, fwd, False, g is G.BLOCKWISE)
        fp8_grads(mm8, a, b, grad, ta, tb, fwd, bwd, g, True, True)
        _emit(f"fp8_adapter[{g.name}-{'T' if ta else 'N'}{'T' if tb else 'N'}-{fmt}]", ok and len(msgs) == 3,
              "; ".join(msgs))


    # 5. the wgrad with the activation the op saved pre-quantised ([K, M] along M, see
    # ops.gemm_fp8_step.wgrad_operand): TRITON takes it as is (odd M: the 16-byte row padding copy) and
    # agrees with TORCH's emulation on the same quantised values.
    from turbo_dispatch.low_precision import Float8QuantConfig, dequantize
    from turbo_dispatch.ops.gemm_fp8_step import wgrad_operand

    m, n, k = 37, 40, 96
    for (g, bs), (ta, tb) in itertools.product([(G.TENSORWISE, None), (G.ROWWISE, None), (G.BLOCKWISE, 32)],
                                               itertools.product([False, True], [False, True])):
        cfg8 = Float8QuantConfig(granularity=g, block_size=bs)
        a = torch.randn((k, m) if ta else (m, k))
        b = torch.randn((n, k) if tb else (k, n))
        grad = torch.randn(m, n)
        qa = wgrad_operand(a, ta, cfg8)
        msgs, ok = [], True

        def mm8_q(x, y, xta, ytb, od, xf, yf, x2d, y2d):
            nonlocal ok
            p = gemm_fp8_problem(x, y, xta, ytb, od, xf, yf, g, bs, x2d, y2d)
            out = fad.run(p, x, y)
            emu = tad.run(p, x, y).double()
            agree = float((out.double() - emu).norm() / emu.norm())
            ok &= fad.supports(p) is None and agree < 1e-5 and out.shape == (p.m, p.n) == tuple(emu.shape)
            msgs.append(f"{p.m}x{p.n}x{p.k} dtypes={p.a_dtype},{p.b_dtype} vs_emul={agree:.1e}")
            return out

        _, gb = fp8_grads(mm8_q, qa, None, grad, ta, tb, E4, E4, g, False, True, a_dtype=torch.float32,
                          b_dtype=torch.float32)
        ref = dequantize(qa, torch.float64) @ dequantize(quantize(grad, E4, g, axis=0, block_size=bs), torch.float64)
        snr = _snr(gb.t() if tb else gb, ref)
        _emit(f"fp8_prequantized_wgrad[{g.name}-{'T' if ta else 'N'}{'T' if tb else 'N'}]",
              ok and len(msgs) == 1 and snr > 100, f"snr_vs_f64={snr:.1f}; " + "; ".join(msgs))

    # 6. the HYBRID blockwise backward as the op runs it (ops.gemm_autograd.fp8_gemm_backward: the
    # activation saved pre-quantised as e4m3, the gradient quantised as e5m2), its GEMMs on TRITON,
    # which the cuda default chain gives them where cuBLASLt refuses the e5m2 operand: each agrees
    # with TORCH's emulation on the same quantised values, and the gradients with float64 of the inputs.
    from turbo_dispatch.low_precision import Format
    from turbo_dispatch.ops import gemm_autograd
    from turbo_dispatch.ops.gemm_problem import forward_fp8_problem

    hybrid = Float8QuantConfig(format=Format.HYBRID, granularity=G.BLOCKWISE, block_size=32)
    m, n, k = 37, 72, 96  # odd M: the wgrad's reduction dim ends in a partial block

    def on_triton(p, x, y):
        out = fad.run(p, x, y)
        emu = tad.run(p, x, y).double()
        agreement.append((p.a_fp8, p.b_fp8, float((out.double() - emu).norm() / emu.norm())))
        return out

    resolved = gemm_autograd.run_gemm_fp8
    gemm_autograd.run_gemm_fp8 = on_triton
    try:
        for tb in (True, False):
            agreement = []
            a, grad = torch.randn(m, k), torch.randn(m, n)
            b = torch.randn((n, k) if tb else (k, n))
            p = forward_fp8_problem(a, b, False, tb, None, hybrid)
            ga, gb = gemm_autograd.fp8_gemm_backward(p, hybrid, wgrad_operand(a, False, hybrid), b, grad, True, True)
            wt = b.double().t() if tb else b.double()  # op(b) [K, N]
            ref_a = grad.double() @ wt.t()
            ref_b = grad.double().t() @ a.double() if tb else a.double().t() @ grad.double()
            snrs = (_snr(ga, ref_a), _snr(gb, ref_b))
            ok = (min(snrs) >= 20.0 and len(agreement) == 2 and all(E5 in (x, y) for x, y, _ in agreement)
                  and all(err < 1e-5 for *_, err in agreement))
            _emit(f"fp8_hybrid_blockwise_backward[N{'T' if tb else 'N'}]", ok,
                  f"snr dgrad/wgrad {snrs[0]:.1f}/{snrs[1]:.1f}; vs_emul {agreement}")
    finally:
        gemm_autograd.run_gemm_fp8 = resolved


_CPU_NAMES = (
    ["interp_facts", "interp_facts_bf16_dot_broken", "quantize_nan_row", "quantize_tiny_values", "quantize_gpu_scale_form",
     "gemm_adapter_configs"]
    + [f"quantize[{s}-{d}-{g}-{bs}-{b2}]" for s, d in [((37, 70), torch.bfloat16), ((9, 40), torch.float32)]
       for g, bs, b2 in [("TENSORWISE", None, False), ("ROWWISE", None, False), ("BLOCKWISE", 32, False),
                         ("BLOCKWISE", 24, False), ("BLOCKWISE", 16, True)]]
    + [f"quantize_both[{s}-{d}-{g}]" for s, d in [((37, 70), torch.bfloat16), ((9, 40), torch.float32)]
       for g in ("TENSORWISE", "ROWWISE")]
    + [f"gemm_kernel[{dt}]" for dt in (torch.float16, torch.bfloat16, torch.float32)]
    + [f"fp8_adapter[{g}-{lay}-{fmt}]" for g in G_NAMES for lay in ("NN", "NT", "TN", "TT") for fmt in ("e4m3", "hybrid")
       if fmt == "e4m3" or lay == "NN"]
    + [f"fp8_prequantized_wgrad[{g}-{lay}]" for g in G_NAMES for lay in ("NN", "NT", "TN", "TT")]
    + [f"fp8_hybrid_blockwise_backward[{lay}]" for lay in ("NT", "NN")]
)


@pytest.fixture(scope="module")
def _interpreter_results(interpreter_refusal) -> dict:
    if interpreter_refusal:
        pytest.skip(interpreter_refusal)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--interpreter-checks"], env=env, capture_output=True,
                          text=True, timeout=240)
    return collect_results(proc)


@pytest.mark.parametrize("name", _CPU_NAMES)
def test_interpreter(_interpreter_results, name):
    assert_check_passed(_interpreter_results, name)


def test_adapter_metadata_without_a_device(gluon_off_here):
    """supports()/configs()/identity() are host-side and work everywhere."""
    from turbo_dispatch.backends.triton import configs as C
    from turbo_dispatch.backends.triton.gemm import TritonGemm, TritonGemmFp8
    from turbo_dispatch.low_precision import ScalingGranularity as G
    from turbo_dispatch.ops.gemm import GemmFp8Problem, GemmProblem

    p = GemmProblem(4096, 7168, 16384, False, True, torch.bfloat16, torch.bfloat16, torch.bfloat16, "cuda")
    cfgs = TritonGemm().configs(p)
    assert 1 <= len(cfgs) <= 8 and all(isinstance(c, tuple) for c in cfgs)
    assert all(C.smem_bytes(C.from_tuple(c), 2, 2) <= C.SMEM_LIMIT for c in cfgs)
    assert TritonGemm().identity(cfgs[0]) != TritonGemm().identity(cfgs[1])
    assert "gemm-r" in TritonGemm().identity(cfgs[0])
    f8 = GemmFp8Problem(4096, 7168, 16384, False, True, torch.bfloat16, torch.bfloat16, torch.bfloat16,
                        torch.float8_e4m3fn, torch.float8_e4m3fn, G.BLOCKWISE, 128, False, True, "cuda")
    fc = TritonGemmFp8().configs(f8)
    assert fc and all(c[2] == 128 for c in fc), "blockwise configs must have BLOCK_K == block_size"
    assert TritonGemmFp8().supports(f8) is None
    assert "MX" in TritonGemmFp8().supports(f8._replace(granularity=G.MX_BLOCKWISE, block_size=32))
    assert "block_size" in TritonGemmFp8().supports(f8._replace(block_size=256))
    small = TritonGemm().configs(p._replace(m=16, n=16, k=32))
    assert all(c[0] <= 64 and c[1] <= 64 for c in small[:1])
    with pytest.raises(ValueError, match="6 to 8 ints"):
        C.from_tuple((128, 128, 64))
    with pytest.raises(ValueError, match="occupancy=9"):
        C.from_tuple((64, 128, 128, 8, 3, 4, 9))
    # The occupancy field round-trips, and a config stored before it existed keeps its 6-int form.
    assert C.from_tuple((64, 128, 128, 8, 3, 4, 3)).occupancy == 3
    assert C.as_tuple(C.from_tuple((64, 128, 128, 8, 3, 4, 3))) == (64, 128, 128, 8, 3, 4, 3)
    assert C.as_tuple(C.from_tuple((64, 128, 128, 8, 3, 4))) == (64, 128, 128, 8, 3, 4)
    assert C.as_tuple(C.from_tuple((64, 128, 128, 8, 3, 4, 1))) == (64, 128, 128, 8, 3, 4)
    # Blockwise never defaults to a tile whose promotion spills (128 x 256), and offers
    # multi-program configs; tensorwise/rowwise keep their tables.
    big = TritonGemmFp8().configs(f8._replace(m=4096, n=7168, k=16384))
    assert big[0][:2] == (128, 128) and any(len(c) == 7 for c in big)
    assert all(c[1] <= 128 for c in big)


def test_gluon_blockwise_configs_and_refusals(gluon_off_here):
    """The Gluon blockwise configs: after every Triton config, an eighth field that round-trips,
    within the kernel's constraints; where the kernel cannot run they are not offered, and a
    pinned one raises with the reason instead of running something else."""
    from turbo_dispatch.backends.triton import configs as C
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GLK
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
    from turbo_dispatch.backends.triton.gemm import TritonGemmFp8, gluon_kernel
    from turbo_dispatch.low_precision import ScalingGranularity as G
    from turbo_dispatch.ops.gemm import GemmFp8Problem

    cands = C.fp8_candidates(4096, 7168, 16384, 128)
    kinds = [c.kernel for c in cands]
    # The warp-specialised 256-column tile first (the measured fastest on sm_90): 4 stages from
    # WS_DEEP_K on, 3 below; the Triton configs last, so that where no Gluon config can run the
    # Triton default is what remains.
    assert set(C.GLUON_KERNELS) <= set(kinds), kinds
    assert cands[0] == C.TileConfig(128, 256, 128, 8, 4, 8, 1, C.KERNEL_GLUON_WS), cands[0]
    assert C.TileConfig(128, 256, 128, 8, 3, 8, 1, C.KERNEL_GLUON_WS) in cands
    shallow = C.fp8_candidates(4096, 7168, C.WS_DEEP_K - 128, 128)
    assert shallow[0] == C.TileConfig(128, 256, 128, 8, 3, 8, 1, C.KERNEL_GLUON_WS), shallow[0]
    assert sorted(shallow, key=repr) == sorted(C.fp8_candidates(4096, 7168, C.WS_DEEP_K, 128), key=repr)
    n_tri = kinds.count(C.KERNEL_TRITON)
    assert n_tri and kinds[-n_tri:] == [C.KERNEL_TRITON] * n_tri, kinds
    gluon = [c for c in cands if c.kernel in C.GLUON_KERNELS]
    for c in gluon:
        kernel = gluon_kernel(c.kernel)
        assert kernel.config_error(c, 128) is None, c
        assert "one per tile" in kernel.config_error(c, 1)  # the wgrad's per-column scales
        assert len(C.as_tuple(c)) == 8 and C.from_tuple(C.as_tuple(c)) == c
    assert C.fp8_candidates(4096, 7168, 16384) == [c for c in C.fp8_candidates(4096, 7168, 16384)
                                                    if c.kernel == C.KERNEL_TRITON], "tensorwise/rowwise: Triton only"
    assert C.as_tuple(C.from_tuple((128, 128, 128, 8, 5, 8, 1, 0))) == (128, 128, 128, 8, 5, 8)
    assert C.as_tuple(C.from_tuple((128, 128, 128, 8, 5, 8, 2, 0))) == (128, 128, 128, 8, 5, 8, 2)
    with pytest.raises(ValueError, match="kernel=3"):
        C.from_tuple((128, 128, 128, 8, 5, 8, 1, 3))
    with pytest.raises(ValueError, match="not a Gluon kernel"):
        gluon_kernel(C.KERNEL_TRITON)
    assert "BLOCK_M must be 16 * num_warps" in GLK.config_error((64, 128, 128, 8, 4, 8), 128)
    assert "BLOCK_N" in GLK.config_error((128, 256, 128, 8, 4, 8), 256)
    assert GLK.chunk_for(128, 128, 8) == 2 and GLK.chunk_for(128, 64, 8) == 4
    # The warp-specialised kernel: two 64-row math warpgroups, one program per SM.
    assert "two math warpgroups" in GWS.config_error((64, 128, 128, 8, 4, 4), 128)
    assert "occupancy must be 1" in GWS.config_error((128, 128, 128, 8, 4, 8, 2), 128)
    # a's scales go through shared memory only where one slot's are one contiguous read.
    assert GWS.scales_in_smem(1, 1) and not GWS.scales_in_smem(56, 1) and not GWS.scales_in_smem(1, 128)
    # 256 columns are two 128-column accumulators, each needing one b scale.
    assert GWS.config_error((128, 256, 128, 8, 4, 8), 128) is None
    assert "BLOCK_N" in GWS.config_error((128, 192, 128, 8, 4, 8), 192)
    assert "one per tile" in GWS.config_error((128, 256, 128, 8, 4, 8), 64)
    # TMA-store epilogue: only for row-major, 16-byte aligned rows, and only where the two [64, 128]
    # staging buffers fit next to the ring (the 4-stage 256-column tile just does, in bf16).
    c = torch.empty(64, 1024, dtype=torch.bfloat16)
    wide4, narrow6 = (128, 256, 128, 8, 4, 8), (128, 128, 128, 8, 6, 8)
    assert GWS.smem_bytes(wide4, 2, True) <= GWS.SMEM_PER_CTA < GWS.smem_bytes(wide4, 4, True)
    assert GWS.smem_bytes(wide4, 2, False) < GWS.smem_bytes(wide4, 2, True)
    assert GWS.tma_store_ok(c, wide4) and not GWS.tma_store_ok(c.float(), wide4)
    assert not GWS.tma_store_ok(c, narrow6) and GWS.tma_store_ok(c, (128, 128, 128, 8, 5, 8))
    assert not GWS.tma_store_ok(torch.empty(64, 999, dtype=torch.bfloat16), wide4), "rows not 16-byte aligned"
    assert not GWS.tma_store_ok(c.t(), wide4), "column-major"
    assert not GWS.tma_store_ok(c[:, 1:], wide4), "base not 16-byte aligned"
    # Descriptor layouts are built once per (block, dtype) and are the default swizzle.
    from triton.experimental.gluon import language as gl

    assert GLK.shared_layout((128, 128), "float8e4nv") is GLK.shared_layout((128, 128), "float8e4nv")
    assert GWS.output_descriptor(c, 64, 128).layout == gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)
    assert GLK.make_descriptor(torch.empty(256, 256, dtype=torch.float8_e5m2), [128, 64]).layout == \
        gl.NVMMASharedLayout.get_default_for([128, 64], gl.float8e5)

    f8 = GemmFp8Problem(256, 256, 256, False, True, torch.bfloat16, torch.bfloat16, torch.bfloat16,
                        torch.float8_e4m3fn, torch.float8_e4m3fn, G.BLOCKWISE, 128, False, True, "cuda")
    ad = TritonGemmFp8()
    assert all(len(c) < 8 for c in ad.configs(f8)), f"Gluon configs offered where they cannot run ({gluon_off_here})"
    a = torch.randn(256, 256, dtype=torch.bfloat16)
    pinned = (128, 128, 128, 8, 5, 8, 1, C.KERNEL_GLUON)
    with pytest.raises(ValueError, match="selects the Gluon kernel, but .*(NVIDIA|sm_90|Gluon)"):
        ad.run(f8, a, a, config=pinned)
    with pytest.raises(ValueError, match="BLOCKWISE only"):
        ad.run(f8._replace(granularity=G.ROWWISE, block_size=None), a, a, config=pinned)
    assert "gluon-bw-r" in ad.identity(pinned)
    pinned_ws = (128, 128, 128, 8, 6, 8, 1, C.KERNEL_GLUON_WS)
    with pytest.raises(ValueError, match="selects the Gluon kernel, but .*(NVIDIA|sm_90|Gluon)"):
        ad.run(f8, a, a, config=pinned_ws)
    assert "gluon-ws-r" in ad.identity(pinned_ws) and "gluon-bw-r" not in ad.identity(pinned_ws)
    # The Triton configs' identities (and so their stored tuning results) do not depend on it.
    assert "gluon" not in ad.identity((128, 128, 128, 8, 4, 8)) and "gluon" not in ad.identity()


# -- GPU -----------------------------------------------------------------------------------------
def _gpu_snr(out, ref) -> float:
    return _snr(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1000, 3000), (129, 9001), (513, 257)])
def test_gpu_quantize_bit_exact(shape):
    from turbo_dispatch.backends.triton.quantize import (quantize_fp8, quantize_fp8_both, quantize_fp8_in_turn,
                                                         quantize_fp8_with_transpose)
    from turbo_dispatch.low_precision import ScalingGranularity as G, quantize

    x = torch.randn(shape, device="cuda") * 5
    x[0] = 0
    for g, bs, b2 in [(G.TENSORWISE, None, False), (G.ROWWISE, None, False), (G.BLOCKWISE, 128, False),
                      (G.BLOCKWISE, 100, False), (G.BLOCKWISE, 128, True)]:
        for view, fdt, axis in itertools.product([False, True], [torch.float8_e4m3fn, torch.float8_e5m2], [0, 1]):
            xv = (x.t() if view else x).bfloat16()
            r = quantize(xv, fdt, g, axis=axis, block_size=bs, block_2d=b2)
            q = quantize_fp8(xv, fdt, g, axis=axis, block_size=bs, block_2d=b2)
            _, qt = quantize_fp8_with_transpose(xv, fdt, g, axis=axis, block_size=bs, block_2d=b2)
            tag = f"{g.name} bs={bs} 2d={b2} view={view} {fdt} axis={axis}"
            assert torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8)), tag
            assert torch.equal(q.scale, r.scale), tag
            assert torch.equal(qt.data.view(torch.uint8), r.data.t().contiguous().view(torch.uint8)), tag
            if g in (G.TENSORWISE, G.ROWWISE) and axis == 1:
                # The two-way quantiser from bf16 and from float32 (whose tile layouts differ).
                for xin in (xv, xv.float()):
                    both = quantize_fp8_both(xin, fdt, g)
                    in_turn = [f() for f in quantize_fp8_in_turn(xin, fdt, g)]
                    for got, ax in [*zip(both, (1, 0)), *zip(in_turn, (1, 0))]:
                        want = quantize(xin, fdt, g, axis=ax)
                        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (tag, xin.dtype, ax)
                        assert torch.equal(got.scale, want.scale), (tag, xin.dtype, ax)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 33, 127), (257, 129, 1001), (512, 384, 1024)])
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], [False, True])))
def test_gpu_gemm(dtype, shape, ta, tb):
    from turbo_dispatch.backends.triton.gemm import TritonGemm
    from turbo_dispatch.ops.gemm import gemm_problem

    m, n, k = shape
    a = torch.randn((k, m) if ta else (m, k), device="cuda", dtype=dtype)
    b = torch.randn((n, k) if tb else (k, n), device="cuda", dtype=dtype)
    ref = (a.t() if ta else a).double() @ (b.t() if tb else b).double()
    for od in {dtype, torch.float32}:
        p = gemm_problem(a, b, ta, tb, od)
        assert TritonGemm().supports(p) is None
        out = TritonGemm().run(p, a, b)
        err = float((out.double() - ref).norm() / ref.norm())
        assert err <= (2e-2 if od == torch.bfloat16 else 5e-3), (od, err)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise128", "blockwise64"])
@pytest.mark.parametrize("shape", [(1, 33, 127), (257, 384, 1000), (512, 768, 1536)])
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], [False, True])))
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_gpu_fp8_fwd_dgrad_wgrad(recipe, shape, ta, tb, fmt):
    """The forward GEMM and the exact dgrad / wgrad problems the op's backward builds."""
    from turbo_dispatch.backends.triton.gemm import TritonGemmFp8
    from turbo_dispatch.low_precision import ScalingGranularity as G
    from turbo_dispatch.ops.gemm import gemm_fp8_problem
    from turbo_dispatch.ops.gemm_grads import fp8_grads

    g, bs = {"tensorwise": (G.TENSORWISE, None), "rowwise": (G.ROWWISE, None),
             "blockwise128": (G.BLOCKWISE, 128), "blockwise64": (G.BLOCKWISE, 64)}[recipe]
    E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
    fwd, bwd = E4, (E5 if fmt == "hybrid" else E4)
    m, n, k = shape
    a = torch.randn((k, m) if ta else (m, k), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, k) if tb else (k, n), device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ad = TritonGemmFp8()

    def mm8(x, y, xta, ytb, od, xf, yf, x2d, y2d):
        p = gemm_fp8_problem(x, y, xta, ytb, od, xf, yf, g, bs, x2d, y2d)
        assert ad.supports(p) is None
        out = ad.run(p, x, y)
        ref = (x.t() if xta else x).double() @ (y.t() if ytb else y).double()
        gate = 20.0 if E5 in (xf, yf) else 25.0
        s = _snr(out, ref)
        assert out.isfinite().all() and s >= gate, (p, s)
        return out

    mm8(a, b, ta, tb, torch.bfloat16, fwd, fwd, False, g is G.BLOCKWISE)
    fp8_grads(mm8, a, b, grad, ta, tb, fwd, bwd, g, True, True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1000, 1536, 2048), (4096, 2048, 1024)])
def test_gpu_fp8_blockwise_every_config(shape):
    """Every blockwise candidate, the multi-program (occupancy) ones included, on odd M."""
    from turbo_dispatch.backends.triton.gemm import TritonGemmFp8
    from turbo_dispatch.low_precision import ScalingGranularity as G
    from turbo_dispatch.ops.gemm import gemm_fp8_problem

    m, n, k = shape
    a = torch.randn(m - 3, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    E4 = torch.float8_e4m3fn
    p = gemm_fp8_problem(a, b, False, True, torch.bfloat16, E4, E4, G.BLOCKWISE, 128, False, True)
    ad = TritonGemmFp8()
    cfgs = ad.configs(p)
    assert any(len(c) == 7 for c in cfgs), cfgs
    if _sm90_gluon_reason() is None:
        assert any(len(c) == 8 for c in cfgs), f"sm_90 offers the Gluon configs: {cfgs}"
    ref = a.double() @ b.double().t()
    for cfg in cfgs:
        s = _snr(ad.run(p, a, b, config=cfg), ref)
        assert s >= 25.0, (cfg, s)


def _gluon_configs() -> list:
    from turbo_dispatch.backends.triton import configs as C

    out = []
    for cls in C._FP8_BLOCKWISE_GLUON.values():
        out += [c for c in cls if c not in out]
    return out


def _gluon_id(cfg) -> str:
    """``gluon_128x128x128_s5_w8`` / ``gluonws_...``: selectable with ``-k gluonws``."""
    from turbo_dispatch.backends.triton import configs as C

    kind = "gluonws" if cfg.kernel == C.KERNEL_GLUON_WS else "gluon"
    return f"{kind}_{cfg.block_m}x{cfg.block_n}x{cfg.block_k}_s{cfg.num_stages}_w{cfg.num_warps}_o{cfg.occupancy}"


def _sm90_gluon_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no GPU"
    from turbo_dispatch.backends.triton.fp8_blockwise_gluon import available

    return available()


def _dequant(q: torch.Tensor, s: torch.Tensor, group: int, bs: int) -> torch.Tensor:
    """float64 value of a K-major fp8 operand [R, K] with one scale per (row group, K block)."""
    r, k = q.shape
    full = s.double().repeat_interleave(group, 0)[:r].repeat_interleave(bs, 1)[:, :k]
    return q.double() * full


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _gluon_configs(), ids=_gluon_id)
@pytest.mark.parametrize("bs", [128, 64])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_gpu_gluon_blockwise_kernel(cfg, bs, fmt):
    """The Gluon kernel against float64 on the dequantised operands, over odd M/N, K tails (a
    partial K block, an odd number of K blocks for the chunk remainder), several tiles per
    persistent program, and every scale grouping (1 x bs / bs x bs on either operand); and
    against the Triton kernel on the same operands."""
    why = _sm90_gluon_reason()
    if why:
        pytest.skip(why)
    from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK
    from turbo_dispatch.backends.triton.gemm import gluon_kernel
    from turbo_dispatch.backends.triton.quantize import quantize_kmajor
    from turbo_dispatch.low_precision import ScalingGranularity as G

    GLK = gluon_kernel(cfg.kernel)
    cfg = cfg._replace(block_k=bs)
    fa = torch.float8_e4m3fn
    fb = torch.float8_e5m2 if fmt == "hybrid" else fa
    torch.manual_seed(0)
    if GLK.config_error(cfg, bs):
        pytest.skip(GLK.config_error(cfg, bs))
    # (300, 999): rows a TMA store cannot address (the pointer-store epilogue); the others store by
    # TMA where the kernel does, except in tiles that run past M. (2100, 1800): 136 tiles of 128 x
    # 256 on an H100's 132 programs, so the warp-specialised kernel splits the last four into
    # 128-column halves, one of them wholly past N.
    for m, n, k in [(1, 128, 256), (257, 384, 1000), (1000, 1000, 9 * bs + 5), (300, 999, 5 * bs + 3),
                    (2048, 1536, 4096), (2100, 1800, 5 * bs)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        # b in 2-D tiles: the kernel's contract (config_error refuses per-column b scales).
        for a2d, b2d in [(False, True), (True, True)]:
            qa, sa = quantize_kmajor(a, fa, G.BLOCKWISE, bs, a2d)
            qb, sb = quantize_kmajor(b, fb, G.BLOCKWISE, bs, b2d)
            ga, gb = (bs if a2d else 1), (bs if b2d else 1)
            out = GLK.fp8_blockwise_gemm(qa, qb, sa, sb, torch.float32, cfg, a_group=ga, b_group=gb)
            ref = _dequant(qa, sa, ga, bs) @ _dequant(qb, sb, gb, bs).t()
            tag = f"{tuple(cfg)} {(m, n, k)} a2d={a2d} b2d={b2d}"
            assert out.isfinite().all(), tag
            rel = float((out.double() - ref).norm() / ref.norm())
            assert rel < 1e-3, (tag, rel)
            tri = FK.fp8_gemm(qa, qb, sa, sb, FK.SCALE_BLOCK, torch.float32, (128, 128, bs, 8, 3, 8),
                              a_group=ga, b_group=gb)
            assert float((out - tri).abs().max()) <= 1e-3 * float(ref.abs().max()), tag
            bf = GLK.fp8_blockwise_gemm(qa, qb, sa, sb, torch.bfloat16, cfg, a_group=ga, b_group=gb)
            assert float((bf.double() - ref).norm() / ref.norm()) < 1e-2, tag


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _gluon_configs(), ids=_gluon_id)
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], [False, True])))
def test_gpu_gluon_blockwise_fwd_dgrad_wgrad(cfg, ta, tb):
    """A pinned Gluon config through the adapter for the forward and both backward GEMMs of every
    layout (the quantiser transposes what is not K-major), against float64; where b's scales are
    per column (the wgrad) the config is refused with its reason."""
    why = _sm90_gluon_reason()
    if why:
        pytest.skip(why)
    from turbo_dispatch.backends.triton import configs as C
    from turbo_dispatch.backends.triton.gemm import TritonGemmFp8
    from turbo_dispatch.low_precision import ScalingGranularity as G
    from turbo_dispatch.ops.gemm import gemm_fp8_problem
    from turbo_dispatch.ops.gemm_grads import fp8_grads

    E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
    m, n, k = 257, 384, 1000
    a = torch.randn((k, m) if ta else (m, k), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((n, k) if tb else (k, n), device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ad = TritonGemmFp8()
    pinned = C.as_tuple(cfg)

    def mm8(x, y, xta, ytb, od, xf, yf, x2d, y2d):
        p = gemm_fp8_problem(x, y, xta, ytb, od, xf, yf, G.BLOCKWISE, 128, x2d, y2d)
        assert ad.supports(p) is None
        if y2d:
            out = ad.run(p, x, y, config=pinned)
        else:
            # The wgrad (and a transposed-A dgrad): b's scales are per column, which the Gluon
            # kernel refuses; it is not offered, a pinned config raises, the default serves.
            assert pinned not in ad.configs(p)
            with pytest.raises(ValueError, match="one per tile"):
                ad.run(p, x, y, config=pinned)
            out = ad.run(p, x, y)
        ref = (x.t() if xta else x).double() @ (y.t() if ytb else y).double()
        s = _snr(out, ref)
        assert out.isfinite().all() and s >= (20.0 if E5 in (xf, yf) else 25.0), (p, s)
        return out

    mm8(a, b, ta, tb, torch.bfloat16, E4, E4, False, True)
    fp8_grads(mm8, a, b, grad, ta, tb, E4, E5, G.BLOCKWISE, True, True)


@pytest.mark.gpu
def test_gpu_ops_route_to_triton(monkeypatch):
    """The registry entries: PRIMUS_TURBO_GEMM_BACKEND=TRITON runs our kernels through the ops."""
    import turbo_dispatch as turbo
    from turbo_dispatch.low_precision import Float8QuantConfig

    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "TRITON")
    turbo.GlobalBackendManager.reset()
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    ref = a.double() @ b.double().t()
    out = turbo.ops.gemm(a, b, trans_b=True)
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-2
    cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
    out8 = turbo.ops.gemm_fp8(a, b, trans_b=True, config=cfg)
    assert _snr(out8, ref) >= 25
    assert turbo.explain("gemm_fp8", a, b, trans_b=True, config=cfg).backend == "TRITON"


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    _interpreter_checks()


def test_warp_specialised_tile_leads_the_adapter_configs_on_sm90(monkeypatch):
    """With both Gluon kernels able to run (availability stubbed: no sm_90 GPU here), the TRITON
    fp8 adapter's blockwise candidates open with the warp-specialised 256-column tile (4 stages at
    this deep K, ``WS_DEEP_K``), all Gluon configs come before the Triton ones, and where b's
    scales are per column (the wgrad) or the recipe is not blockwise, no Gluon config is offered."""
    from turbo_dispatch.backends.triton import configs as C
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GLK
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
    from turbo_dispatch.backends.triton.gemm import TritonGemmFp8
    from turbo_dispatch.low_precision import ScalingGranularity as G
    from turbo_dispatch.ops.gemm import GemmFp8Problem

    for module in (GLK, GWS):
        monkeypatch.setattr(module, "available", lambda device_index=None: None)
    e4, bf = torch.float8_e4m3fn, torch.bfloat16
    fwd = GemmFp8Problem(4096, 7168, 16384, False, True, bf, bf, bf, e4, e4, G.BLOCKWISE, 128, False, True, "cuda")
    cfgs = [C.from_tuple(c) for c in TritonGemmFp8().configs(fwd)]
    assert cfgs[0] == C.TileConfig(128, 256, 128, 8, 4, 8, 1, C.KERNEL_GLUON_WS), cfgs[0]
    kinds = [c.kernel for c in cfgs]
    n_gluon = sum(k in C.GLUON_KERNELS for k in kinds)
    assert n_gluon and all(k in C.GLUON_KERNELS for k in kinds[:n_gluon]), kinds
    assert C.KERNEL_TRITON in kinds
    for p in (fwd._replace(b_2d=False), fwd._replace(granularity=G.ROWWISE, block_size=None)):
        assert all(C.from_tuple(c).kernel == C.KERNEL_TRITON for c in TritonGemmFp8().configs(p)), p


class _FakeDriver:
    """libcuda's three context calls, scripted: the status cuCtxGetCurrent returns and whether a
    context is current; the calls made are recorded."""

    def __init__(self, current_status: int, has_context: bool):
        self.current_status, self.has_context, self.calls = current_status, has_context, []

    def cuCtxGetCurrent(self, ref):
        self.calls.append("cuCtxGetCurrent")
        if self.current_status == 0 and self.has_context:
            ref._obj.value = 1234
        return self.current_status

    def cuDeviceGet(self, ref, index):
        self.calls.append("cuDeviceGet")
        return 0

    def cuDevicePrimaryCtxRetain(self, ref, dev):
        self.calls.append("cuDevicePrimaryCtxRetain")
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.calls.append("cuCtxSetCurrent")
        return 0


def test_bind_cuda_context_binds_once_and_never_after_a_driver_error(monkeypatch):
    """A thread is marked bound only once the driver said a context is current or one was made
    current; after an error from cuCtxGetCurrent the next call asks again (CPU, scripted driver)."""
    import threading
    import types

    from turbo_dispatch.backends.triton import gemm_kernels as GK

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fake_tensor = types.SimpleNamespace(is_cuda=True, device=types.SimpleNamespace(index=0))
    results = {}

    def in_fresh_thread(driver, name):
        def body():
            monkeypatch.setattr(GK, "_libcuda", lambda: driver)
            GK.bind_cuda_context(fake_tensor)
            first = list(driver.calls)
            GK.bind_cuda_context(fake_tensor)
            results[name] = (first, driver.calls[len(first):])
        th = threading.Thread(target=body)
        th.start()
        th.join()

    in_fresh_thread(_FakeDriver(201, False), "error")
    in_fresh_thread(_FakeDriver(0, False), "unbound")
    in_fresh_thread(_FakeDriver(0, True), "bound")
    # An error binds nothing and is asked about again on the next call.
    assert results["error"] == (["cuCtxGetCurrent"], ["cuCtxGetCurrent"])
    # No current context: the primary one is retained and made current, then never asked again.
    assert results["unbound"] == (["cuCtxGetCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
                                   "cuCtxSetCurrent"], [])
    assert results["bound"] == (["cuCtxGetCurrent"], [])


def test_tma_pays_only_beyond_a_few_tile_steps():
    """The TMA path's per-call descriptor cost is taken only where the problem has more than
    POINTER_MAX_TILE_STEPS tile steps; at the limit and below, the pointer loads serve."""
    from turbo_dispatch.backends.triton import gemm_kernels as GK

    limit = GK.POINTER_MAX_TILE_STEPS
    assert not GK.tma_pays(16, 16, 16, 128, 128, 64)
    assert not GK.tma_pays(128, 128, 64 * limit, 128, 128, 64)  # exactly the limit
    assert GK.tma_pays(128, 128, 64 * limit + 1, 128, 128, 64)
    assert GK.tma_pays(129, 128, 64 * limit, 128, 128, 64)
    assert GK.tma_pays(4096, 4096, 4096, 128, 256, 64)


@pytest.mark.parametrize("transposed", [False, True])
def test_descriptor_layout_builds_what_tensor_descriptor_builds(transposed):
    """A DescriptorLayout checked once gives, for any later base, the descriptor TensorDescriptor
    itself would build from the same layout (every field equal), and keeps no base alive."""
    import gc
    import weakref

    from turbo_dispatch.backends.triton import gemm_kernels as GK

    if GK.TensorDescriptor is None:
        pytest.skip("this triton has no host-side TensorDescriptor")
    first = torch.randn(96, 64, dtype=torch.bfloat16)
    first = first.t() if transposed else first
    stored = first.t() if transposed else first
    block = [32, 64]
    layout = GK.DescriptorLayout(stored, stored.shape, stored.stride(), block)
    ref_first = weakref.ref(first)
    del first, stored
    gc.collect()
    assert ref_first() is None, "the layout kept its first base alive"
    later = torch.randn(96, 64, dtype=torch.bfloat16)
    later = later.t().t() if not transposed else later
    got = layout.of(later)
    want = GK.TensorDescriptor(later, list(later.shape), list(later.stride()), block)
    assert type(got) is type(want) and got.base is later
    assert {k: v for k, v in vars(got).items() if k != "base"} == {k: v for k, v in vars(want).items() if k != "base"}
