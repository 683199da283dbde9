#!/usr/bin/env bash
# One device call with the dual quantiser's defaults: the grouped GPU tests (the step's custom op
# and compiled path on CUDA, every fp8 recipe, CUDA-graph capture, full op vs TORCH), the step
# probe (no sweep: the shipped launch table), and the EP8 whole-op bench of round 13 again.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 100 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_grouped_gemm.py -k "step or compiled or custom_op" > $OUT/pytest_step.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest_step.log
timeout -s TERM 170 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_grouped_gemm.py -k "fp8 or graph or full_op" > $OUT/pytest_grouped.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest_grouped.log
timeout -s TERM 120 python3 tools/probe_grouped_step.py --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; grep -E "probe=step|FAIL" $OUT/step.log | cut -c1-300
res=$OUT/res; mkdir -p $res
timeout -s TERM 150 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench.log 2>&1; echo "rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED|memory)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
