"""Kernels for an ncu look at the dual quantiser on DeepSeek-V3's x [32768, 7168] (run under ncu
by tools/gpu_round42.sh and gpu_round43.sh): the one-tile Gluon kernel with its transposed pass
reading one, two or four columns per shared-memory load (round 42 compared register loads,
cp.async loads and the pipelined kernel), and torch's clone of the same tensor as the bandwidth
reference."""
import torch

import turbo_dispatch.backends.triton.dual_quantize as DQ
import turbo_dispatch.backends.triton.dual_quantize_gluon as DG

x = torch.randn(1, 32768, 7168, device="cuda", dtype=torch.bfloat16)
for name, setup in (("one column per thread", dict(LAUNCH=(32, 32, 4), COLUMN_LAYOUT=None)),
                    ("2 x 16 per thread", dict(LAUNCH=(32, 32, 4), COLUMN_LAYOUT=(2, 16, 32, 2))),
                    ("4 x 8 per thread", dict(LAUNCH=(32, 32, 4), COLUMN_LAYOUT=(4, 8, 32, 1)))):
    for key, value in setup.items():
        setattr(DG, key, value)
    for _ in range(2):  # the first compiles; ncu skips it (--launch-skip)
        DQ.dual_quantize(x, torch.float8_e4m3fn, 128, False)
    torch.cuda.synchronize()
for _ in range(2):
    x.clone()
torch.cuda.synchronize()
