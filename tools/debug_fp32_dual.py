"""Round 99 (GPU): round 97-98 traced the fp32 blockwise dgrad's NaN columns to its B operand, the
weight's transposed fp8 copy from the Triton dual kernel (the Gluon kernels take bf16/fp16 only,
so float32 inputs take the Triton one). Compares that kernel's outputs with the reference
quantisation (CPU, two quantize calls) for float32, bfloat16 and float16 inputs, tiles and runs,
as the kernel now runs (rounds 99-100 also stored the transposed copy from a tl.trans'd tile, before
and after the fp8 conversion: every fourth row wrong at float32 tiles either way; round 101: a
float32 weight's transposed copy is now torch's copy of its row copy)."""
import torch

import turbo_dispatch.backends.triton.dual_quantize as DQ
from turbo_dispatch.backends.quantizer import quantize_both_tensors

torch.manual_seed(0)
E4 = torch.float8_e4m3fn
DQ.GLUON = False
for dt in (torch.float32, torch.bfloat16, torch.float16):
    for tile in (True, False):
        x = (torch.randn(3, 256 + 77, 384 + 32, device="cuda") * 3).to(dt)
        ref = quantize_both_tensors(x.cpu(), E4, 128, tile)
        for flag in (None,):
            got = DQ.dual_quantize(x, E4, 128, tile)
            report = []
            for name, g_, r_ in zip(("data", "scale", "data_t", "scale_t"), got, ref):
                g_, r_ = g_.cpu(), r_
                if g_.element_size() == 1:
                    diff = g_.view(torch.uint8) != r_.view(torch.uint8)
                else:
                    diff = ~((g_ == r_) | (g_.isnan() & r_.isnan()))
                n = int(diff.sum())
                rows = diff.any(-1).nonzero()[:, -1].unique().tolist() if n else []
                report.append(f"{name} {n} bad" + (f" rows {rows[:12]}" if n else ""))
            print(f"{dt} tile={tile}: " + "; ".join(report), flush=True)
