#!/usr/bin/env bash
# Ran on commit 084a931 (K-outer row scales copied into shared memory); see round 88 for the outcome.
# Eighteenth session: the dual quantiser stores the row runs' scales K-block-major ([nC, R]), so the
# warp-specialised forward and dgrad copy each K step's 128 row scales into shared memory with one
# contiguous read (SA_SMEM) instead of every math warpgroup loading them from global memory.
# (1) Each kernel of the fp8 step with the old layout (ROW_SCALES_K_OUTER False: K-inner, global
# loads) and the new, in turns, outputs and gradients bit-compared; (2) GPU tests: grouped ops,
# CUDA graphs, every recipe, dual quantiser, the compiled step.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout -s TERM 240 python3 - <<'PY' 2>&1 | tee $OUT/layout_ab.log | grep -v "^W1"
import json, os, statistics, sys
import torch
sys.path.insert(0, "tools")
import probe_grouped_step as P
from turbo_dispatch import BackendType, GlobalBackendManager
from turbo_dispatch.backends.triton import dual_quantize as DQ
out = open(os.environ["OUT"] + "/layout_ab.jsonl", "w")
for routing, shapes in (("balanced", ("dsv3_up_ep8", "dsv3_down_ep8", "qwen3_down", "gptoss_down_ep8")),
                        ("skewed", ("qwen3_down", "dsv3_up_ep8"))):
    P.ROUTING[0] = routing
    for shape in shapes:
        _, _, _, lens, offs, a, w, grad, cfg = P.step_operands(shape)
        GlobalBackendManager.reset()
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
        run = P.step_fn(a, w, lens, offs, cfg, grad)
        times, ref = {}, None
        for turn in range(2):
            for k_outer in (False, True):
                DQ.ROW_SCALES_K_OUTER = k_outer
                for _ in range(2):
                    o = run()
                torch.cuda.synchronize()
                got = (o.detach().clone(), a.grad.clone(), w.grad.clone())
                ref = got if ref is None else ref
                same = all(torch.equal(x, y) for x, y in zip(got, ref))
                _, seq = P._profiled_steps(run, 10)
                for order, (ms, name) in enumerate(seq):
                    times.setdefault((k_outer, order, name[:32]), []).append(ms)
                times.setdefault((k_outer, 99, "step"), []).append(sum(m for m, _ in seq))
                if turn == 0:
                    print("bits", shape, routing, "k_outer", k_outer, "PASS" if same else "FAIL", flush=True)
        for (k_outer, order, name), ms in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if ms[0] < 0.005:
                continue
            base = statistics.median(times[(False, order, name)])
            row = dict(shape=shape, routing=routing, k_outer=k_outer, order=order, kernel=name,
                       ms=statistics.median(ms), samples=ms, vs_old=base / statistics.median(ms))
            out.write(json.dumps(row) + "\n"); out.flush()
            if k_outer:
                print(shape, routing, order, name, "old %.4f new %.4f  x%.3f" % (base, statistics.median(ms), base / statistics.median(ms)), flush=True)
        DQ.ROW_SCALES_K_OUTER = True
        del a, w, grad
        torch.cuda.empty_cache()
PY
echo "layout ab rc=$?"
timeout -s TERM 280 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py tests/test_grouped_gemm.py -p no:cacheprovider \
    --tb=short -k "cuda_graph or full_op or every_recipe or dual or compiled or training_step" > $OUT/pytest_grouped.log 2>&1
echo "pytest grouped rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_grouped.log | cut -c1-300 | head -20
