"""Round 67-68 debug probe (H100): where the blockwise step quantised once and reused differs from
the step quantised per GEMM. At the probe's DeepSeek-V3 up_gate and Qwen3 down operands it
compares the register Gluon quantiser's tiles with the Triton kernel's and its runs with the
shared-memory kernel's (each output, bit for bit), the two steps with tiles from either kernel,
and each step against itself. Usage (repo installed): ``python3 tools/debug_step_tiles.py``."""
import sys

import torch

sys.path.insert(0, "tools")
import probe_grouped_step as P
import turbo_dispatch.backends.triton.dual_quantize as DQ
import turbo_dispatch.backends.triton.dual_quantize_gluon as DG
from turbo_dispatch import BackendType, GlobalBackendManager
E4 = torch.float8_e4m3fn


def same(got, ref) -> list[bool]:
    """Per output of two dual_quantize results: equal bits (fp8 compared as bytes)."""
    return [torch.equal(*(t.view(torch.uint8) if t.element_size() == 1 else t for t in pair))
            for pair in zip(got, ref)]


for shape in ("dsv3_up", "qwen3_down"):
    t, n, k, lens, offs, a, w, grad, cfg = P.step_operands(shape)
    outs = {}
    for tiles in (True, False):
        DG.SERVES_TILES = tiles
        outs[tiles] = DQ.dual_quantize(w.detach(), E4, 128, True)
    print(shape, "tiles regs vs triton equal per output:", same(outs[True], outs[False]), flush=True)
    ga = a.detach().clone()
    outs = {}
    for regs in (True, False):
        DG.KERNEL = "regs" if regs else "smem"
        outs[regs] = DQ.dual_quantize(ga[None], E4, 128, False)
    DG.KERNEL = "smem"
    print(shape, "runs regs vs smem equal:", same(outs[True], outs[False]), flush=True)
    GlobalBackendManager.reset()
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    for tiles in (False, True):
        DG.SERVES_TILES = tiles
        res = {}
        for reuse in (True, False):
            out = P.with_reuse(reuse, P.step_fn(a, w, lens, offs, cfg, grad))
            res[reuse] = (out.detach().clone(), a.grad.clone(), w.grad.clone())
        print(shape, "SERVES_TILES", tiles, "reuse vs not equal (out, da, dw):",
              [torch.equal(x, y) for x, y in zip(res[True], res[False])],
              [float((x.float() - y.float()).abs().max()) for x, y in zip(res[True], res[False])], flush=True)
    # run-to-run determinism of the non-reuse step
    res2 = [P.with_reuse(False, P.step_fn(a, w, lens, offs, cfg, grad)).detach().clone() for _ in range(2)]
    print(shape, "non-reuse deterministic out:", torch.equal(res2[0], res2[1]), flush=True)
    res2 = []
    for _ in range(2):
        P.with_reuse(True, P.step_fn(a, w, lens, offs, cfg, grad)); res2.append((a.grad.clone(), w.grad.clone()))
    print(shape, "reuse deterministic grads:", [torch.equal(x, y) for x, y in zip(*res2)], flush=True)
