"""Round 97 (GPU): why the blockwise grouped fp8 step leaves columns of a.grad unwritten when a is
float32 (tests/test_grouped_gemm.py::test_grouped_gemm_fp8_dtypes[cuda-fp32-blockwise128], failing
at 3667a1c too). Runs the test's case, names the dgrad's backend and kernel (turbo.explain on the
dgrad's own call), and repeats the dgrad with the warp-specialised kernel's TMA-store epilogue
forced off and on, printing which output columns stay NaN (the test poisons freed memory)."""
import logging

import torch

import turbo_dispatch as turbo
from turbo_dispatch.backends.quantizer import quantize_runs_both, quantize_tiles_both
from turbo_dispatch.low_precision import Float8QuantConfig
from turbo_dispatch.ops.grouped_gemm import grouped_gemm_fp8

torch.manual_seed(0)
lens = [40, 0, 88, 1, 127]
K, N = 256, 160
gl = torch.tensor(lens, device="cuda", dtype=torch.int64)
cfg = Float8QuantConfig(format="e4m3", granularity="blockwise", block_size=128)
for dtype in (torch.float32, torch.bfloat16):
    a = torch.randn(sum(lens), K, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(len(lens), N, K, device="cuda", dtype=dtype, requires_grad=True)
    torch.full((1 << 22,), float("nan"), device="cuda")
    out = grouped_gemm_fp8(a, b, gl, trans_b=True, config=cfg)
    grad = torch.randn_like(out)
    torch.full((1 << 22,), float("nan"), device="cuda")
    out.backward(grad)
    bad = (~torch.isfinite(a.grad)).any(0).nonzero().flatten().tolist()
    badr = (~torch.isfinite(a.grad)).any(1).nonzero().flatten().tolist()
    print(f"{dtype}: a.grad NaN columns {len(bad)}: {bad[:40]} rows {len(badr)}: {badr[:10]}..{badr[-5:]}", flush=True)
    ref = (grad.double().cpu().split(lens) if False else None)
# the dgrad alone, as the step calls it: gradient runs (rows) x the weight's tiles stored for the dgrad
a = torch.randn(sum(lens), K, device="cuda")
b = torch.randn(len(lens), N, K, device="cuda")
dy = torch.randn(sum(lens), N, device="cuda")
g_rows, _ = quantize_runs_both(dy, torch.float8_e4m3fn, 128)
_, b_saved = quantize_tiles_both(b, torch.float8_e4m3fn, 128)
ref = torch.cat([dy[s:s + n].double() @ b[i].double() for i, (s, n) in
                 enumerate(zip([sum(lens[:i]) for i in range(len(lens))], lens))])
call = (g_rows, b_saved, gl)
kw = dict(trans_b=False, out_dtype=torch.float32, config=cfg)
d = turbo.explain("grouped_gemm_fp8", *call, **kw)
print("explain:", getattr(d, "backend", None), " | ".join(d.notes)[:600], flush=True)
import turbo_dispatch.backends.triton.fp8_blockwise_gluon_ws as GWS  # noqa: E402

for tma_store in (None, False, True):
    GWS.TMA_STORE = tma_store
    for odt in (torch.float32, torch.bfloat16):
        torch.full((1 << 22,), float("nan"), device="cuda")
        try:
            got = grouped_gemm_fp8(*call, trans_b=False, out_dtype=odt, config=cfg)
        except Exception as exc:
            print(f"TMA_STORE={tma_store} out={odt}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        bad = (~torch.isfinite(got)).any(0).nonzero().flatten().tolist()
        err = float((got.double() - ref).norm() / ref.norm()) if not bad else float("nan")
        print(f"TMA_STORE={tma_store} out={odt}: NaN columns {len(bad)} {bad[:24]} rel err {err:.3e}", flush=True)
GWS.TMA_STORE = None
logging.basicConfig(level=logging.DEBUG)
