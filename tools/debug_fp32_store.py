"""Round 98 (GPU): isolate round 97's unwritten fp32 columns (every column = 1 mod 4 of the
blockwise grouped dgrad's float32 output). (1) The public forward with the same kernel config
(trans_b False, N = 256: the 128 x 256 warp-specialised tile in two 128-column halves), float32
and bfloat16 outputs, the TMA-store epilogue left to its rule / forced off. (2) The kernel's
masked pointer store alone, on an fp32 wgmma-layout tile, in a one-warpgroup Gluon kernel."""
import torch

import turbo_dispatch.backends.triton.fp8_blockwise_gluon_ws as GWS
from turbo_dispatch.low_precision import Float8QuantConfig
from turbo_dispatch.ops.grouped_gemm import grouped_gemm_fp8

torch.manual_seed(0)
cfg = Float8QuantConfig(format="e4m3", granularity="blockwise", block_size=128)
lens = [40, 0, 88, 1, 127]
gl_ = torch.tensor(lens, device="cuda", dtype=torch.int64)
for n in (256, 160, 384):
    a = torch.randn(sum(lens), 160, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(len(lens), 160, n, device="cuda", dtype=torch.bfloat16)
    for tma_store in (None, False):
        GWS.TMA_STORE = tma_store
        for odt in (torch.float32, torch.bfloat16):
            torch.full((1 << 22,), float("nan"), device="cuda")
            out = grouped_gemm_fp8(a, b, gl_, trans_b=False, out_dtype=odt, config=cfg)
            bad = (~torch.isfinite(out)).any(0).nonzero().flatten().tolist()
            print(f"fwd N={n} TMA_STORE={tma_store} out={odt}: NaN columns {len(bad)} {bad[:16]}", flush=True)
GWS.TMA_STORE = None

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402


@gluon.jit
def _store_probe(c, sc_m, sc_n, HALF: gl.constexpr):
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF, 32])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, mma_layout))
    cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, mma_layout))
    vals = (rows[:, None] * 1000 + cols[None, :]).to(c.dtype.element_ty)
    GWS._masked_store_tile(c, vals, 0, 0, 64, HALF, sc_m, sc_n)


for dt in (torch.float32, torch.bfloat16):
    for half in (128, 64):
        c = torch.full((64, half), float("nan"), device="cuda", dtype=dt)
        _store_probe[(1,)](c, c.stride(0), c.stride(1), HALF=half, num_warps=4)
        want = (torch.arange(64, device="cuda")[:, None] * 1000 + torch.arange(half, device="cuda")[None, :]).to(dt)
        bad = (c != want).any(0).nonzero().flatten().tolist()
        print(f"store probe {dt} HALF={half}: wrong columns {len(bad)} {bad[:16]}", flush=True)
