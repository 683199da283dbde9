"""Which blockwise fp8 training steps can be captured in one CUDA graph: small and DeepSeek-V3
sizes, with and without explicit group offsets, each in a fresh process (a failed capture leaves
the CUDA context unusable). Prints one line per case. Usage: ``python tools/probe_step_capture.py``."""
from __future__ import annotations

import subprocess
import sys

CASES = [(6, 1536, 384, 512, False), (6, 1536, 384, 512, True), (8, 32768, 4096, 7168, False),
         (8, 32768, 4096, 7168, True), (8, 8192, 4096, 7168, True)]


def one(g: int, t: int, n: int, k: int, with_offs: bool) -> None:
    import torch

    import turbo_dispatch as turbo
    from turbo_dispatch import BackendType, GlobalBackendManager
    from probe_record import capture_graph  # sibling in tools/
    from turbo_dispatch.low_precision import Float8QuantConfig

    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
    a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((g,), t // g, dtype=torch.int64, device="cuda")
    offs = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0)) if with_offs else None

    def step():
        a.grad = w.grad = None
        out = turbo.ops.grouped_gemm_fp8(a, w, lens, offs, trans_b=True, config=cfg)
        out.backward(grad)

    graph = capture_graph(step, warmups=2)
    graph.replay()
    torch.cuda.synchronize()


def main() -> int:
    if len(sys.argv) > 1:
        one(*[int(v) for v in sys.argv[1:5]], sys.argv[5] == "1")
        return 0
    for case in CASES:
        r = subprocess.run([sys.executable, __file__, *[str(int(v)) for v in case]], capture_output=True, text=True)
        err = [ln for ln in r.stderr.splitlines() if "Error" in ln][-1:] if r.returncode else []
        print(f"capture g={case[0]} t={case[1]} n={case[2]} k={case[3]} offs={case[4]}: "
              f"{'ok' if r.returncode == 0 else 'FAIL ' + ' '.join(err)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
