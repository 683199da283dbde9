"""Kernels for an ncu look at the dual quantiser on DeepSeek-V3's x [32768, 7168], run under ncu
(tools/gpu_round42.sh shows the command): the Gluon token-run kernel at its shipped launch and
torch's clone of the same tensor as the bandwidth reference. Rounds 42 and 43 also profiled the
variants dual_quantize_gluon's docstring lists as tried (their code is in commit b12bb73); round 89
also the quantisers without their division (``QUOTIENT_MODE``, code in commit 48ab42a)."""
import torch

import turbo_dispatch.backends.triton.dual_quantize as DQ

x = torch.randn(1, 32768, 7168, device="cuda", dtype=torch.bfloat16)
for _ in range(2):  # ncu profiles both launches; the first also compiles (outside the kernel's time)
    DQ.dual_quantize(x, torch.float8_e4m3fn, 128, False)
    x.clone()
torch.cuda.synchronize()
