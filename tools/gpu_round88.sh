#!/usr/bin/env bash
# Ran on commit e608a38 (K-outer row scales, grouped launches with global loads); the layout change was reverted after this round.
# Eighteenth session: row-scale layout of the grouped blockwise step, three ways in turns, outputs
# and gradients bit-compared: (a) K-inner scales, global loads (the code before round 87);
# (b) K-outer scales, global loads (this commit's default); (c) K-outer scales copied into shared
# memory (round 87's code). Then the EP8 blockwise whole op, 28 cases, as rounds 76-82.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout -s TERM 200 python3 - <<'PY' 2>&1 | tee $OUT/layout_abc.log | grep -v "^W1\|UserWarning\|_warn_once"
import json, os, statistics, sys
import torch
sys.path.insert(0, "tools")
import probe_grouped_step as P
from turbo_dispatch import BackendType, GlobalBackendManager
from turbo_dispatch.backends.triton import dual_quantize as DQ
from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
VARIANTS = {"a_kinner_global": (False, None), "b_kouter_global": (True, None), "c_kouter_smem": (True, True)}
out = open(os.environ["OUT"] + "/layout_abc.jsonl", "w")
P.ROUTING[0] = "balanced"
for shape in ("dsv3_up_ep8", "dsv3_down_ep8", "qwen3_down"):
    _, _, _, lens, offs, a, w, grad, cfg = P.step_operands(shape)
    GlobalBackendManager.reset()
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    run = P.step_fn(a, w, lens, offs, cfg, grad)
    times, ref = {}, None
    for turn in range(2):
        for label, (k_outer, smem) in VARIANTS.items():
            DQ.ROW_SCALES_K_OUTER, GWS.SCALES_IN_SMEM = k_outer, smem
            for _ in range(2):
                o = run()
            torch.cuda.synchronize()
            got = (o.detach().clone(), a.grad.clone(), w.grad.clone())
            ref = got if ref is None else ref
            if turn == 0:
                print("bits", shape, label, "PASS" if all(torch.equal(x, y) for x, y in zip(got, ref)) else "FAIL")
            _, seq = P._profiled_steps(run, 10)
            for order, (ms, name) in enumerate(seq):
                times.setdefault((order, name[:32]), {}).setdefault(label, []).append(ms)
            times.setdefault((99, "step"), {}).setdefault(label, []).append(sum(m for m, _ in seq))
    for (order, name), per in sorted(times.items()):
        med = {k: statistics.median(v) for k, v in per.items()}
        if med["a_kinner_global"] < 0.005:
            continue
        out.write(json.dumps(dict(shape=shape, order=order, kernel=name, ms=med, samples=per)) + "\n"); out.flush()
        print(shape, order, name, " ".join(f"{k[:1]} {v:.4f}" for k, v in med.items()),
              "b/a x%.3f c/a x%.3f" % (med["a_kinner_global"] / med["b_kouter_global"], med["a_kinner_global"] / med["c_kouter_smem"]))
    DQ.ROW_SCALES_K_OUTER, GWS.SCALES_IN_SMEM = True, None
    del a, w, grad
    torch.cuda.empty_cache()
PY
echo "layout abc rc=$?"
res=$OUT/res; mkdir -p $res
timeout -s TERM 220 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
