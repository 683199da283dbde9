#!/usr/bin/env bash
# Ran on commit 99b5af6, with the DYNAMIC and ZERO_WORDS switches; they were removed after this round (both on).
# Seventeenth session: the blockwise wgrad (gluon-wgrad-r6) zeroes an edge step's neighbouring
# tokens a word at a time (ZERO_WORDS) and takes work items from a device counter (DYNAMIC).
# (1) The wgrad kernel alone, the default config with each (DYNAMIC, ZERO_WORDS) pair in the same
# run, outputs compared bit for bit and against the Triton kernel, at the bench's routings.
# (2) The wgrad GPU tests. (3) The EP8 blockwise whole op, 28 cases, as rounds 73 and 76.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 170 python3 tools/probe_wgrad_ws.py --flags 00,01,10,11 \
    --shapes dsv3_w13,qwen3_w13,qwen3_w2,gptoss_w2 --routings balanced,bench_skewed,bench_empty,skewed \
    --out $OUT/probe_wgrad.jsonl > $OUT/probe_wgrad.log 2>&1; echo "probe wgrad rc=$?"
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/probe_wgrad.jsonl") if l.strip()]
for r in rows:
    if "routing" in r:
        print(r["shape"], r["routing"], r.get("impl", "")[:9], "dyn", r.get("dynamic"), "zw", r.get("zero_words"),
              "tflops", round(r.get("tflops", 0), 1), "same", r.get("same_bits"), "rel", r.get("rel"), "ok", r.get("ok"),
              r.get("error", "")[:200])
PY
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "wgrad" -p no:cacheprovider \
    --tb=short > $OUT/pytest_wgrad.log 2>&1; echo "pytest wgrad rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_wgrad.log | cut -c1-300 | head -20
res=$OUT/res; mkdir -p $res
timeout -s TERM 200 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
