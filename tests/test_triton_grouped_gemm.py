"""Tests of the TRITON grouped GEMM backends (backends/triton/grouped_*.py).

Two halves:

* CPU: the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``), which must be set
  before triton is imported, so each case runs this file as a script in a subprocess
  (``python tests/test_triton_grouped_gemm.py <case>``). Known interpreter traps, worked around
  there and only there: its bf16 ``tl.dot`` is wrong, so the adapters upcast the operands to
  float32 inside the kernel when interpreting (``UPCAST=1``); its float32 -> fp8 cast drops the
  carry when rounding crosses a power of two, so the quantiser rounds to the fp8 grid itself first
  (``ROUND_FIRST``). The fp8 data, scales and all the indexing (groups, empty groups, token runs
  straddling group boundaries, partial blocks) are exercised as on the GPU.
* GPU (``@pytest.mark.gpu``): odd sizes, both layouts, wgrad, empty experts, skewed routings,
  CUDA-graph capture with the routing changed between replays, every fp8 recipe by SNR against a
  float64 reference of the original inputs, and the full ops with the TRITON backend pinned,
  forward and backward, against the TORCH backend.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

_HERE = os.path.abspath(__file__)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _lens_offs(lens, device="cpu"):
    lens = torch.tensor(lens, dtype=torch.int64, device=device)
    return lens, torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))


def _rel(out, ref) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _snr(out, ref) -> float:
    ref = ref.double()
    err = (out.double() - ref).norm() ** 2
    return (10 * torch.log10(ref.norm() ** 2 / err.clamp_min(1e-300))).item()


def _reference(a, b, lens, trans_b, variable_k):
    """Per-group float64 math on the CPU from the given (unquantised) inputs."""
    a, b = a.double().cpu(), b.double().cpu()
    outs, start = [], 0
    for i, n in enumerate(lens.tolist()):
        end = start + n
        if variable_k:
            outs.append(a[start:end].t() @ b[start:end])
        else:
            outs.append(a[start:end] @ (b[i].t() if trans_b else b[i]))
        start = end
    if variable_k:
        return torch.stack(outs)
    return torch.cat(outs) if outs else a.new_zeros((0, b.shape[1] if trans_b else b.shape[2]))


# -- interpreter cases (run as a script under TRITON_INTERPRET=1) --------------------------------------------
def _case_half():
    from turbo_dispatch.backends.triton.grouped_gemm import TritonGroupedGemm, launch_fixed_k, launch_variable_k
    from turbo_dispatch.ops.grouped_gemm import grouped_gemm_problem, variable_k_problem

    ad = TritonGroupedGemm()
    cfgs = [(16, 16, 16, 2, 1, 4, 0), (32, 16, 16, 1, 1, 4, 0)]
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        for lens_l in ([5, 0, 1, 11], [0, 0, 17, 0], [17]):
            lens, offs = _lens_offs(lens_l)
            for k, trans_b in ((40, False), (32, True)):  # K 40: partial K tiles; 32: EVEN_K
                g = len(lens_l)
                big = torch.randn(17, k + 3, dtype=dtype)
                a = big[:, 1:k + 1]  # non-contiguous rows: the pointer path takes any strides
                b = torch.randn((g, 24, k) if trans_b else (g, k, 24), dtype=dtype)
                p = grouped_gemm_problem(a, b, lens, offs, trans_b)
                assert ad.supports(p) is None, ad.supports(p)
                ref = _reference(a, b, lens, trans_b, False)
                for cfg in (cfgs if lens_l[0] == 5 else cfgs[:1]):
                    out = torch.full((17, 24), float("nan"), dtype=dtype)  # poisoned: every element is written
                    b_gnk = b if trans_b else b.transpose(1, 2)
                    launch_fixed_k(a, b_gnk, out, offs, cfg, upcast=1)
                    assert _rel(out, ref) < tol, (dtype, lens_l, k, trans_b, cfg, _rel(out, ref))
                out = ad.run(p, a, b, lens, None)  # group_offs computed from group_lens
                assert _rel(out, ref) < tol
            x, y = torch.randn(17, 20, dtype=dtype), torch.randn(17, 24, dtype=dtype)
            p = variable_k_problem(x, y, lens, offs)
            ref = _reference(x, y, lens, False, True)
            for cfg in cfgs:
                out = torch.full((len(lens_l), 20, 24), float("nan"), dtype=dtype)
                launch_variable_k(x, y, out, offs, cfg, upcast=1)
                for i, n in enumerate(lens_l):
                    if n == 0:
                        assert torch.equal(out[i], torch.zeros_like(out[i])), "empty group must give exact zeros"
                    else:
                        assert _rel(out[i], ref[i]) < tol, (dtype, lens_l, cfg, i)
            assert _rel(ad.run(p, x, y, lens, offs), ref) < tol
    # no tokens at all: wgrad is all zeros, forward is empty
    lens, offs = _lens_offs([0, 0, 0])
    x, y = torch.randn(0, 8, dtype=torch.float16), torch.randn(0, 16, dtype=torch.float16)
    out = ad.run(variable_k_problem(x, y, lens, offs), x, y, lens, offs)
    assert out.shape == (3, 8, 16) and torch.equal(out, torch.zeros_like(out))
    a, b = torch.randn(0, 16, dtype=torch.float16), torch.randn(3, 16, 8, dtype=torch.float16)
    assert ad.run(grouped_gemm_problem(a, b, lens, offs), a, b, lens, offs).shape == (0, 8)
    # configs: short, hashable, and identity() tells them apart
    a, b = torch.randn(64, 32, dtype=torch.bfloat16), torch.randn(4, 32, 48, dtype=torch.bfloat16)
    lens, offs = _lens_offs([16] * 4)
    for p in (grouped_gemm_problem(a, b, lens, offs), variable_k_problem(a, a, lens, offs)):
        cs = list(ad.configs(p))
        assert 1 <= len(cs) <= 8 and len({ad.identity(c) for c in cs}) == len(cs)
        assert all(isinstance(c, tuple) and all(isinstance(v, int) for v in c) for c in cs)
    with pytest.raises(ValueError, match="config"):
        ad.run(grouped_gemm_problem(a, b, lens, offs), a, b, lens, offs, config=(16, 16))


def _fp8_problem(x, y, lens, offs, trans_b, variable_k, out_dtype, fa, fb, gran, bs, b_2d):
    from turbo_dispatch.ops.grouped_gemm import grouped_gemm_fp8_problem

    return grouped_gemm_fp8_problem(x, y, lens, offs, trans_b, variable_k, out_dtype, fa, fb, gran, bs, b_2d)


def _recipes():
    from turbo_dispatch.low_precision import ScalingGranularity as SG

    # (granularity, block_size, b_2d, BK of the interpreter config)
    return [(SG.TENSORWISE, None, False, 16), (SG.ROWWISE, None, False, 32), (SG.BLOCKWISE, 32, True, 32),
            (SG.BLOCKWISE, 64, True, 32), (SG.BLOCKWISE, 32, False, 16)]


def _case_fp8_fixed():
    from turbo_dispatch.backends.torch.grouped_gemm import TorchGroupedGemmFp8
    from turbo_dispatch.backends.triton.grouped_gemm import TritonGroupedGemmFp8

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    tri, ref_ad = TritonGroupedGemmFp8(), TorchGroupedGemmFp8()
    for lens_l in ([40, 0, 1, 30], [71]):
        lens, offs = _lens_offs(lens_l)
        g = len(lens_l)
        for gran, bs, b_2d, bk in _recipes():
            # e4m3 with float32 out, and HYBRID dgrad's e5m2 x e4m3 with bf16 out, one per layout
            for trans_b, (fa, fb, out_dtype) in ((False, (e4, e4, torch.float32)), (True, (e5, e4, torch.bfloat16))):
                a = torch.randn(71, 72) * 3
                b = torch.randn((g, 40, 72) if trans_b else (g, 72, 40))
                p = _fp8_problem(a, b, lens, offs, trans_b, False, out_dtype, fa, fb, gran, bs, b_2d)
                assert tri.supports(p) is None, tri.supports(p)
                out = tri.run(p, a, b, lens, offs, config=(16, 16, bk, 2, 1, 4, 0))
                assert out.dtype == out_dtype and out.shape == (71, 40)
                if len(lens_l) > 1 and not trans_b:
                    # Three programs per "SM" walk the same tiles in another split: same bits.
                    more = tri.run(p, a, b, lens, offs, config=(16, 16, bk, 2, 1, 4, 0, 3))
                    assert torch.equal(more, out), (gran, bs, b_2d)
                same = ref_ad.run(p, a, b, lens, offs)  # the same quantisation, dequantised in float32
                tol = 1e-5 if out_dtype == torch.float32 else 1e-2
                assert _rel(out, same) < tol, (gran, bs, b_2d, trans_b, fa, _rel(out, same))
                snr = _snr(out, _reference(a, b, lens, trans_b, False))
                assert snr >= (20 if e5 in (fa, fb) else 25), (gran, bs, trans_b, fa, snr)


def _case_fp8_variable():
    from turbo_dispatch.backends.torch.grouped_gemm import TorchGroupedGemmFp8
    from turbo_dispatch.backends.triton.grouped_gemm import TritonGroupedGemmFp8

    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    tri, ref_ad = TritonGroupedGemmFp8(), TorchGroupedGemmFp8()
    # token runs of 32 straddle the boundaries at 40 and 41; the 1-token group sits inside a run
    for lens_l in ([40, 0, 1, 30], [0, 71, 0], [33, 38]):
        lens, offs = _lens_offs(lens_l)
        for r, (gran, bs, _, bk) in enumerate(_recipes()):
            for fa, fb in ((e4, e4), (e5, e4))[r % 2:r % 2 + 1] if lens_l[0] else ((e4, e4),):
                x, y = torch.randn(71, 20), torch.randn(71, 24) * 5
                p = _fp8_problem(x, y, lens, offs, False, True, torch.float32, fa, fb, gran, bs, False)
                out = tri.run(p, x, y, lens, offs, config=(16, 16, bk, 2, 1, 4, 0))
                assert out.shape == (len(lens_l), 20, 24)
                same = ref_ad.run(p, x, y, lens, offs)
                ref = _reference(x, y, lens, False, True)
                for i, n in enumerate(lens_l):
                    if n == 0:
                        assert torch.equal(out[i], torch.zeros_like(out[i])), "empty group must give exact zeros"
                        continue
                    assert _rel(out[i], same[i]) < 1e-5, (gran, bs, lens_l, i, _rel(out[i], same[i]))
                    if n > 1:
                        assert _snr(out[i], ref[i]) >= (20 if e5 in (fa, fb) else 25), (gran, lens_l, i)


def _token_contiguous(t: torch.Tensor) -> torch.Tensor:
    """[T, cols] view of a copy stored [cols, T] with the row stride padded to 16 elements (the fp8
    quantiser's wgrad layout; TMA needs 16-byte strides)."""
    tokens, cols = t.shape
    store = torch.full((cols, -(-tokens // 16) * 16), float("nan"), dtype=t.dtype, device=t.device)  # never read
    store[:, :tokens] = t.t()
    return store[:, :tokens].t()


# start/end off the BK grid, a 1-token group inside one BK cell, groups shorter than BK, empty
# groups first/middle/last, a group with interior steps, odd T (61)
_EDGE_ROUTINGS = ([5, 0, 1, 11, 40, 4], [0, 61, 0], [16, 3, 13, 29, 0])


def _case_variable_k_edges():
    """Interior/edge split of the wgrad kernel, on the pointer path and (under the interpreter,
    forced) the TMA-descriptor path, with every operand layout; fp16/bf16 in float32 inside
    (UPCAST=1, the interpreter's bf16 dot is wrong), fp8 in every granularity."""
    from turbo_dispatch.backends.torch.grouped_gemm import TorchGroupedGemmFp8
    from turbo_dispatch.backends.triton.grouped_gemm import _quant_rows, _vk_descriptor, launch_variable_k
    from turbo_dispatch.low_precision import ScalingGranularity as SG

    cfgs = [(16, 16, 16, 2, 1, 4), (32, 16, 32, 1, 2, 4)]  # BM 32 > M % 32: rows past M zero-filled
    for lens_l in _EDGE_ROUTINGS:
        lens, offs = _lens_offs(lens_l)
        t = sum(lens_l)
        for dtype in (torch.float16, torch.bfloat16):
            tol = 2e-3 if dtype == torch.float16 else 1e-2
            x0, y0 = torch.randn(t, 24, dtype=dtype), torch.randn(t, 40, dtype=dtype)
            ref = _reference(x0, y0, lens, False, True)
            for x_tc, y_tc in ((False, False), (True, True), (True, False)):
                x = _token_contiguous(x0) if x_tc else x0
                y = _token_contiguous(y0) if y_tc else y0
                for cfg in cfgs:
                    assert _vk_descriptor(x, cfg[0], cfg[2])[1] == x_tc  # the descriptor path is taken
                    assert _vk_descriptor(y, cfg[1], cfg[2])[1] == y_tc
                    for tma in (0, 1):
                        out = torch.full((len(lens_l), 24, 40), float("nan"), dtype=dtype)
                        launch_variable_k(x, y, out, offs, cfg + (tma,), upcast=1, tma_in_interpreter=True)
                        for i, n in enumerate(lens_l):
                            if n == 0:
                                assert torch.equal(out[i], torch.zeros_like(out[i])), "empty group: exact zeros"
                            else:
                                assert _rel(out[i], ref[i]) < tol, (lens_l, dtype, x_tc, y_tc, cfg, tma, i)
        # a non-finite token poisons its own group only: edge steps zero both operands' foreign tokens
        if lens_l[0] and lens_l[2]:
            x, y = torch.randn(t, 24, dtype=torch.float16), torch.randn(t, 40, dtype=torch.float16)
            x[lens_l[0] - 1, 3] = float("inf")  # last token of group 0
            y[lens_l[0] + lens_l[1], 5] = float("nan")  # first token of group 2
            ref = _reference(x.nan_to_num(0, 0, 0), y.nan_to_num(0, 0, 0), lens, False, True)
            for tma in (0, 1):
                out = torch.empty((len(lens_l), 24, 40), dtype=torch.float16)
                launch_variable_k(x, y, out, offs, cfgs[0] + (tma,), upcast=1, tma_in_interpreter=True)
                clean = [i for i in range(len(lens_l)) if i not in (0, 2) and lens_l[i]]
                assert clean and all(_rel(out[i], ref[i]) < 2e-3 for i in clean), (lens_l, tma)
                assert not torch.isfinite(out[0]).all() and not torch.isfinite(out[2]).all()
    # fp8: quantised as the adapter does (token-contiguous, scales along the global token index)
    e4 = torch.float8_e4m3fn
    ref_ad = TorchGroupedGemmFp8()
    for lens_l in _EDGE_ROUTINGS:
        lens, offs = _lens_offs(lens_l)
        t = sum(lens_l)
        x, y = torch.randn(t, 20), torch.randn(t, 24) * 5
        for gran, bs, _, bk in _recipes():
            p = _fp8_problem(x, y, lens, offs, False, True, torch.float32, e4, e4, gran, bs, False)
            same = ref_ad.run(p, x, y, lens, offs)  # the same quantisation, dequantised in float32
            qx, sx = _quant_rows(x.t().unsqueeze(0), e4, gran, bs, scale_rows_inner=True)
            qy, sy = _quant_rows(y.t().unsqueeze(0), e4, gran, bs, scale_rows_inner=True)
            qx, qy = qx[0].t(), qy[0].t()
            assert _vk_descriptor(qx, 16, bk)[0] is not None and _vk_descriptor(qy, 16, bk)[0] is not None
            mode = {SG.TENSORWISE: 1, SG.ROWWISE: 2, SG.BLOCKWISE: 3}[gran]
            sxs = (0, 0) if mode == 1 else (sx.stride(2), sx.stride(1))
            sys_ = (0, 0) if mode == 1 else (sy.stride(2), sy.stride(1))
            for tma in (0, 1):
                out = torch.full((len(lens_l), 20, 24), float("nan"))
                launch_variable_k(qx, qy, out, offs, (16, 16, bk, 2, 1, 4, tma), scale=mode, sx=sx, sx_strides=sxs,
                                  sy=sy, sy_strides=sys_, qblock=bs or 128, upcast=1, tma_in_interpreter=True)
                for i, n in enumerate(lens_l):
                    if n == 0:
                        assert torch.equal(out[i], torch.zeros_like(out[i])), "empty group: exact zeros"
                    else:
                        assert _rel(out[i], same[i]) < 1e-5, (gran, bs, lens_l, tma, i, _rel(out[i], same[i]))


def _case_quantize():
    from turbo_dispatch.backends.triton.grouped_quantize import quantize_cells, tensorwise_scale
    from turbo_dispatch.low_precision import quantize

    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = torch.randn(3, 70, 100) * 10
        x[0, 5, 7] = 0.0
        x[1, :, 64:96] = 0.0  # all-zero runs get scale 1
        cases = [  # (view, cell_r, cell_c, torch.quantize kwargs on the view)
            (x, 1, 32, dict(granularity="blockwise", axis=2, block_size=32)),
            (x, 1, 100, dict(granularity="rowwise", axis=2)),
            (x, 32, 32, dict(granularity="blockwise", block_size=32, block_2d=True)),
            (x.transpose(1, 2), 32, 32, dict(granularity="blockwise", block_size=32, block_2d=True)),
            (x.transpose(1, 2), 1, 70, dict(granularity="rowwise", axis=2)),
            (x.transpose(1, 2), 1, 32, dict(granularity="blockwise", axis=2, block_size=32)),
        ]
        for view, cr, cc, kw in cases:
            data, scale = quantize_cells(view, dt, cr, cc)
            q = quantize(view, dt, **kw)
            assert torch.equal(scale.reshape(q.scale.shape), q.scale), (dt, cr, cc)
            assert torch.equal(data.float(), q.data.float()), (dt, cr, cc)
            assert data.stride(1) % 16 == 0  # rows padded to 16 bytes for TMA
            data2, scale2 = quantize_cells(view, dt, cr, cc, scale_rows_inner=True)  # the wgrad scale layout
            assert torch.equal(scale2, scale) and torch.equal(data2.float(), data.float())
            assert scale2.shape[1] == 1 or scale2.stride(1) == 1
        s = tensorwise_scale(x, dt)
        data, _ = quantize_cells(x, dt, 1, 1, scale=s)
        q = quantize(x, dt, "tensorwise")
        assert torch.equal(s.reshape(()), q.scale) and torch.equal(data.float(), q.data.float())
    # a NaN poisons its own cell's scale only
    x = torch.randn(1, 4, 64)
    x[0, 1, 3] = float("nan")
    _, scale = quantize_cells(x, torch.float8_e4m3fn, 1, 32)
    assert torch.isnan(scale[0, 1, 0]) and torch.isfinite(scale[0, 1, 1]) and torch.isfinite(scale[0, 0]).all()
    with pytest.raises(ValueError, match="3-D"):
        quantize_cells(x[0], torch.float8_e4m3fn, 1, 32)


def _case_dual_quantize():
    """The one-read dual quantiser gives bit for bit what two quantisations give (reference
    quantize: the same math as quantize_cells), strided inputs, odd sizes, zero runs, a NaN."""
    from turbo_dispatch.backends.triton.dual_quantize import dual_quantize
    from turbo_dispatch.low_precision import quantize

    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        for block in (32, 64):
            big = torch.randn(2, 70, 103, dtype=torch.bfloat16) * 10
            x = big[:, :, 2:102]  # strided rows
            x[0, 5, 7] = 0.0
            x[1, :, 64:96] = 0.0
            d, s, d_t, s_t = dual_quantize(x, dt, block, False)
            rows = quantize(x, dt, "blockwise", axis=2, block_size=block)
            cols = quantize(x, dt, "blockwise", axis=1, block_size=block)
            assert torch.equal(s, rows.scale) and torch.equal(d.float(), rows.data.float()), (dt, block)
            assert torch.equal(s_t, cols.scale) and torch.equal(d_t.transpose(1, 2).float(), cols.data.float())
            assert d.stride(1) % 16 == 0 and d_t.stride(1) % 16 == 0  # TMA row strides
            w = x.transpose(1, 2)
            d, s, d_t, s_t = dual_quantize(w, dt, block, True)
            q = quantize(w, dt, "blockwise", block_size=block, block_2d=True)
            assert torch.equal(s, q.scale) and torch.equal(d.float(), q.data.float())
            assert torch.equal(d_t.transpose(1, 2).float(), q.data.float()) and torch.equal(s_t.transpose(1, 2), s)
    x = torch.randn(1, 40, 64)
    x[0, 33, 3] = float("nan")
    _, s, _, s_t = dual_quantize(x, torch.float8_e4m3fn, 32, False)
    assert torch.isnan(s[0, 33, 0]) and torch.isfinite(s[0, 33, 1]) and torch.isnan(s_t[0, 1, 3])
    assert int(torch.isnan(s).sum()) == 1 and int(torch.isnan(s_t).sum()) == 1
    with pytest.raises(ValueError, match="block must be one of"):
        dual_quantize(x, torch.float8_e4m3fn, 48, False)


def _case_fp8_step():
    """The public blockwise op with TRITON pinned: the step that quantises each operand once (the
    adapter gets QuantizedTensors: token runs, dgrad-order weight tiles) gives the same bits as
    the step that quantises per GEMM, for both layouts, both formats, and one-sided gradients."""
    import importlib

    import turbo_dispatch as turbo
    from turbo_dispatch.backends.triton.grouped_gemm import TritonGroupedGemmFp8
    from turbo_dispatch.low_precision import Float8QuantConfig

    # The eager step runs its GEMMs (run_fp8) and picks once or per GEMM (step_reuses_quantization)
    # here. TRITON is registered for GPUs only: every fp8 GEMM of the step goes to its adapter directly.
    grouped = importlib.import_module("turbo_dispatch.ops.grouped_gemm_autograd")
    adapter = TritonGroupedGemmFp8()
    seen = []

    def run_triton(p, x, y, lens_, offs):
        seen.append(p.a_dtype in _FP8_DTYPES or p.b_dtype in _FP8_DTYPES)
        assert adapter.supports(p) is None, adapter.supports(p)
        return adapter.run(p, x, y, lens_, offs)

    grouped.run_fp8 = run_triton
    # A planned step resolves its GEMMs itself (grouped_gemm_plan): off here, so that every GEMM
    # goes through run_fp8 to the adapter.
    importlib.import_module("turbo_dispatch.ops.grouped_gemm_plan").step_key = lambda *args: None
    lens, _ = _lens_offs([37, 0, 64, 27])
    m, k, n = 128, 64, 96
    for trans_b in (True, False):
        for fmt, need in (("e4m3", (True, True)), ("hybrid", (True, True)), ("e4m3", (True, False)),
                          ("hybrid", (False, True))):
            cfg = Float8QuantConfig(format=fmt, granularity="blockwise", block_size=32)
            a0, b0 = torch.randn(m, k), torch.randn((4, n, k) if trans_b else (4, k, n))
            grad = torch.randn(m, n)
            results = []
            for reuse in (True, False):
                saved = grouped.step_reuses_quantization
                if not reuse:
                    grouped.step_reuses_quantization = lambda c: False
                try:
                    a, b = a0.clone().requires_grad_(need[0]), b0.clone().requires_grad_(need[1])
                    out = turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=trans_b, config=cfg)
                    out.backward(grad)
                finally:
                    grouped.step_reuses_quantization = saved
                results.append((out.detach(), a.grad, b.grad))
            for x, y in zip(*results):
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (trans_b, fmt, need)
            if need[1]:
                assert torch.equal(results[0][2][1], torch.zeros_like(results[0][2][1]))  # empty expert
    assert any(seen) and not all(seen)  # both steps ran: with pre-quantised operands and without


_CASES = {"half": _case_half, "dual_quantize": _case_dual_quantize, "fp8_step": _case_fp8_step, "fp8_fixed": _case_fp8_fixed, "fp8_variable": _case_fp8_variable,
          "quantize": _case_quantize, "variable_k_edges": _case_variable_k_edges}


@pytest.fixture(scope="module")
def interpreter_runs(interpreter_refusal):
    """Starts every interpreter case at once (they are independent processes), so the file's CPU
    tests take about as long as the slowest case; each test then waits for its own."""
    if interpreter_refusal:
        pytest.skip(interpreter_refusal)
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = {case: subprocess.Popen([sys.executable, _HERE, case], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for case in _CASES}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("case", sorted(_CASES))
def test_interpreter(case, interpreter_runs):
    """Runs one case under the Triton interpreter in a fresh process (see the module docstring)."""
    out, err = interpreter_runs[case].communicate(timeout=300)
    assert interpreter_runs[case].returncode == 0 and out.strip().endswith(f"OK {case}"), out[-4000:] + err[-4000:]


def test_supports_and_availability_reasons():
    pytest.importorskip("triton")
    from turbo_dispatch.backends.triton.grouped_gemm import TritonGroupedGemm, TritonGroupedGemmFp8
    from turbo_dispatch.low_precision import ScalingGranularity as SG
    from turbo_dispatch.ops.grouped_gemm import GroupedGemmFp8Problem, GroupedGemmProblem

    p = GroupedGemmProblem(4, 64, 32, 16, False, False, torch.float32, "cuda")
    assert "bf16/fp16" in TritonGroupedGemm().supports(p)
    if os.environ.get("TRITON_INTERPRET") != "1":
        cpu = GroupedGemmProblem(4, 64, 32, 16, False, False, torch.bfloat16, "cpu")
        assert "GPU" in TritonGroupedGemm().supports(cpu)
        if not torch.cuda.is_available():
            assert "GPU" in TritonGroupedGemm().available()
    e4 = torch.float8_e4m3fn
    q = GroupedGemmFp8Problem(4, 64, 32, 16, True, False, torch.bfloat16, torch.bfloat16, torch.bfloat16, e4, e4,
                              SG.MX_BLOCKWISE, 32, False, "cuda")
    assert "mx_blockwise" in TritonGroupedGemmFp8().supports(q)
    q = q._replace(granularity=SG.BLOCKWISE, block_size=48)
    assert "multiple of 32" in TritonGroupedGemmFp8().supports(q)
    assert TritonGroupedGemmFp8().supports(q._replace(block_size=128)) is None


# -- GPU tests ------------------------------------------------------------------------------------------------
def _gpu_adapters():
    from turbo_dispatch.backends.triton.grouped_gemm import TritonGroupedGemm, TritonGroupedGemmFp8

    return TritonGroupedGemm(), TritonGroupedGemmFp8()


_ROUTINGS = {
    "odd": [37, 0, 1, 250, 77, 0, 400],
    "skewed": [1200, 3, 0, 0, 40, 0, 1, 8],
    "balanced": [256] * 6,
    "one_group": [513],
}


def test_overlap_only_on_real_eager_cuda_tensors():
    """``overlappable`` (the gate of the blockwise step's two-stream paths) refuses CPU tensors and
    anything being traced: a fake CUDA tensor under FakeTensorMode (as AOT autograd and opcheck
    trace the backward) and a tensor subclass, so no side stream enters a graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from turbo_dispatch.low_precision.side_streams import overlappable

    assert not overlappable(torch.empty(2))
    with FakeTensorMode():
        fake = torch.empty(2, device="cuda")
        assert fake.is_cuda and not overlappable(fake)
    assert not overlappable(torch.nn.Parameter(torch.empty(2)))


@pytest.mark.gpu
@pytest.mark.parametrize("routing", sorted(_ROUTINGS))
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_fixed_and_variable(routing, trans_b, dtype):
    from turbo_dispatch.backends.triton.grouped_gemm import launch_fixed_k, launch_variable_k
    from turbo_dispatch.ops.grouped_gemm import grouped_gemm_problem, variable_k_problem

    ad, _ = _gpu_adapters()
    lens, offs = _lens_offs(_ROUTINGS[routing], "cuda")
    g, m = len(_ROUTINGS[routing]), sum(_ROUTINGS[routing])
    k, n = (264, 392) if routing != "odd" else (333, 211)  # odd: TMA refuses, the pointer path serves
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn((g, n, k) if trans_b else (g, k, n), device="cuda", dtype=dtype)
    p = grouped_gemm_problem(a, b, lens, offs, trans_b)
    ref = _reference(a, b, lens.cpu(), trans_b, False)
    for cfg in ad.configs(p) if routing == "balanced" else ad.configs(p)[:1]:
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        launch_fixed_k(a, b if trans_b else b.transpose(1, 2), out, offs, cfg)
        assert _rel(out.cpu(), ref) <= 2e-2, (cfg, _rel(out.cpu(), ref))
    assert _rel(ad.run(p, a, b, lens, offs).cpu(), ref) <= 2e-2
    # wgrad: out[g] = x_g^T y_g (x plays the gradient or the activation)
    x, y = torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(m, n, device="cuda", dtype=dtype)
    pv = variable_k_problem(x, y, lens, offs)
    ref = _reference(x, y, lens.cpu(), False, True)
    for cfg in ad.configs(pv) if routing == "balanced" else ad.configs(pv)[:1]:
        out = torch.full((g, k, n), float("nan"), device="cuda", dtype=dtype)
        launch_variable_k(x, y, out, offs, cfg)
        out = out.cpu()
        for i, cnt in enumerate(_ROUTINGS[routing]):
            if cnt == 0:
                assert torch.equal(out[i], torch.zeros_like(out[i]))
            else:
                assert _rel(out[i], ref[i]) <= 2e-2, (cfg, i, _rel(out[i], ref[i]))


def _fp8_recipes_gpu():
    from turbo_dispatch.low_precision import ScalingGranularity as SG

    return [(SG.TENSORWISE, None, False), (SG.ROWWISE, None, False), (SG.BLOCKWISE, 128, True),
            (SG.BLOCKWISE, 128, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["odd", "skewed", "balanced"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_gpu_fp8_every_recipe(routing, fmt):
    _, ad = _gpu_adapters()
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    lens_l = _ROUTINGS[routing]
    lens, offs = _lens_offs(lens_l, "cuda")
    g, m = len(lens_l), sum(lens_l)
    k, n = (448, 392) if routing != "odd" else (333, 211)
    for gran, bs, b_2d in _fp8_recipes_gpu():
        for trans_b in (False, True):
            fa = e5 if fmt == "hybrid" else e4  # dgrad under HYBRID: e5m2 gradient x e4m3 weight
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn((g, n, k) if trans_b else (g, k, n), device="cuda", dtype=torch.bfloat16)
            p = _fp8_problem(a, b, lens, offs, trans_b, False, torch.bfloat16, fa, e4, gran, bs, b_2d)
            ref = _reference(a, b, lens.cpu(), trans_b, False)
            floor = 20 if fmt == "hybrid" else 25
            for cfg in ad.configs(p)[:4] if (routing == "balanced" and fmt == "e4m3") else [None]:
                out = ad.run(p, a, b, lens, offs, config=cfg)
                assert torch.isfinite(out).all()
                assert _snr(out.cpu(), ref) >= floor, (gran, b_2d, trans_b, cfg, _snr(out.cpu(), ref))
        x, y = torch.randn(m, k, device="cuda"), torch.randn(m, n, device="cuda") * 4
        fx = e5 if fmt == "hybrid" else e4
        pv = _fp8_problem(x, y, lens, offs, False, True, torch.float32, fx, e4, gran, bs, False)
        ref = _reference(x, y, lens.cpu(), False, True)
        for cfg in ad.configs(pv) if (routing == "balanced" and fmt == "e4m3") else [None]:
            out = ad.run(pv, x, y, lens, offs, config=cfg).cpu()
            for i, cnt in enumerate(lens_l):
                if cnt == 0:
                    assert torch.equal(out[i], torch.zeros_like(out[i]))
                elif cnt > 16:
                    assert _snr(out[i], ref[i]) >= (20 if fmt == "hybrid" else 25), (gran, cfg, i)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["token_major", "token_contiguous"])
def test_gpu_wgrad_edges_tma_and_pointer(layout):
    """The wgrad kernel's interior/edge split on the GPU: group bounds off the BK grid, groups
    shorter than BK, empty groups, odd T; TMA and pointer configs; a non-finite token stays in its
    own group (edge steps zero both operands' foreign tokens)."""
    from turbo_dispatch.backends.triton.grouped_gemm import TritonGroupedGemm, _vk_descriptor, launch_variable_k
    from turbo_dispatch.ops.grouped_gemm import variable_k_problem

    lens_l = [5, 0, 1, 70, 200, 3, 0, 64, 378]  # T = 721 (token-contiguous rows padded to 736)
    lens, offs = _lens_offs(lens_l, "cuda")
    t, m, n = sum(lens_l), 136, 264
    x = torch.randn(t, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    x[4, 7] = float("inf")  # last token of group 0
    y[6, 9] = float("nan")  # first token of group 3
    if layout == "token_contiguous":
        x, y = _token_contiguous(x), _token_contiguous(y)
    ref = _reference(x.nan_to_num(0, 0, 0), y.nan_to_num(0, 0, 0), lens.cpu(), False, True)
    p = variable_k_problem(x, y, lens, offs)
    cfgs = list(TritonGroupedGemm().configs(p))
    assert any(c[6] for c in cfgs) and any(not c[6] for c in cfgs)
    for cfg in cfgs:
        if cfg[6]:
            assert _vk_descriptor(x, cfg[0], cfg[2])[0] is not None, "TMA path expected for this layout"
        out = torch.full((len(lens_l), m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch_variable_k(x, y, out, offs, cfg)
        out = out.cpu()
        for i, cnt in enumerate(lens_l):
            if i in (0, 3):
                assert not torch.isfinite(out[i]).all()
            elif cnt == 0:
                assert torch.equal(out[i], torch.zeros_like(out[i])), (cfg, i)
            else:
                assert torch.isfinite(out[i]).all() and _rel(out[i], ref[i]) <= 1e-2, (cfg, i, _rel(out[i], ref[i]))


def _token_runs(t: torch.Tensor, dtype: torch.dtype):
    """``t`` [T, cols] quantised in 128-token runs along T as the wgrad reads it: the token-contiguous
    fp8 view [T, cols], its scale [cols, nT] and the float64 dequantised values [T, cols]."""
    from turbo_dispatch.backends.triton.grouped_gemm import _quant_rows
    from turbo_dispatch.low_precision import ScalingGranularity as SG

    q, s = _quant_rows(t.t().unsqueeze(0), dtype, SG.BLOCKWISE, 128, scale_rows_inner=True)
    q, s = q[0].t(), s[0]
    deq = q.double() * s.double().repeat_interleave(128, dim=1)[:, :t.shape[0]].t()
    return q, s, deq


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_gpu_wgrad_warp_specialised_vs_float64(out_dtype, fmt, offs_dtype):
    """The warp-specialised blockwise wgrad kernel against a float64 product of the dequantised
    operands, every config it offers and the 256-row tile: group bounds off the 128-token grid,
    groups shorter than a step and inside one step, empty groups first, in the middle and last, M
    and N that end inside a tile (masked stores) and N whose rows TMA cannot store (333, pointer stores); NaN bytes put
    into the fp8 data of one group's last token and another's first stay in their groups."""
    from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW
    from turbo_dispatch.backends.triton.grouped_gemm import WGRAD_WS_CONFIGS

    if GWW.available():
        pytest.skip(GWW.available())
    lens_l = [0, 5, 1, 70, 200, 3, 0, 130, 378, 0]  # T = 787
    lens, offs = _lens_offs(lens_l, "cuda")
    offs = offs.to(offs_dtype)
    t, m, n = sum(lens_l), 200, (328 if fmt == "e4m3" else 333)
    fx = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn  # HYBRID: e5m2 gradient
    qx, sx, dx = _token_runs(torch.randn(t, m, device="cuda", dtype=torch.bfloat16), fx)
    qy, sy, dy = _token_runs(torch.randn(t, n, device="cuda", dtype=torch.bfloat16) * 4, torch.float8_e4m3fn)
    nan = 0x7F if fx == torch.float8_e4m3fn else 0x7E
    qx.view(torch.uint8)[4, 7] = nan  # the last token of group 1 ([0, 5))
    qy.view(torch.uint8)[6, 9] = 0x7F  # the first token of group 3 ([6, 76))
    ref = _reference(dx.nan_to_num(0.0), dy.nan_to_num(0.0), lens.cpu(), False, True)
    tol = 1e-3 if out_dtype == torch.float32 else 8e-3
    for cfg in [c[:6] for c in WGRAD_WS_CONFIGS] + [(256, 128, 128, 8, 3, 8)]:
        out = torch.full((len(lens_l), m, n), float("nan"), device="cuda", dtype=out_dtype)
        GWW.fp8_blockwise_wgrad(qx, qy, out, offs, sx, (sx.stride(1), sx.stride(0)), sy,
                                (sy.stride(1), sy.stride(0)), cfg)
        out = out.cpu()
        for i, cnt in enumerate(lens_l):
            if i in (1, 3):
                assert not torch.isfinite(out[i]).all(), (cfg, i)
                keep = torch.ones(m, n, dtype=torch.bool)
                keep[7 if i == 1 else slice(None), 9 if i == 3 else slice(None)] = False
                assert torch.isfinite(out[i][keep]).all(), (cfg, i)
            elif cnt == 0:
                assert torch.equal(out[i], torch.zeros_like(out[i])), (cfg, i)
            else:
                assert torch.isfinite(out[i]).all() and _rel(out[i], ref[i]) <= tol, (cfg, i, _rel(out[i], ref[i]))


@pytest.mark.gpu
@pytest.mark.parametrize("lens_l, m_total", [([200, 0, 136], 400), ([150, 150], 300), ([40, 60], 4133)])
@pytest.mark.parametrize("config", [0, 2])
def test_gpu_ws_grouped_kernel_zeroes_the_padded_tail(lens_l, m_total, config):
    """The warp-specialised grouped kernel writes every row of ``out``: its groups' rows against
    float64 math on the dequantised operands, the rows past the last group zero (``out`` starts
    as NaN), whether the tail is empty, shorter than one block or thousands of rows over many
    blocks per warpgroup, at a 256- and a 128-column tile."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
    from turbo_dispatch.backends.triton import grouped_gemm as GG
    from turbo_dispatch.low_precision import ScalingGranularity as SG
    from turbo_dispatch.low_precision import dequantize, quantize

    if GWS.available(0):
        pytest.skip(GWS.available(0))
    e4, n, k = torch.float8_e4m3fn, 320, 256
    gen = torch.Generator().manual_seed(7)
    lens, offs = _lens_offs(lens_l, "cuda")
    x = torch.randn(m_total, k, generator=gen).bfloat16().cuda()
    w = torch.randn(len(lens_l), n, k, generator=gen).bfloat16().cuda()
    qx = quantize(x, e4, SG.BLOCKWISE, axis=1, block_size=128)
    qw = quantize(w, e4, SG.BLOCKWISE, block_size=128, block_2d=True)
    out = torch.full((m_total, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    GWS.fp8_blockwise_grouped_gemm(qx.data, qw.data, out, offs, qx.scale, qx.scale.stride(), qw.scale,
                                   qw.scale.stride(), GG.WS_CONFIGS[config][:6])
    rows = sum(lens_l)
    ref = _reference(dequantize(qx).float(), dequantize(qw).float(), lens.cpu(), True, False)
    assert _snr(out[:rows].cpu(), ref) > 40
    assert torch.equal(out[rows:].cpu(), torch.zeros(m_total - rows, n, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_with_changing_routing():
    from turbo_dispatch.low_precision import ScalingGranularity as SG
    from turbo_dispatch.ops.grouped_gemm import grouped_gemm_problem

    half, fp8 = _gpu_adapters()
    g, m, k, n = 6, 1536, 512, 384
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    routings = [[256] * 6, [1536, 0, 0, 0, 0, 0], [0, 100, 0, 1, 1000, 435]]
    lens, offs = _lens_offs(routings[0], "cuda")
    p = grouped_gemm_problem(a, b, lens, offs, True)
    e4 = torch.float8_e4m3fn
    q = _fp8_problem(a, b, lens, offs, True, False, torch.bfloat16, e4, e4, SG.BLOCKWISE, 128, True)
    half.run(p, a, b, lens, offs)  # compile outside the capture
    fp8.run(q, a, b, lens, offs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = half.run(p, a, b, lens, offs)
        out8 = fp8.run(q, a, b, lens, offs)
    for r in routings[1:] + routings[:1]:
        new_lens, new_offs = _lens_offs(r, "cuda")
        lens.copy_(new_lens)
        offs.copy_(new_offs)
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(a, b, new_lens.cpu(), True, False)
        assert _rel(out.cpu(), ref) <= 2e-2, r
        assert _snr(out8.cpu(), ref) >= 25, r


@pytest.mark.gpu
def test_gpu_blockwise_training_step_in_a_cuda_graph():
    """The whole blockwise step (forward, dgrad, wgrad, its one-read quantisations, the fp8 tensors
    saved between them) captured in one CUDA graph, replayed with other routings written into
    group_lens: the same bits as the eager step with that routing."""
    import turbo_dispatch as turbo
    from turbo_dispatch import BackendType, GlobalBackendManager
    from turbo_dispatch.low_precision import Float8QuantConfig

    GlobalBackendManager.reset()
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
    g, m, k, n = 6, 1536, 512, 384
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    routings = [[256] * 6, [1536, 0, 0, 0, 0, 0], [0, 100, 0, 1, 1000, 435]]
    lens, _ = _lens_offs(routings[0], "cuda")

    def step(group_lens):
        a.grad = b.grad = None
        out = turbo.ops.grouped_gemm_fp8(a, b, group_lens, trans_b=True, config=cfg)
        out.backward(grad)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and resolves outside the capture
        for _ in range(2):
            step(lens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    a.grad = b.grad = None
    with torch.cuda.graph(graph):
        out = step(lens)
    # Keep the captured output's memory but not its autograd graph: that graph's AccumulateGrad
    # nodes belong to the capture stream, and the eager steps below (default stream) would reuse
    # them (torch's stream-mismatch warning).
    out = out.detach()
    grads = (a.grad, b.grad)
    try:
        for r in routings[1:] + routings[:1]:
            lens.copy_(_lens_offs(r, "cuda")[0])
            graph.replay()
            torch.cuda.synchronize()
            captured = (out.clone(), grads[0].clone(), grads[1].clone())
            eager = step(_lens_offs(r, "cuda")[0])
            for name, x, y in zip(("out", "grad_a", "grad_b"), captured, (eager, a.grad, b.grad)):
                assert torch.equal(x, y), (r, name)
    finally:
        GlobalBackendManager.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [False, True])
def test_gpu_full_op_forward_backward_vs_torch(trans_b):
    import turbo_dispatch as turbo
    from turbo_dispatch import BackendType, GlobalBackendManager
    from turbo_dispatch.low_precision import Float8QuantConfig

    lens_l = [300, 0, 1, 523, 200, 0]
    lens, _ = _lens_offs(lens_l, "cuda")
    g, m, k, n = len(lens_l), sum(lens_l), 512, 768

    def step(backend, fp8_cfg=None):
        GlobalBackendManager.reset()
        GlobalBackendManager.set_grouped_gemm_backend(backend)
        torch.manual_seed(1)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn((g, n, k) if trans_b else (g, k, n), device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        if fp8_cfg is None:
            out = turbo.ops.grouped_gemm(a, b, lens, trans_b=trans_b)
        else:
            out = turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=trans_b, config=fp8_cfg)
        out.backward(grad)
        return out.detach().float(), a.grad.float(), b.grad.float()

    tri, ref = step(BackendType.TRITON), step(BackendType.TORCH)
    for t, r in zip(tri, ref):
        assert _rel(t, r) <= 2e-2
    for gran in ("tensorwise", "rowwise", "blockwise"):
        for fmt in ("e4m3", "hybrid"):
            cfg = Float8QuantConfig(format=fmt, granularity=gran, block_size=128 if gran == "blockwise" else None)
            tri, ref = step(BackendType.TRITON, cfg), step(BackendType.TORCH, cfg)
            for name, t, r in zip(("out", "grad_a", "grad_b"), tri, ref):
                assert torch.isfinite(t).all()
                # same quantisation on both sides: they differ by accumulation order only
                assert _snr(t, r) >= 30, (gran, fmt, name, _snr(t, r))
            assert torch.equal(tri[2][1], torch.zeros_like(tri[2][1]))  # empty expert: zero weight grad
    GlobalBackendManager.reset()


if __name__ == "__main__":
    _CASES[sys.argv[1]]()
    print(f"OK {sys.argv[1]}")


def test_warp_specialised_grouped_config_and_refusals(gluon_off_here):
    """The ninth config field selects the warp-specialised Gluon kernel: validated, never offered
    where it cannot run (no sm_90 GPU, or switched off), a pinned one raises with the reason, and its
    identity carries the kernel's own revision."""
    from turbo_dispatch.backends.triton import configs as C
    from turbo_dispatch.backends.triton.grouped_gemm import TritonGroupedGemmFp8, _check_config
    from turbo_dispatch.low_precision import ScalingGranularity as SG

    ws = (128, 128, 128, 8, 4, 8, 1, 1, C.KERNEL_GLUON_WS)
    assert _check_config(ws) == ws
    with pytest.raises(ValueError, match="kernel=1 must be 0"):
        _check_config(ws[:8] + (1,))
    a, b = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(2, 256, 128, dtype=torch.bfloat16)
    lens, offs = _lens_offs([40, 24])
    e4 = torch.float8_e4m3fn
    p = _fp8_problem(a, b, lens, offs, False, False, torch.bfloat16, e4, e4, SG.BLOCKWISE, 128, True)
    ad = TritonGroupedGemmFp8()
    assert all(len(c) < 9 for c in ad.configs(p._replace(platform="cuda")))
    with pytest.raises(ValueError, match="warp-specialised Gluon kernel, but .*(NVIDIA|sm_90|Gluon|interpreter)"):
        ad.run(p, a, b, lens, offs, config=ws)
    with pytest.raises(ValueError, match="2-D tiles only"):
        ad.run(p._replace(b_2d=False), a, b, lens, offs, config=ws)
    assert "gluon-ws-r" in ad.identity(ws) and "gluon-ws" not in ad.identity(ws[:8])
    assert "gluon-wgrad-r" in ad.identity(ws) and "gluon-wgrad" not in ad.identity(ws[:8])


def test_gluon_entry_points_name_a_tensor_off_the_gpu():
    """The Gluon kernels' public entry points check every tensor's device before Triton's launcher
    sees it: a CPU tensor (or one on another GPU) is named, instead of Triton's "cannot be accessed
    from Triton (cpu tensor?)" after descriptors were built (seen on an H100 host)."""
    from types import SimpleNamespace

    from turbo_dispatch.backends.triton.fp8_blockwise_gluon import device_error

    on = lambda dev: SimpleNamespace(device=torch.device(dev))  # noqa: E731 - devices need no GPU to name
    assert device_error(a=on("cuda:0"), b=on("cuda:0"), sa=on("cuda:0")) is None
    assert device_error(a=on("cuda:0"), sb=on("cpu")) == "sb is on cpu; the Gluon kernels take CUDA tensors only"
    assert "b is on cuda:1 but a on cuda:0" in device_error(a=on("cuda:0"), b=on("cuda:1"))
    assert "a is on meta" in device_error(a=torch.empty(1, device="meta"))


@pytest.mark.gpu
def test_gluon_entry_points_refuse_cpu_tensors_on_a_gpu_host():
    """On an sm_90 GPU each public Gluon entry point names the CPU tensor it was given."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GLK
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
    from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW

    if GLK.available() is not None:
        pytest.skip(GLK.available())
    e4, dev = torch.float8_e4m3fn, "cuda"
    a, b = torch.randn(256, 256, device=dev).to(e4), torch.randn(256, 256, device=dev).to(e4)
    s = torch.ones(2, 2, device=dev)
    cfg = (128, 128, 128, 8, 4, 8)
    with pytest.raises(ValueError, match="fp8_blockwise_gemm: sa is on cpu"):
        GLK.fp8_blockwise_gemm(a, b, s.cpu(), s, torch.bfloat16, (128, 128, 128, 8, 5, 8), b_group=128)
    with pytest.raises(ValueError, match="warp-specialised.*b is on cpu"):
        GWS.fp8_blockwise_gemm(a, b.cpu(), s, s, torch.bfloat16, cfg, b_group=128)
    out, offs = torch.empty(256, 256, device=dev, dtype=torch.bfloat16), torch.tensor([0, 100, 256], device=dev)
    with pytest.raises(ValueError, match="fp8_blockwise_grouped_gemm: offs is on cpu"):
        GWS.fp8_blockwise_grouped_gemm(a, b.view(1, 256, 256), out, offs[:2].cpu(), s, s.stride(), s, (0, 1, 1), cfg)
    x = a.t().contiguous().t()
    with pytest.raises(ValueError, match="fp8_blockwise_wgrad: out is on cpu"):
        GWW.fp8_blockwise_wgrad(x, x, torch.empty(2, 256, 256), offs, s, s.stride(), s, s.stride(), cfg)


def test_warp_specialised_wgrad_config_errors():
    """The warp-specialised wgrad kernel names what it refuses: the tile shape, a K step that
    straddles scale runs, too few stages, more shared memory than an SM has, and (off an sm_90
    GPU) the machine itself, before any operand is touched."""
    from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW

    ok = (128, 128, 128, 8, 5, 8)
    assert GWW.config_error(ok, 128) is None
    assert GWW.config_error((128, 64, 64, 8, 4, 8), 128) is None
    assert GWW.config_error((256, 128, 128, 8, 3, 8), 128) is None
    assert "128 or 256 rows in two math warpgroups" in GWW.config_error((64, 128, 128, 8, 4, 8), 128)
    assert "128 or 256 rows in two math warpgroups" in GWW.config_error((128, 128, 128, 8, 4, 4), 128)
    assert "BLOCK_N must be" in GWW.config_error((128, 256, 128, 8, 4, 8), 128)
    assert "BLOCK_N must be" in GWW.config_error((128, 80, 128, 8, 4, 8), 128)
    assert "dividing the scale block 128" in GWW.config_error((128, 128, 96, 8, 4, 8), 128)
    assert "dividing the scale block 64" in GWW.config_error(ok, 64)
    assert "num_stages must be >= 2" in GWW.config_error((128, 128, 128, 8, 1, 8), 128)
    assert "shared memory" in GWW.config_error((128, 128, 128, 8, 8, 8), 128)
    assert "occupancy must be 1" in GWW.config_error(ok + (2,), 128)
    # 5 stages leave room for the scales and the bf16 staging buffers (TMA stores), 6 do not.
    assert GWW.smem_bytes(ok, 2, True) <= GWW.SMEM_PER_CTA < GWW.smem_bytes(ok[:4] + (6, 8), 2, True)
    e4 = torch.float8_e4m3fn
    x = torch.zeros(256, 64, dtype=e4).t().contiguous().t()  # token-contiguous [T, M]
    y = torch.zeros(256, 32, dtype=e4).t().contiguous().t()
    out = torch.empty(2, 64, 32)
    offs = torch.tensor([0, 100, 256], dtype=torch.int32)
    s = torch.ones(2, 64)
    # Off an sm_90 GPU the machine is named; on one, that these CPU tensors cannot feed the kernel.
    with pytest.raises(ValueError, match="fp8_blockwise_wgrad: .*(NVIDIA|sm_90|Gluon|interpreter|x is on cpu)"):
        GWW.fp8_blockwise_wgrad(x, y, out, offs, s, s.stride(), s, s.stride(), ok)
    with pytest.raises(ValueError, match="offs must have G \\+ 1 = 3 entries"):
        GWW.fp8_blockwise_wgrad(x, y, out, offs[:2], s, s.stride(), s, s.stride(), ok)
    with pytest.raises(ValueError, match="need x \\[T, M\\], y \\[T, N\\], out \\[G, M, N\\]"):
        GWW.fp8_blockwise_wgrad(x, y, out.transpose(1, 2), offs, s, s.stride(), s, s.stride(), ok)


def test_warp_specialised_grouped_candidates_where_it_can_run(monkeypatch):
    """Where the kernel can run (availability stubbed: no sm_90 GPU here), the grouped blockwise
    candidates open with the warp-specialised configs, BK set to the block size: the 256-column
    tile first where N >= 256, only the 128-column one below that, none for 1-D weight scales; the
    wgrad opens with the warp-specialised wgrad kernel's 128-column tiles; a pinned config the
    kernel refuses raises with the reason."""
    from turbo_dispatch.backends.triton import configs as C
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
    from turbo_dispatch.backends.triton import grouped_gemm as GG
    from turbo_dispatch.low_precision import ScalingGranularity as SG

    monkeypatch.setattr(GWS, "available", lambda device_index=None: None)
    e4 = torch.float8_e4m3fn
    lens, offs = _lens_offs([40, 24])

    def problem(n, b_2d=True):
        a, b = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(2, 256, n, dtype=torch.bfloat16)
        p = _fp8_problem(a, b, lens, offs, False, False, torch.bfloat16, e4, e4, SG.BLOCKWISE, 128, b_2d)
        return p._replace(platform="cuda")

    wide = GG._fp8_configs(problem(512))
    ws = [c for c in wide if len(c) == 9]
    assert wide[:len(ws)] == ws and [c[:2] for c in ws] == [(128, 256), (128, 256), (128, 128)], wide
    assert all(c[2] == 128 and c[8] == C.KERNEL_GLUON_WS for c in ws)
    assert [c[:2] for c in GG._fp8_configs(problem(128)) if len(c) == 9] == [(128, 128)]
    wgrad = GG._fp8_configs(problem(512)._replace(variable_k=True))
    wgrad_ws = [c for c in wgrad if len(c) == 9]
    assert wgrad[:len(wgrad_ws)] == wgrad_ws and list(wgrad_ws) == list(GG.WGRAD_WS_CONFIGS), wgrad
    # 1-D weight scales do not matter to the wgrad, whose operands are both 1-D runs.
    assert GG._ws_refusal(problem(512, b_2d=False)._replace(variable_k=True), wgrad_ws[0]) is None
    wgrad_text = GG.TritonGroupedGemmFp8().describe(problem(512)._replace(variable_k=True))
    assert "warp-specialised Gluon variable-K" in wgrad_text
    wide_wgrad = wgrad_ws[0][:1] + (256,) + wgrad_ws[0][2:]
    assert "BLOCK_N must be" in GG._ws_refusal(problem(512)._replace(variable_k=True), wide_wgrad)
    assert not [c for c in GG._fp8_configs(problem(512, b_2d=False)) if len(c) == 9]
    assert "BK=64 must equal block_size=128" in GG._ws_refusal(problem(512), ws[0][:2] + (64,) + ws[0][3:])
    assert GG._ws_refusal(problem(512), ws[0]) is None


def test_fp8_candidates_follow_the_kernel_switch_each_call(monkeypatch):
    """The candidate list is built once per problem, but whether the warp-specialised kernel can
    run is asked on every call: a kernel that stops being available (its env switch turned off,
    say) leaves the next call's list, and comes back when it is available again. Each call gets
    its own list, so a caller editing it changes nothing for the next."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
    from turbo_dispatch.backends.triton import grouped_gemm as GG
    from turbo_dispatch.low_precision import ScalingGranularity as SG

    e4 = torch.float8_e4m3fn
    lens, offs = _lens_offs([40, 24])
    a, b = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(2, 256, 512, dtype=torch.bfloat16)
    p = _fp8_problem(a, b, lens, offs, False, False, torch.bfloat16, e4, e4, SG.BLOCKWISE, 128, True)
    p = p._replace(platform="cuda")
    monkeypatch.setattr(GWS, "available", lambda device_index=None: None)
    with_ws = GG._fp8_configs(p)
    assert GG._is_ws(with_ws[0])
    monkeypatch.setattr(GWS, "available", lambda device_index=None: "switched off")
    without = GG._fp8_configs(p)
    assert without == [c for c in with_ws if not GG._is_ws(c)] and not GG._is_ws(without[0])
    without.clear()
    assert GG._fp8_configs(p) == [c for c in with_ws if not GG._is_ws(c)]
    monkeypatch.setattr(GWS, "available", lambda device_index=None: None)
    assert GG._fp8_configs(p) == with_ws


def test_default_config_falls_back_for_operands_tma_cannot_take(monkeypatch):
    """An unpinned call whose default is the warp-specialised kernel takes the first Triton config
    when the operands cannot feed TMA: a token-major wgrad operand (``quantize(x, axis=0)``'s
    layout), a weight that is not K-major; TMA-legal operands keep the default."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
    from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW
    from turbo_dispatch.backends.triton import grouped_gemm as GG
    from turbo_dispatch.low_precision import ScalingGranularity as SG
    from turbo_dispatch.low_precision.dual_quantize import empty_padded_rows

    monkeypatch.setattr(GWS, "available", lambda device_index=None: None)
    e4 = torch.float8_e4m3fn
    lens, offs = _lens_offs([40, 24])
    a, b = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(2, 256, 512, dtype=torch.bfloat16)
    p = _fp8_problem(a, b, lens, offs, False, False, torch.bfloat16, e4, e4, SG.BLOCKWISE, 128, True)
    wgrad = p._replace(platform="cuda", variable_k=True)
    default = GG._fp8_configs(wgrad)[0]
    assert GG._is_ws(default)
    token_major = torch.empty(64, 256, dtype=e4)  # [T, M] with the columns contiguous
    token_contiguous = empty_padded_rows(token_major, (256, 64), e4).t()
    why = GWW.operands_error(token_major, token_contiguous)
    assert why and "x must be token-contiguous" in why
    assert GWW.operands_error(token_contiguous, token_contiguous) is None
    fallback = GG._default_for_operands(wgrad, default, why)
    assert not GG._is_ws(fallback) and fallback == [c for c in GG._fp8_configs(wgrad) if not GG._is_ws(c)][0]
    assert GG._default_for_operands(wgrad, default, None) == default
    qa = empty_padded_rows(token_major, (64, 256), e4)
    n_major = torch.empty(2, 256, 512, dtype=e4).transpose(1, 2)  # [G, N, K] with N contiguous
    assert "b_gnk must be K-major" in GWS.grouped_operands_error(qa, n_major)
    assert GWS.grouped_operands_error(qa, torch.empty(2, 512, 256, dtype=e4)) is None


def test_pinned_ws_config_is_checked_once_and_launched_directly(monkeypatch):
    """A pinned (or tuned) warp-specialised config is checked by the adapter itself (machine,
    config, then the operands) and launched through ``launch_grouped`` / ``launch_wgrad``, not
    through the public wrappers, which would check all of it again on every call. Operands its
    TMA loads cannot take raise the kernel's reason before anything is launched."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
    from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW
    from turbo_dispatch.backends.triton import grouped_gemm as GG
    from turbo_dispatch.low_precision import ScalingGranularity as SG
    from turbo_dispatch.low_precision import quantize

    monkeypatch.setattr(GWS, "available", lambda device_index=None: None)
    launched = []

    def recorder(name):
        def launch(*args, **kwargs):
            launched.append((name, kwargs))
            return args[2]
        return launch

    def wrapper(*args, **kwargs):
        raise AssertionError("the public wrapper repeats the adapter's checks")

    monkeypatch.setattr(GWS, "launch_grouped", recorder("forward"))
    monkeypatch.setattr(GWW, "launch_wgrad", recorder("wgrad"))
    monkeypatch.setattr(GWS, "fp8_blockwise_grouped_gemm", wrapper)
    monkeypatch.setattr(GWW, "fp8_blockwise_wgrad", wrapper)
    e4 = torch.float8_e4m3fn
    lens, offs = _lens_offs([40, 24])
    adapter = GG.TritonGroupedGemmFp8()

    x = torch.randn(64, 256, dtype=torch.bfloat16)
    w = torch.randn(2, 512, 256, dtype=torch.bfloat16)  # [G, N, K], the nn.Linear layout
    qx = quantize(x, e4, SG.BLOCKWISE, axis=1, block_size=128)
    qw = quantize(w, e4, SG.BLOCKWISE, block_size=128, block_2d=True)
    p = _fp8_problem(qx, qw, lens, offs, True, False, torch.bfloat16, e4, e4, SG.BLOCKWISE, 128, True)
    p = p._replace(platform="cuda")
    pinned = next(c for c in GG._fp8_configs(p) if GG._is_ws(c))
    out = adapter.run(p, qx, qw, lens, offs, config=pinned)
    assert out.shape == (64, 512) and launched == [("forward", {"b_group": 128})]

    # The wgrad's operands as the dual quantiser stores them (token-contiguous) launch directly;
    # token-major ones (quantize(v, axis=0)'s layout) are refused with the kernel's reason.
    t, m, n = 64, 128, 256
    token_major = [quantize(torch.randn(t, c, dtype=torch.bfloat16), e4, SG.BLOCKWISE, axis=0, block_size=128)
                   for c in (m, n)]
    wp = _fp8_problem(*token_major, lens, offs, False, True, torch.bfloat16, e4, e4, SG.BLOCKWISE, 128, False)
    wp = wp._replace(platform="cuda")
    wgrad_cfg = GG.WGRAD_WS_CONFIGS[0]
    launched.clear()
    with pytest.raises(ValueError, match="warp-specialised Gluon kernel, but .*token-contiguous"):
        adapter.run(wp, *token_major, lens, offs, config=wgrad_cfg)
    assert launched == []
    # the same values, stored token-contiguous (16-byte aligned rows of the [C, T] storage)
    contiguous = [dataclasses.replace(q, data=q.data.t().contiguous().t()) for q in token_major]
    out = adapter.run(wp, *contiguous, lens, offs, config=wgrad_cfg)
    assert out.shape == (2, m, n) and launched == [("wgrad", {"qblock": 128})]


@pytest.mark.gpu
def test_gpu_default_wgrad_takes_token_major_quantized_operands():
    """Hand-made token-major QuantizedTensors (``quantize(x, axis=0)``: runs along the tokens, the
    columns contiguous) given to the wgrad with no config pinned: the default warp-specialised
    kernel cannot load them through TMA, so the first Triton config serves them, giving exactly
    what that config gives when pinned, close to float64; pinning the WS config raises why."""
    from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW
    from turbo_dispatch.backends.triton import grouped_gemm as GG
    from turbo_dispatch.low_precision import ScalingGranularity as SG
    from turbo_dispatch.low_precision import quantize

    if GWW.available():
        pytest.skip(GWW.available())
    e4 = torch.float8_e4m3fn
    lens_l = [130, 0, 77, 300]
    lens, offs = _lens_offs(lens_l, "cuda")
    t, m, n = sum(lens_l), 256, 384
    x = torch.randn(t, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    qx, qy = (quantize(v, e4, "blockwise", axis=0, block_size=128) for v in (x, y))
    assert qx.data.stride(1) == 1  # token-major: not what TMA can load token-contiguously
    p = _fp8_problem(qx, qy, lens, offs, False, True, torch.bfloat16, e4, e4, SG.BLOCKWISE, 128, False)
    adapter = GG.TritonGroupedGemmFp8()
    cfgs = list(adapter.configs(p))
    assert GG._is_ws(cfgs[0])
    out = adapter.run(p, qx, qy, lens, offs)
    first_triton = next(c for c in cfgs if not GG._is_ws(c))
    assert torch.equal(out, adapter.run(p, qx, qy, lens, offs, config=first_triton))
    deq = [(q.data.double() * q.scale.double().repeat_interleave(128, dim=0)[:t]) for q in (qx, qy)]
    ref = _reference(deq[0], deq[1], lens.cpu(), False, True)
    for i, cnt in enumerate(lens_l):
        if cnt == 0:
            assert torch.equal(out[i].cpu(), torch.zeros(m, n, dtype=out.dtype))
        else:
            assert _rel(out[i].cpu(), ref[i]) <= 8e-3, (i, _rel(out[i].cpu(), ref[i]))
    with pytest.raises(ValueError, match="token-contiguous"):
        adapter.run(p, qx, qy, lens, offs, config=cfgs[0])


def test_gluon_dual_quantizer_says_why_it_cannot_run():
    from turbo_dispatch.backends.triton import dual_quantize_gluon as DG

    x = torch.randn(1, 8, 256, dtype=torch.bfloat16)
    assert "block 128" in DG.available(x, 64)
    assert "bfloat16 or float16" in DG.available(x.float(), 128)
    assert "CUDA tensor" in DG.available(x, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("kernel", ["triton", "gluon"])
def test_gpu_dual_quantizer_matches_quantize_cells(fmt, kernel):
    """Every GPU path of ``dual_quantize`` (the Triton kernel with its FMA-corrected quotient; the
    Gluon kernels at block 128: the runs kernel with its branch-free row and once-per-tile column
    quotients, the register tiles kernel with its branch-free quotient) against ``quantize_cells``
    (one correctly rounded division per element), bit for bit: token runs and 2-D tiles, blocks
    128 and 64, with zero cells, signed zeros, subnormal-sized cells (the rescaled quotient),
    small cells that take the rescaled quotient without being subnormal, inf, NaN and values
    near the top of the format, at ragged sizes."""
    import turbo_dispatch.backends.triton.dual_quantize as DQ
    from turbo_dispatch.backends.triton import dual_quantize_gluon as DG
    from turbo_dispatch.backends.triton.grouped_quantize import quantize_cells

    if kernel != "triton" and DG.available(torch.empty(1, device="cuda", dtype=torch.bfloat16), 128):
        pytest.skip(DG.available(torch.empty(1, device="cuda", dtype=torch.bfloat16), 128))
    torch.manual_seed(3)
    x = torch.randn(3, 1000, 320, device="cuda", dtype=torch.bfloat16) * 7
    x[0, :, 128:256] = 0
    x[1, 517, 3] = float("nan")
    x[2, 0:128, 0:128] *= 1e-38
    x[2, 200:300, :] = -0.0
    x[1, 300:400, 200:300] *= -1e-30  # small, not subnormal: scales around 1e-32, rescaled
    x[2, 900, 290] = float("inf")
    x[0, 700:800, 40:60] *= 3e37

    def same(a, b):
        if a.element_size() == 1:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return torch.equal(torch.nan_to_num(a, nan=-1.0), torch.nan_to_num(b, nan=-1.0))

    gluon = kernel != "triton"
    for block in (128, 64):
        d, s, d_t, s_t = DQ.dual_quantize(x, fmt, block, False, gluon=gluon)
        r, rs = quantize_cells(x, fmt, 1, block)
        c, cs = quantize_cells(x.transpose(1, 2), fmt, 1, block, scale_rows_inner=True)
        assert same(d, r) and same(s, rs) and same(d_t, c) and same(s_t.transpose(1, 2), cs), block
        w = x.transpose(1, 2)
        d, s, d_t, s_t = DQ.dual_quantize(w, fmt, block, True, gluon=gluon)
        q, qs = quantize_cells(w, fmt, block, block)
        qt, _ = quantize_cells(w.transpose(1, 2), fmt, block, block)
        assert same(d, q) and same(s, qs) and same(d_t, qt), block


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_gpu_gluon_dual_quantizer_matches_triton_bit_for_bit(fmt):
    """The Gluon quantisers give the Triton kernel's bits (which the interpreter checks against
    the reference quantize): token runs (the runs kernel) and 2-D tiles (the tiles kernel) at
    ragged rows and columns, strided rows, zero, NaN, inf, subnormal-sized and near-overflow
    cells, groups."""
    import turbo_dispatch.backends.triton.dual_quantize as DQ
    from turbo_dispatch.backends.triton import dual_quantize_gluon as DG

    if DG.available(torch.empty(1, device="cuda", dtype=torch.bfloat16), 128):
        pytest.skip(DG.available(torch.empty(1, device="cuda", dtype=torch.bfloat16), 128))
    big = torch.randn(3, 1000, 310, device="cuda", dtype=torch.bfloat16) * 7
    x = big[:, :, 3:303]  # 300 columns: a ragged last block, rows strided by 310
    x[0, :, 128:256] = 0
    x[1, 517, 3] = float("nan")
    x[2, 0:128, 0:128] *= 1e-38
    x[2, 200:300, :] = -0.0
    x[2, 900, 290] = float("inf")
    x[0, 700:800, 40:60] *= 3e37
    x[1, 300:400, 200:300] *= -1e-30
    # contiguous rows whose count is a multiple of 16: vector loads and 16-byte transposed stores
    # together (a step once found a mismatch there that no ragged or strided operand had shown)
    even = torch.randn(2, 256, 384, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for gluon in (True, False):
        outs[gluon] = ()
        for src in (x, even):
            outs[gluon] += (DQ.dual_quantize(src, fmt, 128, False, gluon=gluon)
                            + DQ.dual_quantize(src, fmt, 128, True, gluon=gluon))
    for a, b in zip(outs[True], outs[False], strict=True):
        if a.dtype.is_floating_point and a.element_size() == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(torch.nan_to_num(a.float(), nan=-1.0), torch.nan_to_num(b.float(), nan=-1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("spans", [(8,), (4,), (2,)])
def test_gpu_runs_kernel_strips_match_triton_bit_for_bit(spans, monkeypatch):
    """The persistent TMA runs kernel with its row scales written a strip at a time (forced at
    each width, whatever the operand's size) gives the Triton kernel's bits: ragged rows and a
    ragged last column block (23 blocks: a part-filled last strip), two groups, NaN, inf, zero
    and subnormal-sized cells; the row scales keep their 16-float row padding."""
    import turbo_dispatch.backends.triton.dual_quantize as DQ
    from turbo_dispatch.backends.triton import dual_quantize_gluon as DG

    if DG.available(torch.empty(1, device="cuda", dtype=torch.bfloat16), 128):
        pytest.skip(DG.available(torch.empty(1, device="cuda", dtype=torch.bfloat16), 128))
    x = torch.randn(2, 1000 + 77, 2880, device="cuda", dtype=torch.bfloat16) * 5
    x[0, 3, 7] = float("nan")
    x[1, 600, 2879] = float("inf")
    x[1, 0:128, 0:256] = 0
    x[0, 256:384, 1024:1152] *= 1e-38
    monkeypatch.setattr(DG, "RUNS_SPANS", spans)
    monkeypatch.setattr(DG, "RUNS_MIN_UNITS", 0)
    got = DQ.dual_quantize(x, torch.float8_e4m3fn, 128, False)
    assert DG._span(got[1], 1, 1) == spans[0]  # the strips ran (x is TMA-readable)
    want = DQ.dual_quantize(x, torch.float8_e4m3fn, 128, False, gluon=False)
    assert got[1].stride(1) % 16 == 0
    for a, b in zip(got, want, strict=True):
        if a.element_size() == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(torch.nan_to_num(a.float(), nan=-1.0), torch.nan_to_num(b.float(), nan=-1.0))


@pytest.mark.gpu
@pytest.mark.parametrize("tile_2d", [True, False], ids=["tiles", "runs"])
def test_gpu_dual_quantizer_float32_matches_reference(tile_2d):
    """float32 inputs take the Triton dual kernel (the Gluon ones read 16-bit floats): both copies
    and both scale sets equal the reference quantisation's (two quantize calls on the CPU). Its
    transposed store of float32 2-D tiles had every fourth row wrong on an H100; a
    float32 weight's transposed copy is now torch's copy of its row copy."""
    from turbo_dispatch.low_precision.dual_quantize import quantize_both_tensors
    from turbo_dispatch.backends.triton.dual_quantize import dual_quantize

    # (No NaN cell: the CPU reference and the GPU encode fp8 NaNs differently; the GPU kernels'
    # NaN handling is compared GPU to GPU in test_gpu_gluon_dual_quantizer_matches_triton_bit_for_bit.)
    x = torch.randn(3, 256 + 77, 384 + 32, device="cuda") * 3
    x[0, 0:128, 0:128] = 0
    got = dual_quantize(x, torch.float8_e4m3fn, 128, tile_2d)
    want = quantize_both_tensors(x.cpu(), torch.float8_e4m3fn, 128, tile_2d)
    for a, b in zip(got, want, strict=True):
        a = a.cpu()
        if a.element_size() == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_side_by_side_quantisers_match_serial():
    """The step's activation and weight quantisers on two streams (``side_by_side``) give the bits
    of the two run one after the other, ready on the current stream without a host sync."""
    from turbo_dispatch.low_precision.dual_quantize import quantize_runs_both, quantize_tiles_both
    from turbo_dispatch.low_precision.side_streams import side_by_side

    a = torch.randn(5000 + 3, 384, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3, 256, 384, device="cuda", dtype=torch.bfloat16)
    e4 = torch.float8_e4m3fn
    serial = quantize_runs_both(a, e4, 128) + quantize_tiles_both(b, e4, 128)
    runs, tiles = side_by_side(lambda: quantize_runs_both(a, e4, 128), lambda: quantize_tiles_both(b, e4, 128),
                               a.device)
    for got, want in zip(runs + tiles, serial, strict=True):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)


class _FakeStream:
    """Stands in for a CUDA stream in ``_wait_for_callers``: records what it waited on."""

    def __init__(self, name: str, stream_id: int = 0):
        self.name, self.waited, self.stream_id = name, [], stream_id or id(self)

    def wait_stream(self, other: "_FakeStream") -> None:
        self.waited.append(other.name)


def test_side_stream_waits_for_every_earlier_caller(monkeypatch):
    """``side_by_side`` does not ``record_stream`` its side outputs, so a fork must make the side
    stream wait for the current stream and for every stream an earlier fork on the device came
    from (a freed side output's block is handed out again inside a fork); while capturing, for the
    current stream only."""
    from turbo_dispatch.low_precision import side_streams

    monkeypatch.setattr(side_streams, "_FORK_CALLERS", {})
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    s1, s3, side = _FakeStream("s1"), _FakeStream("s3"), _FakeStream("side")
    side_streams._wait_for_callers(side, s1, 0)
    side_streams._wait_for_callers(side, s1, 0)
    assert side.waited == ["s1", "s1"]
    side.waited.clear()
    side_streams._wait_for_callers(side, s3, 0)
    assert side.waited == ["s3", "s1"]
    side.waited.clear()
    side_streams._wait_for_callers(side, s1, 1)  # another device keeps its own callers
    assert side.waited == ["s1"]
    side.waited.clear()
    capturing[0] = True
    graph = _FakeStream("capture")
    side_streams._wait_for_callers(side, graph, 0)
    assert side.waited == ["capture"] and list(side_streams._FORK_CALLERS[0].values()) == [s1, s3]


def test_eager_side_by_side_queues_the_same_waits_through_torchs_c_calls(monkeypatch):
    """The eager fast path of ``side_by_side``: the side stream waits for the current stream and
    every earlier caller before ``second`` runs on it, the current stream is back for ``first``
    (also after ``second`` raised), and the current stream waits for the side stream at the end;
    the two events per device are recorded again on each call."""
    from turbo_dispatch.low_precision import side_streams

    log = []

    class Stream:
        def __init__(self, stream_id, device_index, device_type):
            self.stream_id, self.device_index, self.device_type = stream_id, device_index, device_type

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.name = ("fork", "join")[(Event.made - 1) % 2]

    class EventBase:
        @staticmethod
        def record(event, stream):
            log.append(("record", event.name, stream.stream_id))

        @staticmethod
        def wait(event, stream):
            log.append(("wait", event.name, stream.stream_id))

    current = [11]
    side = Stream(99, 0, 1)
    monkeypatch.setattr(side_streams, "_FORK_CALLERS", {})
    monkeypatch.setattr(side_streams, "_STREAMS", {})
    monkeypatch.setattr(side_streams, "_EVENTS", __import__("threading").local())
    monkeypatch.setattr(side_streams, "_side_stream", lambda index: side)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch._C, "_CudaEventBase", EventBase, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: (current[0], index, 1), raising=False)

    def set_stream(stream_id, device_index, device_type):
        log.append(("set", stream_id))
        current[0] = stream_id
    monkeypatch.setattr(torch._C, "_cuda_setStream", set_stream, raising=False)

    def work(name):
        return lambda: log.append((name, current[0])) or name

    assert side_streams._eager_side_by_side(work("first"), work("second"), 0) == ("first", "second")
    assert log == [("record", "fork", 11), ("wait", "fork", 99), ("set", 99), ("second", 99), ("set", 11),
                   ("first", 11), ("record", "join", 99), ("wait", "join", 11)]
    log.clear()
    current[0] = 12  # a caller on another stream: the side stream also waits for the earlier one
    side_streams._eager_side_by_side(work("first"), work("second"), 0)
    assert log[:4] == [("record", "fork", 12), ("wait", "fork", 99), ("record", "fork", 11), ("wait", "fork", 99)]
    assert Event.made == 2  # one pair per device and thread, recorded again
    log.clear()

    def fails():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        side_streams._eager_side_by_side(work("first"), fails, 0)
    assert current[0] == 12 and log[-1] == ("set", 12)


@pytest.mark.gpu
def test_gpu_side_output_block_reused_after_the_caller_switched_streams():
    """A side output freed while its caller's stream still reads it, its block handed out again by
    a fork from another stream: the new fork's side work waits for the old caller's read (the
    ``record_stream`` the fork no longer makes is not needed). The read sits behind a GPU spin, so
    without the wait the second fork's fill lands first."""
    from turbo_dispatch.low_precision.side_streams import side_by_side

    dev, n = torch.device("cuda"), 1 << 20
    s1, s3 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        _, out = side_by_side(lambda: None, lambda: torch.full((n,), 1.0, device=dev), dev)
        ptr = out.data_ptr()
        torch.cuda._sleep(100_000_000)
        kept = out.clone()
        del out
    with torch.cuda.stream(s3):
        _, again = side_by_side(lambda: None, lambda: torch.full((n,), 2.0, device=dev), dev)
    torch.cuda.synchronize()
    if again.data_ptr() != ptr:
        pytest.skip("the caching allocator did not hand the freed side block out again")
    assert torch.all(kept == 1.0) and torch.all(again == 2.0)


@pytest.mark.gpu
def test_gpu_tma_launch_as_first_cuda_work_of_a_fresh_thread():
    """A thread whose first CUDA work is a TMA launch, as the autograd engine's backward thread
    when a TMA kernel opens its backward: Triton encodes the descriptor before its launcher binds
    a context, which failed with "invalid device context" until ``bind_cuda_context`` (H100).
    The token-run quantiser's TMA form is that launch here; its bits must match the
    main thread's."""
    import threading

    import turbo_dispatch.backends.triton.dual_quantize as DQ
    from turbo_dispatch.backends.triton import dual_quantize_gluon as DG

    x = torch.randn(1, 512, 384, device="cuda", dtype=torch.bfloat16) * 5
    if DG.available(x, 128):
        pytest.skip(DG.available(x, 128))
    ref = DQ.dual_quantize(x, torch.float8_e4m3fn, 128, False)
    spare = DQ.dual_quantize(x, torch.float8_e4m3fn, 128, False)
    del spare  # its blocks stay cached: the thread allocates without a cudaMalloc, which binds a context
    torch.cuda.synchronize()
    got, errors = [], []

    def first_cuda_work():
        try:
            got.extend(DQ.dual_quantize(x, torch.float8_e4m3fn, 128, False))
            torch.cuda.synchronize()
        except Exception as exc:  # reported below with the thread's error
            errors.append(exc)

    worker = threading.Thread(target=first_cuda_work)
    worker.start()
    worker.join()
    assert not errors, errors
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
