#!/usr/bin/env bash
# Eighteenth session: where the fp8 blockwise step's host time goes (Qwen3-30B-A3B down, TRITON
# pinned): host ms per step for fp8 and bf16, and a cProfile of 30 fp8 steps saved for reading
# offline (pstats file).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout -s TERM 200 python3 - <<'PY' 2>&1 | tail -120
import cProfile, os, statistics, sys, time
import torch
sys.path.insert(0, "tools")
import probe_grouped_step as P
from turbo_dispatch import BackendType, GlobalBackendManager
for shape in ("qwen3_down", "dsv3_up"):
    _, _, _, lens, offs, a, w, grad, cfg = P.step_operands(shape)
    for label, backend, prec, c in (("fp8", BackendType.TRITON, "fp8", cfg), ("bf16", BackendType.TORCH, "bf16", None)):
        GlobalBackendManager.reset()
        GlobalBackendManager.set_grouped_gemm_backend(backend, precision=prec)
        run = P.step_fn(a, w, lens, offs, c, grad)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        host = []
        for _ in range(30):
            torch.cuda._sleep(20_000_000)
            t0 = time.perf_counter(); run(); host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        print(shape, label, "host ms median", round(statistics.median(host), 3), "min", round(min(host), 3))
        if label == "fp8" and shape == "qwen3_down":
            prof = cProfile.Profile()
            for _ in range(30):
                torch.cuda._sleep(20_000_000)
                prof.enable(); run(); prof.disable()
                torch.cuda.synchronize()
            prof.dump_stats(os.environ["OUT"] + "/host_fp8_qwen3_down.pstats")
    GlobalBackendManager.reset()
PY
