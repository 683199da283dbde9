"""Kernels for an ncu look at the warp-specialised blockwise wgrad at DeepSeek-V3 up_gate
(8 experts x 4096 tokens, balanced; operands as the step quantises them), run under ncu
(tools/gpu_round61.sh shows the command): the 128 x 128 tile at 4 stages (the default), launched
twice (the first also compiles). Round 61 also profiled the 256 x 128 tile worked in 64 x 64
pieces (gluon-wgrad-r4, commit 0333a41, reverted: no faster, and its float64 test failed
intermittently); the figures are in benchmarks/results/h100_2026-11-23_summary.md, thirteenth
session."""
import torch

from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW

from probe_triton_grouped import lens_offs, routing  # siblings in tools/, as the probes import them
from probe_wgrad_ws import SHAPES, operand

g, tokens, m, n = SHAPES["dsv3_w13"]
_, offs = lens_offs(routing("balanced", tokens, g))
offs = offs.to(torch.int32)
qx, sx, sxs = operand(torch.randn(tokens, m, device="cuda", dtype=torch.bfloat16))
qy, sy, sys_ = operand(torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16))
out = torch.empty((g, m, n), device="cuda", dtype=torch.bfloat16)
for cfg in ((128, 128, 128, 8, 4, 8),):
    for _ in range(2):
        GWW.fp8_blockwise_wgrad(qx, qy, out, offs, sx, sxs, sy, sys_, cfg)
torch.cuda.synchronize()
