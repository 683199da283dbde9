#!/usr/bin/env bash
# One device call for gluon-wgrad-r2 (scales copied into the ring slots; 256-row tile): its float64
# GPU test, kernel-only timings of the variants against the Triton variable-K kernel, the step
# probe (fwd + dgrad + wgrad through the public op) and the EP8 whole-op bench.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -x \
    tests/test_triton_grouped_gemm.py -k "wgrad_warp_specialised" > $OUT/pytest_wgrad_ws.log 2>&1; echo "rc=$?"
tail -30 $OUT/pytest_wgrad_ws.log | grep -E "passed|failed|Error|assert" | head -20
timeout -s TERM 120 python3 tools/probe_wgrad_ws.py --shapes dsv3_w13,dsv3_w2,qwen3_w13 --routings balanced,skewed \
    --out $OUT/wgrad_ws.jsonl > $OUT/wgrad_ws.log 2>&1
echo "rc=$?"; cut -c1-250 $OUT/wgrad_ws.log | sed 's/g=[0-9]* tokens=[0-9]* //'
timeout -s TERM 100 python3 tools/probe_grouped_step.py --shapes dsv3_up,dsv3_down,qwen3_up --out $OUT/step.jsonl \
    > $OUT/step.log 2>&1
echo "rc=$?"; grep -E "probe=step|FAIL" $OUT/step.log | cut -c1-300
res=$OUT/res; mkdir -p $res
timeout -s TERM 150 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench.log 2>&1; echo "rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED|memory)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
