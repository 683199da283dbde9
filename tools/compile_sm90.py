"""Compile the GEMM kernels, Gluon attention and fused fp8 producers for Hopper without one; check their fit.

Triton compiles to PTX and a cubin with its bundled ptxas; only loading needs a driver. A stand-in
driver that names the target (sm_90 by default) lets ``JITFunction.warmup`` specialise and compile
the production kernels with CPU tensors. From the result this tool reads what decides speed
before any timing:

* registers per thread, spill stack, shared memory, and the spill loads/stores inside the loops
  that issue wgmmas (``loop_spills``; a spill outside them costs once per tile, not per K step);
* how many programs of that kernel fit on one SM (registers per SM sub-partition, shared memory,
  warps), the ceiling for a config's ``occupancy`` field;
* the wgmma waits of the K loop (``wgmma.wait_group N`` in the PTX): ``0`` alone means each K
  step waits for its own MMAs (the blockwise promotion), a ``1`` means MMAs overlap across steps;
* whether ptxas serialised the kernel's wgmmas (its "Potential Performance Loss ... serialized"
  notes, read by running the bundled ptxas again with ``-v`` on the PTX): it does so when code
  reads or writes the registers of an in-flight wgmma, which undoes any overlap silently.

Every config of the candidate tables is compiled at a representative large problem; a config
that asks for more programs per SM than fit, spills inside its wgmma loop (beyond
``LOOP_SPILL_ALLOWANCE``), has serialised wgmmas, or fails to compile
is a FAIL (exit 1). The fused fp8 producers (family ``fused_producers``: every launch the
benchmark's cases make, with and without the high-precision output) are memory-bound: one of
theirs FAILs if it spills at all or fewer than ``FUSED_MIN_FIT`` programs fit on an SM.

Usage: ``python tools/compile_sm90.py [--only dense_fp8_blockwise,...] [--json FILE] [--cc 90] [--first N]``
(``--first N``: each family's first N configs only, for a quicker check).
``--occupancy-only`` compiles just the configs with occupancy > 1 plus each family's default (the
CPU test runs that). TRITON_INTERPRET is ignored (unset before triton is imported).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.runtime import driver as _driver  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for offline_driver

from offline_driver import OfflineDriver  # noqa: E402

from turbo_dispatch.backends.triton import attention_gluon as AG  # noqa: E402
from turbo_dispatch.backends.triton import attention_gluon_bwd as AGB  # noqa: E402
from turbo_dispatch.backends.triton import configs as C  # noqa: E402
from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GL  # noqa: E402
from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS  # noqa: E402
from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW  # noqa: E402
from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK  # noqa: E402
from turbo_dispatch.backends.triton import fused_producers as FP  # noqa: E402
from turbo_dispatch.backends.triton import gemm_kernels as GK  # noqa: E402
from turbo_dispatch.backends.triton import grouped_gemm as GG  # noqa: E402
from turbo_dispatch.backends.triton import grouped_kernels as GKK  # noqa: E402
from turbo_dispatch.backends.triton import rotary as ROT  # noqa: E402
from turbo_dispatch.low_precision import ScalingGranularity  # noqa: E402

#: Hopper per-SM limits: 4 sub-partitions of 16384 registers, 228 KiB shared memory (1 KiB of it
#: reserved per program), 64 resident warps.
SM_SUBPARTITIONS, REGS_PER_SUBPARTITION = 4, 16384
SMEM_PER_SM, SMEM_RESERVED = 228 * 1024, 1024
MAX_WARPS = 64
E4 = torch.float8_e4m3fn


class _OfflineDriver(OfflineDriver):
    """The stand-in driver (tools/offline_driver.py) for NVIDIA compute capability ``cc``."""

    def __init__(self, cc: int):
        super().__init__(GPUTarget("cuda", cc, 32))


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
    """Co-resident programs on one SM: registers are allocated per warp in 256-register units
    (8 per thread) from the sub-partition the warp runs on."""
    regs_per_warp = -(-max(regs, 1) // 8) * 8 * 32
    warps_per_sub = REGS_PER_SUBPARTITION // regs_per_warp
    by_regs = (warps_per_sub * SM_SUBPARTITIONS) // warps
    by_smem = SMEM_PER_SM // (shared + SMEM_RESERVED)
    return max(0, min(by_regs, by_smem, MAX_WARPS // warps))


def _nvidia_tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


#: Spill instructions a wgmma loop may hold and still PASS: one. Triton 3.9 keeps the thread
#: index that elects the warpgroup's mbarrier arrive in local memory in the warp-specialised
#: kernel's 256-column loop: one 4-byte L1 reload per K step, next to ~300 instructions of
#: wgmma issue and promotion. triton 3.6 keeps it in a register.
LOOP_SPILL_ALLOWANCE = 1


def mma_loop_spills(sass: str) -> int:
    """The most spill loads and stores (LDL/STL) inside any one innermost loop that issues wgmmas
    (HGMMA/QGMMA).

    A loop is a predicated backward branch's range in the SASS. Spills there cost every K step; spills
    outside (a per-tile index table LLVM hoisted out of the persistent loop, say) cost once per
    tile, which is why ``stack`` alone does not decide."""
    code = [(int(a, 16), text) for a, text in _SASS_LINE.findall(sass)]
    loops = []
    for addr, text in code:
        # Only a predicated branch closes a loop: an mbarrier wait's out-of-line retry stub jumps
        # back into the middle of the K loop unconditionally, and taken as a loop it would span
        # the epilogue's spills (triton 3.9, the wgrad's 256-row tile).
        m = re.search(r"@!?U?P\d\s+BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    mma_loops = set()
    for addr, text in code:
        if "GMMA." in text:
            around = [lp for lp in loops if lp[0] <= addr <= lp[1]]
            if around:
                mma_loops.add(min(around, key=lambda lp: lp[1] - lp[0]))
    spills = [addr for addr, text in code if re.search(r"\b(LDL|STL)\b", text)]
    return max((sum(1 for a in spills if lo <= a <= hi) for lo, hi in mma_loops), default=0)


def serialisation_notes(ptx: str, arch: str) -> list[str]:
    """ptxas's notes that it serialised the wgmmas of this PTX (empty when it did not)."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        ptxas = get_ptxas(int(re.sub(r"\D", "", arch))).path  # the ptxas triton itself uses for this arch
        log = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True)
    return [line.split("info    : ", 1)[-1] for line in (log.stdout + log.stderr).splitlines() if "serialized" in line]


def _resources(compiled, warps: int) -> dict:
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
        path = f.name
    try:
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    shared = int(compiled.metadata.shared)
    return {"regs": regs, "stack": stack, "loop_spills": mma_loop_spills(sass), "shared": shared,
            "fit": programs_per_sm(regs, shared, warps),
            "wgmma_waits": sorted(set(int(w) for w in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx))),
            "serialised": serialisation_notes(ptx, arch) if "wgmma.mma_async" in ptx else []}


# -- one compile per (family, config), arguments laid out as the production launchers lay them ------
M_DENSE, N_DENSE, K_DENSE = 4096, 7168, 16384  # the blockwise target shape
G_MOE, M_MOE, N_MOE, K_MOE = 8, 8 * 4096, 4096, 7168  # DeepSeek-V3 up_gate, 8 experts x 4096 tokens


def _dense_fp8(cfg: C.TileConfig, mode: int):
    M, N, K = M_DENSE, N_DENSE, K_DENSE
    a, b = torch.empty((M, K), dtype=E4), torch.empty((N, K), dtype=E4)
    c = torch.empty((M, N), dtype=torch.bfloat16)
    if mode == FK.SCALE_BLOCK:
        sa, sb = torch.empty((K // cfg.block_k, M)).t(), torch.empty((N // cfg.block_k, K // cfg.block_k))
        ss = (sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    else:
        sa, sb = torch.empty(M if mode else ()), torch.empty(N if mode else ())
        ss = (0, 0, 0, 0)
    ad = TensorDescriptor(a, [M, K], list(a.stride()), [cfg.block_m, cfg.block_k])
    bd = TensorDescriptor(b, [N, K], list(b.stride()), [cfg.block_n, cfg.block_k])
    return FK._fp8_gemm_kernel.warmup(
        ad, bd, c, sa, sb, M, N, K, K, 1, K, 1, N, 1, *ss, 132, SCALE_MODE=mode, A_GROUP=1,
        B_GROUP=cfg.block_k if mode == FK.SCALE_BLOCK else 1, USE_TMA=True, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_stages=cfg.num_stages,
        num_warps=cfg.num_warps, grid=(1,))


def _dense_gluon_tensors(cfg: C.TileConfig):
    """Operands, output and 1 x bk / bk x bk scales of the dense blockwise problem, laid out as the
    Gluon launchers lay them."""
    M, N, K = M_DENSE, N_DENSE, K_DENSE
    a, b = torch.empty((M, K), dtype=E4), torch.empty((N, K), dtype=E4)
    c = torch.empty((M, N), dtype=torch.bfloat16)
    sa, sb = torch.empty((K // cfg.block_k, M)).t(), torch.empty((N // cfg.block_k, K // cfg.block_k))
    return a, b, c, sa, sb


def _dense_fp8_gluon(cfg: C.TileConfig):
    a, b, c, sa, sb = _dense_gluon_tensors(cfg)
    ad, bd = GL.make_descriptor(a, [cfg.block_m, cfg.block_k]), GL.make_descriptor(b, [cfg.block_n, cfg.block_k])
    return GL._fp8_blockwise_kernel.warmup(
        ad, bd, c, sa, sb, M_DENSE, N_DENSE, K_DENSE, N_DENSE, 1, *sa.stride(), *sb.stride(), 132, A_GROUP=1,
        B_GROUP=cfg.block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        STAGES=cfg.num_stages, CHUNK=GL.chunk_for(cfg.block_m, cfg.block_n, cfg.num_warps), num_warps=cfg.num_warps,
        grid=(1,))


def _dense_fp8_gluon_ws(cfg: C.TileConfig):
    """The launcher's own arguments (``launch_args``: TMA stores, scales in shared memory, the
    split last wave, as it would choose them; the CPU tensors' addresses are 16-byte aligned like
    CUDA ones), 132 programs."""
    a, b, c, sa, sb = _dense_gluon_tensors(cfg)
    args, kwargs = GWS.launch_args(a, b, c, None, 1, N_DENSE, sa, sa.stride(), sb, (0, *sb.stride()), cfg, 1,
                                   cfg.block_k, 132)
    return GWS._fp8_blockwise_ws_kernel.warmup(*args, **kwargs, grid=(1,))


def _grouped_fp8_gluon_ws(cfg: C.TileConfig):
    G, M, N, K = G_MOE, M_MOE, N_MOE, K_MOE
    a, b = torch.empty((M, K), dtype=E4), torch.empty((G * N, K), dtype=E4)
    c, offs = torch.empty((M, N), dtype=torch.bfloat16), torch.empty(G + 1, dtype=torch.int32)
    sa, sb = torch.empty((M, K // 128)), torch.empty((G, N // 128, K // 128))
    args, kwargs = GWS.launch_args(a, b, c, offs, G, N, sa, sa.stride(), sb, sb.stride(), cfg, 1, 128, 132)
    return GWS._fp8_blockwise_ws_kernel.warmup(*args, **kwargs, grid=(1,))


def _grouped_wgrad_gluon_ws(cfg: tuple):
    """The warp-specialised wgrad at DeepSeek-V3 up_gate ([G, 4096, 7168] over 8 x 4096 tokens),
    operands and scales as the dual quantiser lays them, the launcher's own arguments."""
    G, T, M, N = G_MOE, M_MOE, N_MOE, K_MOE
    x, y = torch.empty((M, T), dtype=E4).t(), torch.empty((N, T), dtype=E4).t()
    c, offs = torch.empty((G, M, N), dtype=torch.bfloat16), torch.empty(G + 1, dtype=torch.int32)
    sx, sy = torch.empty((T // 128, M)), torch.empty((T // 128, N))
    args, kwargs = GWW.launch_args(x, y, c, offs, sx, sx.stride(), sy, sy.stride(), cfg, 128)
    return GWW._fp8_blockwise_wgrad_kernel.warmup(*args, **kwargs, grid=(1,))


B_ATTN, S_ATTN, HQ_ATTN, HKV_ATTN = 2, 4096, 32, 8  # GQA 32/8 at 4096 tokens
#: The window the ``WINDOW`` kernels compile with: a 1024-key left window, causal or 256 keys ahead.
WINDOW_ATTN = {True: (1024, 0), False: (1024, 256)}


def _attention_gluon_fwd(cfg: AG.GluonAttnConfig):
    """The Gluon attention forward's variant ``cfg`` at B 2, S 4096, GQA 32/8, bf16, the
    launcher's own arguments (``attention_gluon.launch_args``; a window config with
    ``WINDOW_ATTN``; a ``varlen`` config on the same tokens packed, cu_seqlens int32 ``[B + 1]``)."""
    d = cfg.head_dim
    q, out = (torch.empty((B_ATTN, S_ATTN, HQ_ATTN, d), dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.empty((B_ATTN, S_ATTN, HKV_ATTN, d), dtype=torch.bfloat16) for _ in range(2))
    window = WINDOW_ATTN[cfg.causal] if cfg.window else (-1, -1)
    if cfg.varlen:
        cu = torch.arange(0, (B_ATTN + 1) * S_ATTN, S_ATTN, dtype=torch.int32)
        _, args, kwargs = AG.launch_args(*(x.flatten(0, 1) for x in (q, k, v, out)),
                                         torch.empty((HQ_ATTN, B_ATTN * S_ATTN)), d ** -0.5, cfg, window, (cu, cu),
                                         (S_ATTN, S_ATTN))
    else:
        _, args, kwargs = AG.launch_args(q, k, v, out, torch.empty((B_ATTN, HQ_ATTN, S_ATTN)), d ** -0.5, cfg, window)
    return AG.attn_fwd_gluon_kernel.warmup(*args, **kwargs, grid=(1,))


def _attention_gluon_bwd(cfg: AGB.GluonAttnBwdConfig):
    """One Gluon attention backward kernel (``cfg.kernel``: dK/dV or dQ; in the heavy-first order if
    ``cfg.heavy_first``) at the forward's problem, the launcher's own arguments
    (``attention_gluon_bwd.dkdv_launch_args`` / ``dq_launch_args``; a window config with
    ``WINDOW_ATTN``; a ``varlen`` config on the same tokens packed)."""
    d = cfg.head_dim
    q, dout, dq = (torch.empty((B_ATTN, S_ATTN, HQ_ATTN, d), dtype=torch.bfloat16) for _ in range(3))
    k, v, dk, dv = (torch.empty((B_ATTN, S_ATTN, HKV_ATTN, d), dtype=torch.bfloat16) for _ in range(4))
    lse2, delta = (torch.empty((B_ATTN, HQ_ATTN, S_ATTN)) for _ in range(2))
    window = WINDOW_ATTN[cfg.causal] if cfg.window else None
    seqs = {}
    if cfg.varlen:
        q, dout, dq, k, v, dk, dv = (x.flatten(0, 1) for x in (q, dout, dq, k, v, dk, dv))
        lse2, delta = (torch.empty((HQ_ATTN, B_ATTN * S_ATTN)) for _ in range(2))
        cu = torch.arange(0, (B_ATTN + 1) * S_ATTN, S_ATTN, dtype=torch.int32)
        seqs = dict(cu_seqlens=(cu, cu), max_seqlens=(S_ATTN, S_ATTN))
    if cfg.kernel == "dkdv":
        _, args, kwargs = AGB.dkdv_launch_args(q, k, v, dout, dk, dv, lse2, delta, d ** -0.5, cfg.causal,
                                               cfg.heavy_first, window, **seqs)
        return AGB.attn_bwd_dkdv_gluon_kernel.warmup(*args, **kwargs, grid=(1,))
    own = (torch.empty_like(dout), torch.empty_like(lse2)) if cfg.self_delta else None  # (out, lse)
    _, args, kwargs = AGB.dq_launch_args(q, k, v, dout, dq, lse2, delta, d ** -0.5, cfg.causal, cfg.heavy_first,
                                         window, **seqs, self_delta=own)
    return AGB.attn_bwd_dq_gluon_kernel.warmup(*args, **kwargs, grid=(1,))


def _dense_bf16(cfg: C.TileConfig):
    M, N, K = M_DENSE, N_DENSE, 4096
    a, b = torch.empty((M, K), dtype=torch.bfloat16), torch.empty((K, N), dtype=torch.bfloat16)
    c = torch.empty((M, N), dtype=torch.bfloat16)
    ad = TensorDescriptor(a, [M, K], list(a.stride()), [cfg.block_m, cfg.block_k])
    bd = TensorDescriptor(b, [K, N], list(b.stride()), [cfg.block_k, cfg.block_n])
    return GK._gemm_kernel.warmup(
        ad, bd, c, M, N, K, K, 1, N, 1, N, 1, USE_TMA=True, A_STORED_KM=False, B_STORED_NK=False, UPCAST=False,
        FP32_IN=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_PROGS=132,
        GROUP_M=cfg.group_m, num_stages=cfg.num_stages, num_warps=cfg.num_warps, grid=(1,))


def _grouped_fixed_k(cfg: tuple, scale: int, dtype):
    bm, bn, bk, gm, stages, warps = cfg[:6]
    G, M, N, K = G_MOE, M_MOE, N_MOE, K_MOE
    a, b = torch.empty((M, K), dtype=dtype), torch.empty((G, N, K), dtype=dtype)
    c, offs = torch.empty((M, N), dtype=torch.bfloat16), torch.empty(G + 1, dtype=torch.int32)
    if scale == 3:
        sa, sb = torch.empty((1, M, K // 128)), torch.empty((G, N // 128, K // 128))
        ss = (sa.stride(1), sa.stride(2), sb.stride(0), sb.stride(1), sb.stride(2))
    else:
        sa, sb = torch.empty(M), torch.empty((G, N))
        ss = (1, 0, sb.stride(0), sb.stride(1), 0)
    ad = TensorDescriptor(a, [M, K], [K, 1], [bm, bk])
    bd = TensorDescriptor(b, [G * N, K], [K, 1], [bn, bk])
    return GKK.grouped_fixed_k_kernel.warmup(
        a, b, c, offs, sa, sb, ad, bd, G, M, N, K, 132, K, 1, N * K, K, 1, N, 1, *ss, SCALE=scale, QBLOCK=128,
        SB_NDIV=128 if scale == 3 else 1, BM=bm, BN=bn, BK=bk, GROUP_M=gm, EVEN_K=True, USE_TMA=True,
        B_KMAJOR=True, UPCAST=0, num_stages=stages, num_warps=warps, grid=(1,))


def _grouped_variable_k(cfg: tuple, scale: int, dtype):
    bm, bn, bk, gm, stages, warps = cfg[:6]
    G, T, M, N = G_MOE, M_MOE, N_MOE, K_MOE  # wgrad [G, N_MOE, K_MOE] over the tokens
    x, y = torch.empty((M, T), dtype=dtype).t(), torch.empty((N, T), dtype=dtype).t()  # token-contiguous
    c, offs = torch.empty((G, M, N), dtype=torch.bfloat16), torch.empty(G + 1, dtype=torch.int32)
    if scale == 3:
        sx, sy = torch.empty((T // 128, M)), torch.empty((T // 128, N))
        ss = (sx.stride(0), sx.stride(1), sy.stride(0), sy.stride(1))
    else:
        sx, sy = torch.empty(M), torch.empty(N)
        ss = (0, 1, 0, 1)
    xd = TensorDescriptor(x.t(), [M, T], [T, 1], [bm, bk])
    yd = TensorDescriptor(y.t(), [N, T], [T, 1], [bn, bk])
    return GKK.grouped_variable_k_kernel.warmup(
        x, y, c, offs, sx, sy, xd, yd, M, N, 1, T, 1, T, M * N, N, 1, *ss, SCALE=scale, QBLOCK=128, BM=bm, BN=bn,
        BK=bk, GROUP_M=gm, UPCAST=0, USE_TMA=True, X_TCONTIG=True, Y_TCONTIG=True, num_stages=stages,
        num_warps=warps, grid=(1,))


def _grouped_problem(gran, variable_k: bool, m: int, n: int):
    """The grouped fp8 key whose candidates the adapter offers (they depend on G, M, N, the recipe
    and the layout; K is the up_gate's, or the tokens for a wgrad)."""
    from turbo_dispatch.ops.grouped_gemm import GroupedGemmFp8Problem

    bf16, e4 = torch.bfloat16, torch.float8_e4m3fn
    return GroupedGemmFp8Problem(G_MOE, m, n, M_MOE if variable_k else K_MOE, not variable_k, variable_k, bf16,
                                 bf16, bf16, e4, e4, gran, 128, True, "cuda")


#: The fused producers' cases (benchmarks/bench_fused_producers.py): (op, row length) of
#: Llama-3.1-8B, Llama-3.1-70B at TP8 and Qwen2.5-7B.
FUSED_CASES = (("rms_norm", 4096), ("rms_norm", 8192), ("rms_norm", 3584), ("swiglu", 14336), ("swiglu", 3584),
               ("swiglu", 18944))
FUSED_RECIPES = ("rowwise", "blockwise", "tensorwise")
#: Programs of a fused producer launch that must fit on one SM: one program's loads then overlap
#: another's arithmetic (each program alternates between the two).
FUSED_MIN_FIT = 2
_FUSED_M = 64  # rows of the stand-in tensors: M is a runtime argument, 64 specialises as 8192 does


def _fused_launches(op: str, n: int, recipe: str, with_out: bool) -> list:
    """The producer's launches (``fused_producers.launches``) for one case, on CPU tensors laid out
    as the benchmark lays them (SwiGLU's gate and up: halves of one [M, 2n] projection)."""
    bf16, m = torch.bfloat16, _FUSED_M
    gran = ScalingGranularity(recipe)
    bs = 128 if recipe == "blockwise" else None
    if op == "rms_norm":
        a, b, sb, code = torch.empty((m, n), dtype=bf16), torch.empty(n, dtype=bf16), 0, FP._OP_RMS_NORM
    else:
        gate_up = torch.empty((m, 2 * n), dtype=bf16)
        a, b, sb, code = gate_up[:, :n], gate_up[:, n:], 2 * n, FP._OP_SWIGLU
    out = torch.empty((m, n) if with_out else (1,), dtype=bf16)
    data = torch.empty((m, n), dtype=E4)
    scale = torch.empty(()) if bs is None and recipe == "tensorwise" else torch.empty((m, -(-n // bs) if bs else 1))
    return FP.launches(code, a, b, sb, 1e-5, out, data, scale, torch.empty(1), gran, bs, with_out)


def _fused_configs() -> list:
    """(op, n, recipe, with_out, launch index, warps, 1, mode, plan) per launch: occupancy 1, as the
    kernels do not ask for co-resident programs (``FUSED_MIN_FIT`` is checked on its own), so
    ``--occupancy-only`` compiles just the first."""
    rows = []
    for op, n in FUSED_CASES:
        for recipe in FUSED_RECIPES:
            for with_out in (False, True):
                for i, launch in enumerate(_fused_launches(op, n, recipe, with_out)):
                    f = launch.fixed
                    plan = "single" if f["SINGLE"] else "walk"
                    rows.append((op, n, recipe, with_out, i, launch.options["num_warps"], 1, f["MODE"],
                                 f"{plan}:{f['ROWS']}x{f['CHUNK']}+{f['TAIL1']}+{f['TAIL2']}"))
    return rows


def _plain_swiglu(cfg: tuple):
    """The unquantised SwiGLU kernel (``fused_producers.swiglu``) on halves of one [64, 2 x 14336]
    projection of dtype ``cfg[0]``."""
    gate_up = torch.empty((_FUSED_M, 2 * 14336), dtype=getattr(torch, cfg[0]))
    h = torch.empty((_FUSED_M, 14336), dtype=gate_up.dtype)
    return FP._swiglu_kernel.warmup(gate_up, gate_up[:, 14336:], h, 14336, 2 * 14336, 2 * 14336, 14336,
                                    BLOCK=FP.SWIGLU_BLOCK, num_warps=cfg[5], grid=(1,))


def _fused_producer(cfg: tuple):
    launch = _fused_launches(*cfg[:4])[cfg[4]]
    tensors = dict(zip(FP._LAUNCHER.per_call, launch.tensors))
    return FP._producer_kernel.warmup(**tensors, **launch.fixed, **launch.options, grid=(1,))


#: The rotary kernel's launches at Llama-3.1-8B's attention input (B2 S4096, 32 q / 8 kv heads of
#: 128): (dtype, head dim, rotated pairs, interleaved, inverse, warps, occupancy, section) where the
#: section is q or k (rotated) or v (copied), forward and backward.
ROTARY_CASES = [(dt, d, r, il, inv, ROT.WARPS, 1, sec) for dt in ("bfloat16", "float32")
                for d, r in ((128, 64), (64, 16)) for il in (False, True) for inv in (False, True)
                for sec in ("q", "v")]


def _rotary(cfg: tuple):
    dtype = getattr(torch, cfg[0])
    dim, half, interleaved, inverse, section = cfg[1], cfg[2], cfg[3], cfg[4], cfg[7]
    bsz, seq, heads = 2, 4096, 32
    packed = torch.empty((bsz, seq, heads + 16, dim), dtype=dtype)
    out = torch.empty((bsz, seq, heads, dim), dtype=dtype)
    src, dst = (packed[:, :, :heads], out) if not inverse else (out, packed[:, :, :heads])
    table = torch.empty((1, seq, half))
    rotate = section != "v"
    grid, tensors, fixed, options = ROT.launch(src, dst, table if rotate else None, table if rotate else None,
                                               half if rotate else 0, interleaved, inverse)
    return ROT._rotary_kernel.warmup(*tensors, **fixed, **options, grid=grid)


def triton_only(configs: list) -> list:
    """The grouped configs that run the Triton kernel. On an sm_90 host the adapter offers the
    warp-specialised Gluon configs first; they have families of their own and compiled through the
    Triton kernel would be judged on a kernel they never run (a spurious spill FAIL)."""
    return [c for c in configs if not GG._is_ws(c)]


def attention_fwd_variants() -> list:
    """The Gluon attention forward's switchable variants (attention_gluon.VARIANT_SWITCHES), full
    and causal: each option alone on the variant its head dim runs by default, and all of them
    together on each ring shape (three warpgroups at d64, pipelined at both head dims)."""
    make = AG.config_for
    alone = [make(64, c, wg3=True) for c in (False, True)]
    alone += [make(d, c, d in AG.PIPELINED_HEAD_DIMS, **{opt: True}) for opt in ("fold_scale", "exp2_emu")
              for d in (128, 64) for c in (False, True)]
    every = dict(fold_scale=True, exp2_emu=True)
    together = [make(64, c, wg3=True, **every) for c in (False, True)]
    together += [make(d, c, True, **every) for d in (128, 64) for c in (False, True)]
    return alone + together


def attention_window_fwd_configs() -> list:
    """The Gluon attention forward's ``WINDOW`` kernels, full and causal: first as a windowed call
    runs them with every switch at its default (``call_config``), then with the pipelined choice
    flipped, the folded scale off, and the emulated exponentials on."""
    make = AG.config_for
    defaults = {key: default for key, (_, _, default) in AG.VARIANT_SWITCHES.items()}
    first = [make(d, c, d in AG.PIPELINED_HEAD_DIMS, window=True, **defaults) for d in (128, 64)
             for c in (False, True)]
    flipped = [make(d, c, d not in AG.PIPELINED_HEAD_DIMS, window=True, **defaults) for d in (128, 64)
               for c in (False, True)]
    options = [make(d, True, d in AG.PIPELINED_HEAD_DIMS, window=True, **dict(defaults, **change))
               for change in ({"fold_scale": False}, {"exp2_emu": True}) for d in (128, 64)]
    return first + flipped + options


def attention_varlen_fwd_configs() -> list:
    """The Gluon attention forward's ``VARLEN`` kernels, full and causal: the variants a varlen call
    runs with every switch at its default (``call_config``), then with the pipelined choice
    flipped, and the window kernels."""
    make = AG.config_for
    defaults = {key: default for key, (_, _, default) in AG.VARIANT_SWITCHES.items()}
    first = [make(d, c, d in AG.PIPELINED_HEAD_DIMS, varlen=True, **defaults) for d in (128, 64)
             for c in (False, True)]
    flipped = [make(d, c, d not in AG.PIPELINED_HEAD_DIMS, **dict(defaults, wg3=False), varlen=True)
               for d in (128, 64) for c in (False, True)]
    window = [make(d, c, d in AG.PIPELINED_HEAD_DIMS, window=True, varlen=True, **defaults) for d in (128, 64)
              for c in (False, True)]
    return first + flipped + window


def families() -> dict:
    """family -> (configs in the order the adapters offer them (first = default), compile(cfg),
    index of the occupancy field). Warps are field 5 of dense and grouped configs alike."""
    offered = C.fp8_candidates(M_DENSE, N_DENSE, K_DENSE, 128)
    blockwise = [c for c in offered if c.kernel == C.KERNEL_TRITON]
    blockwise += [c for cls in C._FP8_BLOCKWISE.values() for c in cls if c not in blockwise]
    gluon_all = [c for c in offered if c.kernel in C.GLUON_KERNELS]
    for c in (c for cls in C._FP8_BLOCKWISE_GLUON.values() for c in cls):
        if c not in gluon_all:
            gluon_all.append(c)
    gluon = [c for c in gluon_all if c.kernel == C.KERNEL_GLUON]
    gluon_ws = [c for c in gluon_all if c.kernel == C.KERNEL_GLUON_WS]
    B, R, T = ScalingGranularity.BLOCKWISE, ScalingGranularity.ROWWISE, ScalingGranularity.TENSORWISE
    fixed_half = SimpleNamespace(variable_k=False, m=M_MOE, n=N_MOE, g=G_MOE, platform="cuda")
    vk_half = SimpleNamespace(variable_k=True, m=N_MOE, n=K_MOE, g=G_MOE, platform="cuda")
    dense, grouped = 6, 7
    table = [
        ("dense_fp8_blockwise", blockwise, lambda c: _dense_fp8(c, FK.SCALE_BLOCK), dense),
        ("dense_fp8_blockwise_gluon", gluon, _dense_fp8_gluon, dense),
        ("dense_fp8_blockwise_gluon_ws", gluon_ws, _dense_fp8_gluon_ws, dense),
        ("grouped_fp8_blockwise_gluon_ws", [C.TileConfig(*c[:6], 1, C.KERNEL_GLUON_WS) for c in GG.WS_CONFIGS],
         _grouped_fp8_gluon_ws, dense),
        ("dense_fp8_rowwise", C.fp8_candidates(M_DENSE, N_DENSE, K_DENSE), lambda c: _dense_fp8(c, FK.SCALE_ROW),
         dense),
        ("dense_bf16", C.gemm_candidates(M_DENSE, N_DENSE, 4096, 2), _dense_bf16, dense),
        ("grouped_fp8_blockwise", triton_only(GG._fp8_configs(_grouped_problem(B, False, M_MOE, N_MOE))),
         lambda c: _grouped_fixed_k(c, 3, E4), grouped),
        ("grouped_fp8_rowwise", GG._fp8_configs(_grouped_problem(R, False, M_MOE, N_MOE)),
         lambda c: _grouped_fixed_k(c, 2, E4), grouped),
        ("grouped_bf16", GG._half_configs(fixed_half), lambda c: _grouped_fixed_k(c, 0, torch.bfloat16), grouped),
        ("grouped_wgrad_fp8_blockwise", triton_only(GG._fp8_configs(_grouped_problem(B, True, N_MOE, K_MOE))),
         lambda c: _grouped_variable_k(c, 3, E4), grouped),
        ("grouped_wgrad_fp8_blockwise_gluon_ws", [C.TileConfig(*c[:6], 1, C.KERNEL_GLUON_WS)
                                                  for c in GG.WGRAD_WS_CONFIGS], _grouped_wgrad_gluon_ws, dense),
        ("grouped_wgrad_fp8_tensorwise", GG._fp8_configs(_grouped_problem(T, True, N_MOE, K_MOE)),
         lambda c: _grouped_variable_k(c, 1, E4), grouped),
        ("grouped_wgrad_bf16", GG._half_configs(vk_half), lambda c: _grouped_variable_k(c, 0, torch.bfloat16),
         grouped),
        ("attention_gluon_fwd", [AG.config_for(d, causal) for d in (128, 64) for causal in (False, True)],
         _attention_gluon_fwd, len(AG.GluonAttnConfig._fields)),
        ("attention_gluon_bwd", [make(d, causal) for make in (AGB.dkdv_config, AGB.dq_config) for d in (128, 64)
                                 for causal in (False, True)], _attention_gluon_bwd,
         len(AGB.GluonAttnBwdConfig._fields)),
        ("attention_gluon_bwd_heavy_first", [make(d, True, heavy_first=True) for make in
                                             (AGB.dkdv_config, AGB.dq_config) for d in (128, 64)],
         _attention_gluon_bwd, len(AGB.GluonAttnBwdConfig._fields)),
        ("attention_gluon_bwd_self_delta", [AGB.dq_config(d, causal, heavy_first=causal, window=window, varlen=varlen,
                                                          self_delta=True)
                                            for d in (128, 64) for causal in (False, True) for window in (False, True)
                                            for varlen in (False, True)],
         _attention_gluon_bwd, len(AGB.GluonAttnBwdConfig._fields)),
        ("attention_gluon_fwd_pipelined", [AG.config_for(d, causal, pipeline=True) for d in (128, 64)
                                           for causal in (False, True)], _attention_gluon_fwd,
         len(AG.GluonAttnConfig._fields)),
        ("attention_gluon_fwd_variants", attention_fwd_variants(), _attention_gluon_fwd,
         len(AG.GluonAttnConfig._fields)),
        ("attention_gluon_fwd_window", attention_window_fwd_configs(), _attention_gluon_fwd,
         len(AG.GluonAttnConfig._fields)),
        ("attention_gluon_bwd_window", [make(d, causal, heavy_first=causal, window=True)
                                        for make in (AGB.dkdv_config, AGB.dq_config) for d in (128, 64)
                                        for causal in (False, True)], _attention_gluon_bwd,
         len(AGB.GluonAttnBwdConfig._fields)),
        ("attention_gluon_fwd_varlen", attention_varlen_fwd_configs(), _attention_gluon_fwd,
         len(AG.GluonAttnConfig._fields)),
        ("attention_gluon_bwd_varlen", [make(d, causal, heavy_first=causal, window=window, varlen=True)
                                        for window in (False, True) for make in (AGB.dkdv_config, AGB.dq_config)
                                        for d in (128, 64) for causal in (False, True)], _attention_gluon_bwd,
         len(AGB.GluonAttnBwdConfig._fields)),
        ("fused_producers", _fused_configs(), _fused_producer, 6),
        ("rotary", ROTARY_CASES, _rotary, 6),
        ("fused_swiglu", [(dt, 14336, 0, 0, 0, 8, 1) for dt in ("bfloat16", "float32")], _plain_swiglu, 6),
    ]
    return {name: (cfgs, build, occ_at) for name, cfgs, build, occ_at in table}


def run(table: dict, only: list[str] | None, occupancy_only: bool, cc: int, first: int | None = None) -> list[dict]:
    """Compiles every selected (family, config) of ``table`` (``families()``), or each family's
    ``first`` configs only; one result dict per compile."""
    # Restored as found: reset_active() would try to create a real driver, which fails here.
    previous = getattr(_driver, "_active", None)
    _driver.set_active(_OfflineDriver(cc))
    rows = []
    try:
        for name, (cfgs, build, occ_at) in table.items():
            if only and name not in only:
                continue
            for i, cfg in enumerate(cfgs if first is None else cfgs[:first]):
                occ = cfg[occ_at] if len(cfg) > occ_at else 1
                if occupancy_only and occ == 1 and i > 0:
                    continue
                row = {"family": name, "config": list(cfg), "default": i == 0, "occupancy": occ}
                try:
                    row.update(_resources(build(cfg), cfg[5]))
                except Exception as exc:  # noqa: BLE001 - a compile failure is a result
                    row.update(status="FAIL", reason=f"compile: {type(exc).__name__}: {str(exc)[:300]}")
                    rows.append(row)
                    continue
                problems = []
                if row["fit"] < occ:
                    problems.append(f"asks for {occ} programs per SM, {row['fit']} fit")
                if row["loop_spills"] > LOOP_SPILL_ALLOWANCE:
                    problems.append(f"spills inside its wgmma loop ({row['loop_spills']} LDL/STL, "
                                    f"{row['stack']} bytes of stack)")
                if name in ("fused_producers", "rotary", "fused_swiglu") and row["stack"]:
                    problems.append(f"spills ({row['stack']} bytes of stack)")
                if name == "fused_producers" and row["fit"] < FUSED_MIN_FIT:
                    problems.append(f"{row['fit']} programs fit per SM, fewer than {FUSED_MIN_FIT}")
                if row["serialised"]:
                    problems.append("ptxas serialised its wgmmas: " + " | ".join(row["serialised"]))
                row.update(status="FAIL" if problems else "PASS", reason="; ".join(problems))
                rows.append(row)
    finally:
        _driver._active = previous
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--occupancy-only", action="store_true",
                    help="compile only configs with occupancy > 1 and each family's default")
    ap.add_argument("--cc", type=int, default=90, help="compute capability to compile for (default 90)")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    ap.add_argument("--first", type=int, default=None, metavar="N",
                    help="compile only the first N configs of each family (its defaults come first)")
    args = ap.parse_args(argv)
    if args.first is not None and args.first < 1:
        ap.error(f"--first must be >= 1, got {args.first}")
    only = [f for f in args.only.split(",") if f]
    table = families()
    unknown = set(only) - set(table)
    if unknown:
        ap.error(f"--only: unknown families {sorted(unknown)}; known: {sorted(table)}")
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GB

    unchecked = GB._triton_release() not in GB.GLUON_TRITON_RELEASES
    if unchecked:
        # The library refuses the Gluon kernels on this release (fp8_blockwise_gluon.available), so
        # they are not compiled here either; add the release to GLUON_TRITON_RELEASES once they do.
        table = {name: entry for name, entry in table.items() if "gluon" not in name}
    rows = run(table, only, args.occupancy_only, args.cc, args.first)
    print(f"triton {triton.__version__}, sm_{args.cc}")
    if unchecked:
        print(f"SKIP every Gluon family: triton {GB._triton_release()} is not in GLUON_TRITON_RELEASES")
    for r in rows:
        if "regs" in r:
            print(f"{r['status']} {r['family']:30s} {str(tuple(r['config'])):38s} occ={r['occupancy']} "
                  f"fit={r['fit']} regs={r['regs']} stack={r['stack']} loop_spills={r['loop_spills']} "
                  f"smem={r['shared']} waits={r['wgmma_waits']} {r['reason']}")
        else:
            print(f"{r['status']} {r['family']:30s} {str(tuple(r['config'])):38s} {r['reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "cc": args.cc, "gluon_checked": not unchecked, "rows": rows}, f,
                      indent=1)
    return 1 if any(r["status"] != "PASS" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
