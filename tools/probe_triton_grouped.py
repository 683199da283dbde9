"""GPU probe of the TRITON grouped GEMMs: correctness and TFLOPS vs torch._grouped_mm /
torch._scaled_grouped_mm on DeepSeek-V3 and Mixtral expert shapes with balanced, skewed and
empty-expert routings. Usage (repo installed): ``python3 tools/probe_triton_grouped.py [--quick]``.
Prints one line per measurement; ``--out FILE`` also writes them as JSON lines.

``--occupancy`` times every blockwise fixed-K config (the occupancy > 1 ones included: two
persistent programs of a 4-warp tile per SM) end to end and kernel only, then the whole op.

``--wgrad`` probes the variable-K (wgrad) kernel alone: correctness against a float32 reference
(odd shapes and routings, every layout path, each fp8 granularity), then TFLOPS of the previous
kernel (gg-r2, kept below as ``_old_variable_k_kernel`` for the comparison), the current one and
torch's (``torch._grouped_mm`` bf16, ``torch._scaled_grouped_mm`` fp8 rowwise) on the DeepSeek-V3
and Mixtral wgrads, and the whole blockwise-fp8 grouped op (fwd + dgrad + wgrad, quantisation
included) against the bf16 op on torch._grouped_mm.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch
import triton
import triton.language as tl
import triton.testing

from turbo_dispatch.backends.torch.grouped_gemm import TorchGroupedGemm, TorchGroupedGemmFp8
from turbo_dispatch.backends.triton import grouped_gemm as tgg
from turbo_dispatch.backends.triton.grouped_kernels import _tile_coords
from turbo_dispatch.low_precision import ScalingGranularity as SG
from turbo_dispatch.ops.grouped_gemm import grouped_gemm_fp8_problem, grouped_gemm_problem, variable_k_problem

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
ROWS: list[dict] = []
OUT_FILE: list = []  # the open --out file, written line by line (a timed-out run keeps what it measured)


def emit(**kw):
    ROWS.append(kw)
    if OUT_FILE:
        OUT_FILE[0].write(json.dumps(kw, default=str) + "\n")
        OUT_FILE[0].flush()
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)


def bench(fn) -> float:
    if DEV == "cpu":  # --cpu-smoke: run once, no timing
        fn()
        return 1.0
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def routing(kind: str, total: int, g: int) -> list[int]:
    if kind == "balanced":
        lens = [total // g] * g
    elif kind == "skewed":
        w = [0.5 ** i for i in range(g)]
        lens = [int(total * x / sum(w)) for x in w]
    elif kind == "empty":  # two experts get nothing
        lens = [total // (g - 2)] * (g - 2) + [0, 0]
    else:
        raise ValueError(kind)
    lens[0] += total - sum(lens)
    return lens


def bench_routing(kind: str, total: int, g: int) -> list[int]:
    """The EP bench's routing ``kind`` (``benchmarks/bench_grouped_gemm.group_lens``, seeded)."""
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    from bench_grouped_gemm import group_lens

    torch.manual_seed(0)
    return group_lens(kind, g, total, "cpu").tolist()


DEV = "cuda"  # "cpu" for --cpu-smoke


def lens_offs(lens):
    t = torch.tensor(lens, dtype=torch.int64, device=DEV)
    return t, torch.nn.functional.pad(torch.cumsum(t, 0), (1, 0))


def rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def snr(out, ref):
    err = (out.double() - ref.double()).norm() ** 2
    return (10 * torch.log10(ref.double().norm() ** 2 / err)).item()


SHAPES = {  # name: (G, tokens, N, K) of the forward GEMM
    "dsv3_up": (8, 32768, 4096, 7168),
    "dsv3_down": (8, 32768, 7168, 2048),
    "mixtral_up": (8, 16384, 28672, 4096),
    "mixtral_down": (8, 16384, 4096, 14336),
}


def probe_bf16(shape, kind, sweep):
    g, t, n, k = SHAPES[shape]
    lens, offs = lens_offs(routing(kind, t, g))
    a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    grad = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    tri, tor = tgg.TritonGroupedGemm(), TorchGroupedGemm()
    cases = {
        "fwd": (grouped_gemm_problem(a, w, lens, offs, True), a, w),
        "dgrad": (grouped_gemm_problem(grad, w, lens, offs, False), grad, w),
        "wgrad": (variable_k_problem(grad, a, lens, offs), grad, a),
    }
    for name, (p, x, y) in cases.items():
        flops = 2.0 * t * n * k
        ref = tor.run(p, x, y, lens, offs)
        t_ref = bench(lambda: tor.run(p, x, y, lens, offs))
        emit(dtype="bf16", shape=shape, routing=kind, gemm=name, impl="torch._grouped_mm", ms=t_ref,
             tflops=flops / t_ref * 1e-9)
        for cfg in (tri.configs(p) if sweep else [None]):
            try:
                out = tri.run(p, x, y, lens, offs, config=cfg)
                err = rel(out, ref)
                tm = bench(lambda: tri.run(p, x, y, lens, offs, config=cfg))
                emit(dtype="bf16", shape=shape, routing=kind, gemm=name, impl=f"triton{cfg or ''}", ms=tm,
                     tflops=flops / tm * 1e-9, speedup=t_ref / tm, rel_vs_torch=f"{err:.2e}",
                     ok=err < 2e-2)
            except Exception as exc:  # noqa: BLE001 - report and go on
                emit(dtype="bf16", shape=shape, routing=kind, gemm=name, impl=f"triton{cfg}", error=repr(exc)[:300])


def probe_fp8(shape, kind, gran, sweep, gemms=("fwd",)):
    g, t, n, k = SHAPES[shape]
    lens, offs = lens_offs(routing(kind, t, g))
    a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    grad = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    bs = 128 if gran is SG.BLOCKWISE else None
    b2d = gran is SG.BLOCKWISE
    tri, tor = tgg.TritonGroupedGemmFp8(), TorchGroupedGemmFp8()
    flops = 2.0 * t * n * k
    for gemm in gemms:
        if gemm == "fwd":
            p = grouped_gemm_fp8_problem(a, w, lens, offs, True, False, torch.bfloat16, E4, E4, gran, bs, b2d)
            x, y = a, w
        elif gemm == "dgrad_hybrid":
            p = grouped_gemm_fp8_problem(grad, w, lens, offs, False, False, torch.bfloat16, E5, E4, gran, bs, b2d)
            x, y = grad, w
        else:  # wgrad, e4m3
            p = grouped_gemm_fp8_problem(grad, a, lens, offs, False, True, torch.bfloat16, E4, E4, gran, bs, False)
            x, y = grad, a
        ref = tor.run(p, x, y, lens, offs)
        t_ref = bench(lambda: tor.run(p, x, y, lens, offs))
        emit(dtype="fp8", gran=gran.value, shape=shape, routing=kind, gemm=gemm, impl="TORCH adapter (quant+gemm)",
             ms=t_ref, tflops=flops / t_ref * 1e-9, path=tor.describe(p)[:60])
        for cfg in (tri.configs(p) if sweep else [None]):
            try:
                out = tri.run(p, x, y, lens, offs, config=cfg)
                s = snr(out, ref)
                tm = bench(lambda: tri.run(p, x, y, lens, offs, config=cfg))
                emit(dtype="fp8", gran=gran.value, shape=shape, routing=kind, gemm=gemm, impl=f"triton{cfg or ''}",
                     ms=tm, tflops=flops / tm * 1e-9, speedup=t_ref / tm, snr_vs_torch=s, ok=s > 30)
            except Exception as exc:  # noqa: BLE001
                emit(dtype="fp8", gran=gran.value, shape=shape, gemm=gemm, impl=f"triton{cfg}", error=repr(exc)[:300])
        if gemm == "fwd":
            probe_fp8_kernel_only(p, a, w, lens, offs, gran, shape, kind, flops)


def probe_fp8_kernel_only(p, a, w, lens, offs, gran, shape, kind, flops):
    """GEMM kernel alone on pre-quantised operands (Triton vs torch._scaled_grouped_mm)."""
    bs = p.block_size
    qa, sa = tgg._quant_rows(a.unsqueeze(0), E4, gran, bs)
    qb, sb = tgg._quant_rows(w, E4, gran, bs, tile_2d=p.b_2d)
    out = torch.empty(a.shape[0], w.shape[1], device="cuda", dtype=torch.bfloat16)
    mode = tgg._SCALE_MODE[gran]
    sas, sbs = ((0, 0), (0, 0, 0)) if mode == 1 else ((sa.stride(1), sa.stride(2)), sb.stride())
    for cfg in tgg._fp8_configs(p):
        try:
            fn = lambda: tgg.launch_fixed_k(qa[0], qb, out, offs, cfg, scale=mode, sa=sa, sa_strides=sas, sb=sb,  # noqa: E731
                                           sb_strides=sbs, qblock=bs or 128, sb_ndiv=bs if p.b_2d else 1)
            tm = bench(fn)
            emit(dtype="fp8", gran=gran.value, shape=shape, routing=kind, gemm="fwd", impl=f"triton-kernel-only{cfg}",
                 ms=tm, tflops=flops / tm * 1e-9)
        except Exception as exc:  # noqa: BLE001
            emit(dtype="fp8", gran=gran.value, shape=shape, impl=f"triton-kernel-only{cfg}", error=repr(exc)[:300])
    t_q = bench(lambda: (tgg._quant_rows(a.unsqueeze(0), E4, gran, bs),
                         tgg._quant_rows(w, E4, gran, bs, tile_2d=p.b_2d)))
    emit(dtype="fp8", gran=gran.value, shape=shape, impl="triton-quantize(a+w)", ms=t_q)
    if gran in (SG.ROWWISE, SG.TENSORWISE) and hasattr(torch, "_scaled_grouped_mm"):
        from turbo_dispatch.low_precision import quantize

        qa2 = quantize(a, E4, gran, axis=1)
        qb2 = quantize(w, E4, gran, axis=2)
        m = a.shape[0]
        s_a = qa2.scale.reshape(m) if gran is SG.ROWWISE else qa2.scale.reshape(1).expand(m).contiguous()
        s_b = qb2.scale.reshape(w.shape[0], w.shape[1]) if gran is SG.ROWWISE else \
            qb2.scale.reshape(1, 1).expand(w.shape[0], w.shape[1]).contiguous()
        ends = offs[1:].to(torch.int32)
        try:
            fn = lambda: torch._scaled_grouped_mm(qa2.data, qb2.data.transpose(1, 2), s_a, s_b, offs=ends,  # noqa: E731
                                                  out_dtype=torch.bfloat16)
            tm = bench(fn)
            emit(dtype="fp8", gran=gran.value, shape=shape, routing=kind, gemm="fwd",
                 impl="torch._scaled_grouped_mm-kernel-only", ms=tm, tflops=flops / tm * 1e-9)
            t_q2 = bench(lambda: (quantize(a, E4, gran, axis=1), quantize(w, E4, gran, axis=2)))
            emit(dtype="fp8", gran=gran.value, shape=shape, impl="torch-quantize(a+w)", ms=t_q2)
        except Exception as exc:  # noqa: BLE001
            emit(impl="torch._scaled_grouped_mm", error=repr(exc)[:300])


def probe_mixed_mma():
    """Does tl.dot take e5m2 x e4m3 directly on this Triton? (else the fp16 route is used)"""
    g, t, n, k = 8, 8192, 2048, 2048
    lens, offs = lens_offs(routing("balanced", t, g))
    grad = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    for gran in (SG.ROWWISE, SG.BLOCKWISE):
        bs = 128 if gran is SG.BLOCKWISE else None
        p = grouped_gemm_fp8_problem(grad, w, lens, offs, False, False, torch.bfloat16, E5, E4, gran, bs,
                                     gran is SG.BLOCKWISE)
        ref = TorchGroupedGemmFp8().run(p, grad, w, lens, offs)
        for direct in (False, True):
            tgg._MIXED_FP8_MMA = direct
            try:
                out = tgg.TritonGroupedGemmFp8().run(p, grad, w, lens, offs)
                tm = bench(lambda: tgg.TritonGroupedGemmFp8().run(p, grad, w, lens, offs))
                emit(probe="mixed_fp8_mma", gran=gran.value, direct=direct, snr_vs_torch=snr(out, ref), ms=tm,
                     tflops=2.0 * t * n * k / tm * 1e-9)
            except Exception as exc:  # noqa: BLE001
                emit(probe="mixed_fp8_mma", gran=gran.value, direct=direct, error=repr(exc)[:300])
        tgg._MIXED_FP8_MMA = False


# -- wgrad (variable-K) probe --------------------------------------------------------------------------------
@triton.jit
def _old_variable_k_kernel(
    x_ptr, y_ptr, c_ptr, offs_ptr, sx_ptr, sy_ptr, M, N,
    stride_xt, stride_xm, stride_yt, stride_yn, stride_cg, stride_cm, stride_cn,
    stride_sxk, stride_sxm, stride_syk, stride_syn,
    SCALE: tl.constexpr, QBLOCK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The gg-r2 wgrad kernel (token mask on every step, pointer loads), for the old-vs-new timing."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = num_m * num_n
    g = pid // per_group
    pid_m, pid_n = _tile_coords(pid % per_group, num_m, num_n, GROUP_M)
    start = tl.load(offs_ptr + g).to(tl.int32)
    end = tl.load(offs_ptr + g + 1).to(tl.int32)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(start // BK, tl.cdiv(end, BK)):
        k0 = kb * BK
        tok = k0 + tl.arange(0, BK)
        t_ok = (tok >= start) & (tok < end)
        tok64 = tok.to(tl.int64)
        x = tl.load(x_ptr + tok64[None, :] * stride_xt + rm64[:, None] * stride_xm,
                    mask=t_ok[None, :] & m_ok[:, None], other=0.0)
        y = tl.load(y_ptr + tok64[:, None] * stride_yt + rn64[None, :] * stride_yn,
                    mask=t_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALE == 3:
            kq = k0 // QBLOCK
            sx = tl.load(sx_ptr + kq * stride_sxk + rm64 * stride_sxm, mask=m_ok, other=0.0)
            sy = tl.load(sy_ptr + kq * stride_syk + rn64 * stride_syn, mask=n_ok, other=0.0)
            acc += tl.dot(x, y) * (sx[:, None] * sy[None, :])
        else:
            acc = tl.dot(x, y, acc)
    if SCALE == 1:
        acc = acc * (tl.load(sx_ptr) * tl.load(sy_ptr))
    if SCALE == 2:
        sx = tl.load(sx_ptr + rm64 * stride_sxm, mask=m_ok, other=0.0)
        sy = tl.load(sy_ptr + rn64 * stride_syn, mask=n_ok, other=0.0)
        acc = acc * (sx[:, None] * sy[None, :])
    c_p = c_ptr + g.to(tl.int64) * stride_cg + rm64[:, None] * stride_cm + rn64[None, :] * stride_cn
    tl.store(c_p, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def old_launch(x, y, out, offs, cfg, scale=0, sx=None, sxs=(0, 0), sy=None, sys_=(0, 0), qblock=128):
    g, m, n = out.shape
    bm, bn, bk, gm, st, wa = cfg[:6]
    sx = x if sx is None else sx
    sy = x if sy is None else sy
    _old_variable_k_kernel[(g * -(-m // bm) * -(-n // bn),)](
        x, y, out, offs, sx, sy, m, n, x.stride(0), x.stride(1), y.stride(0), y.stride(1), *out.stride(),
        *sxs, *sys_, SCALE=scale, QBLOCK=qblock, BM=bm, BN=bn, BK=bk, GROUP_M=gm, num_stages=st, num_warps=wa)
    return out


#: The gg-r2 default wgrad configs (bf16, fp8 blockwise, fp8 tensor/rowwise).
OLD_CFG = {"bf16": (128, 256, 64, 8, 3, 8), "blockwise": (128, 128, 128, 8, 4, 8), "rowwise": (128, 256, 128, 8, 3, 8),
           "tensorwise": (128, 256, 128, 8, 3, 8)}

WGRAD_SHAPES = {  # name: (G, tokens, M, N) of out[g] = x_g^T y_g, x [T, M], y [T, N]
    "dsv3_w13": (8, 32768, 4096, 7168),   # grad of [gate;up] (2 x 2048) x hidden activations
    "dsv3_w2": (8, 32768, 7168, 2048),    # grad of the down projection's output x the FFN activations
    "mixtral_w13": (8, 32768, 28672, 4096),
    "mixtral_w2": (8, 32768, 4096, 14336),
}


def ref_wgrad(x, y, lens):
    """float32 per-group x_g^T y_g on the GPU (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    outs, s = [], 0
    for n in lens:
        outs.append(x[s:s + n].float().t() @ y[s:s + n].float())
        s += n
    return torch.stack(outs)


def check_groups(out, ref, lens):
    """(worst rel error over non-empty groups, all empty groups exactly zero)."""
    worst, zeros = 0.0, True
    for i, n in enumerate(lens):
        if n == 0:
            zeros &= bool(torch.equal(out[i], torch.zeros_like(out[i])))
        else:
            worst = max(worst, rel(out[i], ref[i]))
    return worst, zeros


def snr_groups(out, ref, lens):
    nz = [i for i, n in enumerate(lens) if n > 0]
    return min(snr(out[i], ref[i]) for i in nz)


def quant_wgrad(x, y, gran, scale_rows_inner=True):
    """The adapter's wgrad quantisation: token-contiguous fp8 views [T, cols] and scale strides."""
    bs = 128 if gran is SG.BLOCKWISE else None
    qx, sx = tgg._quant_rows(x.t().unsqueeze(0), E4, gran, bs, scale_rows_inner=scale_rows_inner)
    qy, sy = tgg._quant_rows(y.t().unsqueeze(0), E4, gran, bs, scale_rows_inner=scale_rows_inner)
    mode = tgg._SCALE_MODE[gran]
    sxs = (0, 0) if mode == 1 else (sx.stride(2), sx.stride(1))
    sys_ = (0, 0) if mode == 1 else (sy.stride(2), sy.stride(1))
    return qx[0].t(), qy[0].t(), sx, sxs, sy, sys_, mode


def wgrad_correctness():
    """Odd sizes and routings on every path (TMA and pointer, both layouts), vs float32."""
    for (m, n), lens in [((200, 328), [37, 0, 1, 250, 77, 0, 400]), ((211, 333), [1200, 3, 0, 0, 40, 0, 1, 8]),
                         ((256, 384), [0, 513, 0]), ((136, 264), [129, 127, 1, 255])]:
        t = sum(lens)
        lt, offs = lens_offs(lens)
        x = torch.randn(t, m, device=DEV, dtype=torch.bfloat16)
        y = torch.randn(t, n, device=DEV, dtype=torch.bfloat16)
        ref = ref_wgrad(x, y, lens)
        p = variable_k_problem(x, y, lt, offs)
        xt = x.t().contiguous().t()  # token-contiguous (row stride t: TMA only if t % 8 == 0)
        for cfg in tgg._half_configs(p)[:1] + tgg._half_configs(p)[-1:]:
            for lay, (xx, yy) in (("tmajor", (x, y)), ("xtcontig", (xt, y))):
                out = torch.full((len(lens), m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
                tgg.launch_variable_k(xx, yy, out, offs, cfg)
                err, zeros = check_groups(out, ref, lens)
                tma = tgg._vk_descriptor(xx, cfg[0], cfg[2])[0] is not None and \
                    tgg._vk_descriptor(yy, cfg[1], cfg[2])[0] is not None and cfg[6]
                emit(check="wgrad_bf16", mn=f"{m}x{n}", lens=lens, cfg=cfg, layout=lay, tma=bool(tma),
                     rel=f"{err:.2e}", zeros=zeros, ok=err < 1e-2 and zeros)
        xf, yf = x.float(), y.float() * 4
        ref = ref_wgrad(xf, yf, lens)
        for gran in (SG.TENSORWISE, SG.ROWWISE, SG.BLOCKWISE):
            bs = 128 if gran is SG.BLOCKWISE else None
            pq = grouped_gemm_fp8_problem(xf, yf, lt, offs, False, True, torch.bfloat16, E4, E4, gran, bs, False)
            for cfg in tgg._fp8_configs(pq)[:1] + tgg._fp8_configs(pq)[-1:]:
                out = tgg.TritonGroupedGemmFp8().run(pq, xf, yf, lt, offs, config=cfg)
                zeros = all(bool(torch.equal(out[i], torch.zeros_like(out[i]))) for i, c in enumerate(lens) if c == 0)
                s = min(snr(out[i], ref[i]) for i, c in enumerate(lens) if c > 16)
                emit(check="wgrad_fp8", gran=gran.value, mn=f"{m}x{n}", lens=lens, cfg=cfg, snr=s, zeros=zeros,
                     ok=s >= 25 and zeros)
        # HYBRID backward: e5m2 gradient x e4m3 activation (mixed fp8 MMA on the TMA path)
        pq = grouped_gemm_fp8_problem(xf, yf, lt, offs, False, True, torch.bfloat16, E5, E4, SG.BLOCKWISE, 128, False)
        out = tgg.TritonGroupedGemmFp8().run(pq, xf, yf, lt, offs)
        zeros = all(bool(torch.equal(out[i], torch.zeros_like(out[i]))) for i, c in enumerate(lens) if c == 0)
        s = min(snr(out[i], ref[i]) for i, c in enumerate(lens) if c > 16)
        emit(check="wgrad_fp8_hybrid", gran="blockwise", mn=f"{m}x{n}", lens=lens, snr=s, zeros=zeros,
             ok=s >= 20 and zeros)


def wgrad_graph_capture():
    """The wgrad launch (TMA path, bf16 and fp8 blockwise through the adapter) captured once in a
    CUDA graph, replayed with other routings written into the same offsets tensor."""
    if DEV == "cpu":
        return
    t, m, n = 1536, 256, 384
    x = torch.randn(t, m, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(t, n, device=DEV, dtype=torch.bfloat16)
    routings = [[256] * 6, [1536, 0, 0, 0, 0, 0], [0, 100, 0, 1, 1000, 435]]
    lt, offs = lens_offs(routings[0])
    p = variable_k_problem(x, y, lt, offs)
    pq = grouped_gemm_fp8_problem(x, y, lt, offs, False, True, torch.bfloat16, E4, E4, SG.BLOCKWISE, 128, False)
    half, f8 = tgg.TritonGroupedGemm(), tgg.TritonGroupedGemmFp8()
    half.run(p, x, y, lt, offs)
    f8.run(pq, x, y, lt, offs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = half.run(p, x, y, lt, offs)
        out8 = f8.run(pq, x, y, lt, offs)
    for r in routings[1:] + routings[:1]:
        nl, no = lens_offs(r)
        lt.copy_(nl)
        offs.copy_(no)
        graph.replay()
        torch.cuda.synchronize()
        ref = ref_wgrad(x, y, r)
        err, zeros = check_groups(out, ref, r)
        s8 = snr_groups(out8, ref, r)
        zeros8 = all(bool(torch.equal(out8[i], torch.zeros_like(out8[i]))) for i, c in enumerate(r) if c == 0)
        emit(check="wgrad_cuda_graph", lens=r, rel_bf16=f"{err:.1e}", snr_fp8=s8, ok=err < 1e-2 and zeros and zeros8
             and s8 >= 25)


def wgrad_speed(shape, kind, sweep):
    g, t, m, n = WGRAD_SHAPES[shape]
    lens = routing(kind, t, g)
    lt, offs = lens_offs(lens)
    flops = 2.0 * t * m * n
    x = torch.randn(t, m, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(t, n, device=DEV, dtype=torch.bfloat16)
    ref = ref_wgrad(x, y, lens)
    tag = dict(shape=shape, routing=kind)
    # bf16
    p = variable_k_problem(x, y, lt, offs)
    out = torch.empty((g, m, n), device=DEV, dtype=torch.bfloat16)
    tor = TorchGroupedGemm()
    o = tor.run(p, x, y, lt, offs)
    tm_peer = bench(lambda: tor.run(p, x, y, lt, offs))
    emit(dtype="bf16", **tag, impl="torch._grouped_mm", tflops=flops / tm_peer * 1e-9,
         rel=f"{check_groups(o, ref, lens)[0]:.1e}")
    old_launch(x, y, out, offs, OLD_CFG["bf16"])
    err, zeros = check_groups(out, ref, lens)
    tm = bench(lambda: old_launch(x, y, out, offs, OLD_CFG["bf16"]))
    emit(dtype="bf16", **tag, impl=f"old{OLD_CFG['bf16']}", tflops=flops / tm * 1e-9, vs_peer=tm_peer / tm,
         rel=f"{err:.1e}", ok=err < 1e-2 and zeros)
    for cfg in tgg._half_configs(p) if sweep else tgg._half_configs(p)[:1]:
        try:
            out.fill_(float("nan"))
            tgg.launch_variable_k(x, y, out, offs, cfg)
            err, zeros = check_groups(out, ref, lens)
            tm = bench(lambda: tgg.launch_variable_k(x, y, out, offs, cfg))
            emit(dtype="bf16", **tag, impl=f"new{cfg}", tflops=flops / tm * 1e-9, vs_peer=tm_peer / tm,
                 rel=f"{err:.1e}", ok=err < 1e-2 and zeros)
        except Exception as exc:  # noqa: BLE001 - report and go on
            emit(dtype="bf16", **tag, impl=f"new{cfg}", error=repr(exc)[:300])
    del out
    # fp8 kernel alone on pre-quantised operands (the adapter's layouts), then quantise + kernel
    for gran in (SG.ROWWISE, SG.BLOCKWISE, SG.TENSORWISE):
        if gran is SG.TENSORWISE and shape.startswith("mixtral"):
            continue
        bs = 128 if gran is SG.BLOCKWISE else None
        qx, qy, sx, sxs, sy, sys_, mode = quant_wgrad(x, y, gran)
        out = torch.empty((g, m, n), device=DEV, dtype=torch.bfloat16)
        ocfg = OLD_CFG[gran.value]
        oqx, oqy, osx, osxs, osy, osys, _ = quant_wgrad(x, y, gran, scale_rows_inner=False)
        old = lambda: old_launch(oqx, oqy, out, offs, ocfg, mode, osx, osxs, osy, osys)  # noqa: E731
        old()
        s_old = snr_groups(out, ref, lens)
        out_old = out.clone()
        tm_old = bench(old)
        tm_peer = None
        # torch's 2d x 2d fp8 path device-asserts (poisoning the CUDA context) unless every group's
        # token count is a multiple of 16 (16-byte dynamic dimension): skip it otherwise.
        if gran is SG.ROWWISE and hasattr(torch, "_scaled_grouped_mm") and all(c % 16 == 0 for c in lens):
            try:  # 2d x 2d: a [M, T] row-major, b [T, N] column-major, per-group row/col scales
                sa = sx.reshape(m).repeat(g).contiguous()
                sb = sy.reshape(n).repeat(g).contiguous()
                ends = offs[1:].to(torch.int32)
                def fn():
                    return torch._scaled_grouped_mm(qx.t(), qy, sa, sb, offs=ends, out_dtype=torch.bfloat16)
                o = fn()
                s_peer = snr_groups(o, ref, lens)
                tm_peer = bench(fn)
                emit(dtype="fp8", gran=gran.value, **tag, impl="torch._scaled_grouped_mm(kernel)",
                     tflops=flops / tm_peer * 1e-9, snr=s_peer)
                del o
            except Exception as exc:  # noqa: BLE001
                emit(dtype="fp8", gran=gran.value, **tag, impl="torch._scaled_grouped_mm", error=repr(exc)[:300])
        emit(dtype="fp8", gran=gran.value, **tag, impl=f"old{ocfg}(kernel)", tflops=flops / tm_old * 1e-9, snr=s_old)
        pq = grouped_gemm_fp8_problem(x, y, lt, offs, False, True, torch.bfloat16, E4, E4, gran, bs, False)
        cfgs = tgg._fp8_configs(pq)
        for cfg in (cfgs[:2] if gran is SG.TENSORWISE else cfgs) if sweep else cfgs[:1]:
            try:
                out.fill_(float("nan"))
                def fn(cfg=cfg):
                    return tgg.launch_variable_k(qx, qy, out, offs, cfg, scale=mode, sx=sx, sx_strides=sxs, sy=sy,
                                                 sy_strides=sys_, qblock=bs or 128)
                fn()
                s_new = snr_groups(out, ref, lens)
                r_old = max(rel(out[i], out_old[i]) for i, c in enumerate(lens) if c)
                zeros = all(bool(torch.equal(out[i], torch.zeros_like(out[i]))) for i, c in enumerate(lens) if c == 0)
                tm = bench(fn)
                emit(dtype="fp8", gran=gran.value, **tag, impl=f"new{cfg}(kernel)", tflops=flops / tm * 1e-9,
                     vs_old=tm_old / tm, vs_peer=(tm_peer / tm) if tm_peer else "-", snr=s_new,
                     rel_vs_old=f"{r_old:.1e}", ok=s_new >= 25 and zeros and r_old < 2e-2)
            except Exception as exc:  # noqa: BLE001
                emit(dtype="fp8", gran=gran.value, **tag, impl=f"new{cfg}", error=repr(exc)[:300])
        del qx, qy, oqx, oqy, out, out_old
        ad = tgg.TritonGroupedGemmFp8()
        tq = bench(lambda: quant_wgrad(x, y, gran))
        tm = bench(lambda: ad.run(pq, x, y, lt, offs))
        emit(dtype="fp8", gran=gran.value, **tag, impl="new adapter (quant+kernel)", tflops=flops / tm * 1e-9,
             quant_ms=tq, ms=tm)
        torch.cuda.empty_cache()


def whole_op(shape):
    """fwd + dgrad + wgrad of one grouped linear: fp8 blockwise (TRITON, quantisation included) vs
    bf16 torch._grouped_mm (TORCH). Shapes: tokens T, weight [G, N, K] (trans_b)."""
    g, t, n, k = SHAPES[shape]
    lens = routing("balanced", t, g)
    lt, offs = lens_offs(lens)
    a = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    grad = torch.randn(t, n, device=DEV, dtype=torch.bfloat16)
    flops = 3 * 2.0 * t * n * k
    bf = TorchGroupedGemm()
    pb = [(grouped_gemm_problem(a, w, lt, offs, True), a, w), (grouped_gemm_problem(grad, w, lt, offs, False), grad, w),
          (variable_k_problem(grad, a, lt, offs), grad, a)]
    f8 = tgg.TritonGroupedGemmFp8()
    bs = 128
    pf = [(grouped_gemm_fp8_problem(a, w, lt, offs, True, False, torch.bfloat16, E4, E4, SG.BLOCKWISE, bs, True), a, w),
          (grouped_gemm_fp8_problem(grad, w, lt, offs, False, False, torch.bfloat16, E4, E4, SG.BLOCKWISE, bs, True),
           grad, w),
          (grouped_gemm_fp8_problem(grad, a, lt, offs, False, True, torch.bfloat16, E4, E4, SG.BLOCKWISE, bs, False),
           grad, a)]
    t_b = [bench(lambda p=p, x=x, y=y: bf.run(p, x, y, lt, offs)) for p, x, y in pb]
    t_f = [bench(lambda p=p, x=x, y=y: f8.run(p, x, y, lt, offs)) for p, x, y in pf]
    emit(probe="whole_op", shape=shape, bf16_ms=sum(t_b), fp8_blockwise_ms=sum(t_f), speedup=sum(t_b) / sum(t_f),
         bf16_parts="/".join(f"{v:.2f}" for v in t_b), fp8_parts="/".join(f"{v:.2f}" for v in t_f),
         bf16_tflops=flops / sum(t_b) * 1e-9, fp8_tflops=flops / sum(t_f) * 1e-9)
    # Where the fp8 time goes: each quantisation the three runs do, alone (as each run calls it),
    # with its bf16 read + fp8 write rate.
    q = tgg._quant_rows
    quants = {"fwd": [("x", lambda: q(a.unsqueeze(0), E4, SG.BLOCKWISE, bs), a),
                      ("w", lambda: q(w, E4, SG.BLOCKWISE, bs, tile_2d=True), w)],
              "dgrad": [("grad", lambda: q(grad.unsqueeze(0), E4, SG.BLOCKWISE, bs), grad),
                        ("w_t", lambda: q(w.transpose(1, 2), E4, SG.BLOCKWISE, bs, tile_2d=True), w)],
              "wgrad": [("grad_t", lambda: q(grad.t().unsqueeze(0), E4, SG.BLOCKWISE, bs, scale_rows_inner=True), grad),
                        ("x_t", lambda: q(a.t().unsqueeze(0), E4, SG.BLOCKWISE, bs, scale_rows_inner=True), a)]}
    for (gemm, parts), total in zip(quants.items(), t_f):
        spent = 0.0
        for name, fn, src in parts:
            ms = bench(fn)
            spent += ms
            emit(probe="whole_op_quant", shape=shape, gemm=gemm, operand=name, ms=ms,
                 gb_per_s=src.numel() * 3 / ms * 1e-6)
        emit(probe="whole_op_gemm", shape=shape, gemm=gemm, run_ms=total, quant_ms=spent, gemm_ms=total - spent,
             gemm_tflops=2.0 * t * n * k / (total - spent) * 1e-9)


def wgrad_steps():
    steps = [wgrad_correctness, wgrad_graph_capture,
             lambda: wgrad_speed("dsv3_w13", "balanced", sweep=True),
             lambda: wgrad_speed("dsv3_w2", "balanced", sweep=True)]
    for kind in ("skewed", "empty"):
        steps.append(lambda kind=kind: wgrad_speed("dsv3_w13", kind, sweep=False))
        steps.append(lambda kind=kind: wgrad_speed("dsv3_w2", kind, sweep=False))
    for shape in ("mixtral_w13", "mixtral_w2"):
        steps.append(lambda shape=shape: wgrad_speed(shape, "balanced", sweep=False))
    steps += [lambda: whole_op("dsv3_up"), lambda: wgrad_speed("mixtral_w13", "skewed", sweep=False),
              lambda: whole_op("dsv3_down"), lambda: wgrad_speed("mixtral_w2", "empty", sweep=False)]
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--focus", action="store_true")
    ap.add_argument("--wgrad", action="store_true", help="the variable-K (wgrad) probe only")
    ap.add_argument("--occupancy", action="store_true",
                    help="blockwise fp8 fixed-K (fwd, dgrad) over every config, occupancy > 1 included, "
                         "end to end and kernel only, then the whole op")
    ap.add_argument("--whole-op", action="store_true",
                    help="the whole blockwise op only (DeepSeek-V3 up_gate and down), with its quantisation breakdown")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="with --wgrad: tiny shapes under TRITON_INTERPRET=1, to catch script errors before a GPU run")
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; later sections are skipped past it")
    args = ap.parse_args()
    t0 = time.time()
    if args.out:
        OUT_FILE.append(open(args.out, "w"))
    if args.cpu_smoke:
        global DEV
        DEV = "cpu"
        for name in WGRAD_SHAPES:
            WGRAD_SHAPES[name] = (4, 96, 32, 48)
        for name in SHAPES:
            SHAPES[name] = (4, 96, 48, 32)
    emit(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu-smoke", torch=torch.__version__,
         triton=triton.__version__)
    steps = [
        lambda: probe_bf16("dsv3_up", "balanced", sweep=True),
        lambda: probe_fp8("dsv3_up", "balanced", SG.BLOCKWISE, sweep=True, gemms=("fwd", "wgrad")),
        lambda: probe_fp8("dsv3_up", "balanced", SG.ROWWISE, sweep=True),
        lambda: probe_mixed_mma(),
        lambda: probe_fp8("dsv3_down", "balanced", SG.BLOCKWISE, sweep=False, gemms=("fwd", "dgrad_hybrid", "wgrad")),
        lambda: probe_fp8("dsv3_down", "balanced", SG.ROWWISE, sweep=False),
    ]
    for shape in ("dsv3_down", "mixtral_up", "mixtral_down"):
        steps.append(lambda shape=shape: probe_bf16(shape, "balanced", sweep=False))
    for kind in ("skewed", "empty"):
        steps.append(lambda kind=kind: probe_bf16("dsv3_up", kind, sweep=False))
        steps.append(lambda kind=kind: probe_fp8("dsv3_up", kind, SG.BLOCKWISE, sweep=False))
    for shape in ("mixtral_up", "mixtral_down"):
        steps.append(lambda shape=shape: probe_fp8(shape, "balanced", SG.BLOCKWISE, sweep=False))
    if args.quick:
        steps = steps[:1]
    if args.focus:  # the second-round set: wgrad, blockwise fp8 and the default picks end to end
        steps = [
            lambda: probe_fp8("dsv3_up", "balanced", SG.BLOCKWISE, sweep=True, gemms=("fwd", "wgrad")),
            lambda: probe_bf16("dsv3_up", "balanced", sweep=True),
            lambda: probe_fp8("dsv3_down", "balanced", SG.BLOCKWISE, sweep=False, gemms=("fwd", "dgrad_hybrid",
                                                                                        "wgrad")),
            lambda: probe_fp8("dsv3_up", "skewed", SG.ROWWISE, sweep=False, gemms=("fwd", "wgrad")),
            lambda: probe_bf16("mixtral_up", "skewed", sweep=False),
        ]
    if args.wgrad:
        steps = wgrad_steps()
    if args.occupancy:
        steps = [
            lambda: probe_fp8("dsv3_up", "balanced", SG.BLOCKWISE, sweep=True, gemms=("fwd",)),
            lambda: probe_fp8("dsv3_down", "balanced", SG.BLOCKWISE, sweep=True, gemms=("fwd", "dgrad_hybrid")),
            lambda: probe_fp8("dsv3_up", "skewed", SG.BLOCKWISE, sweep=True, gemms=("fwd",)),
            lambda: whole_op("dsv3_up"),
            lambda: whole_op("dsv3_down"),
        ]
    if args.whole_op:
        steps = [lambda: whole_op("dsv3_up"), lambda: whole_op("dsv3_down")]
    for step in steps:
        if time.time() - t0 > args.budget:
            emit(skipped="budget")
            break
        try:
            step()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        torch.cuda.empty_cache()
    if OUT_FILE:
        OUT_FILE[0].close()


if __name__ == "__main__":
    main()
