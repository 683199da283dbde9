#!/usr/bin/env bash
# Thirteenth session, first call: the 256 x 128 blockwise wgrad tile in 64 x 64 pieces
# (gluon-wgrad-r4). (1) Its triton 3.6 compile (spills in the K loop). (2) The float64 wgrad test
# with the new variants and the default-wgrad tests. (3) The wgrad probe: 128 x 128 against
# 256 x 128 (pieces one at a time, overlapped; 3 and 4 stages) at DeepSeek-V3 and Qwen3 shapes,
# three routings. (4) The EP8 blockwise whole op, the 256-row tile offered to the autotuner.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
timeout -s TERM 90 python3 tools/compile_sm90.py --only grouped_wgrad_fp8_blockwise_gluon_ws 2>&1 | grep -E "^(PASS|FAIL)|^triton"
timeout -s TERM 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_grouped_gemm.py -m gpu \
    -k "wgrad_warp_specialised or default_wgrad" 2>&1 | tail -15; echo "pytest rc=$?"
timeout -s TERM 150 python3 tools/probe_wgrad_ws.py --out $OUT/probe_wgrad.jsonl \
    --shapes dsv3_w13,dsv3_w2,qwen3_w13,qwen3_w2 > /dev/null 2>$OUT/probe_err.log; echo "probe rc=$?"
tail -3 $OUT/probe_err.log
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/probe_wgrad.jsonl") if l.strip()]
for r in rows:
    if "impl" in r:
        print(r.get("shape"), r.get("routing"), r["impl"], "smem" if r.get("scales_smem") else "",
              "overlap" if r.get("overlap") else "", r.get("tflops") and round(r["tflops"], 1), r.get("ok"),
              r.get("rel"), r.get("error", ""))
PY
timeout -s TERM 260 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
