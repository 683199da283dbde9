#!/usr/bin/env bash
# Nineteenth session, fourteenth call (commit: see git log, "round 102 script"), the final code:
# (1) the float32 dual-quantiser test (no NaN cell now), the strips, two-stream and dual tests;
# (2) the EP8 blockwise whole op, 28 cases, as rounds 82 and 94.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 150 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "dual or strips or float32 or side_by_side" > $OUT/pytest_dual.log 2>&1
echo "pytest dual rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_dual.log | cut -c1-200 | head -12
res=$OUT/res; mkdir -p $res
timeout -s TERM 230 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
