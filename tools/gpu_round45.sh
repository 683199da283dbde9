#!/usr/bin/env bash
# One device call for issue 5: the dense bf16 bench over the 63 shapes (micro-batches 1, 2, 4;
# timed in turns, host time covered) for the per-shape floor, and the fp8 blockwise dense bench.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
timeout -s TERM 400 python3 benchmarks/bench_gemm.py --dtype bf16 --mb 1,2,4 --tune-budget-ms 300 --out-dir $res \
    --name bf16_gemm_mb124 > $OUT/bench_bf16.log 2>&1; echo "bf16 rc=$?"
timeout -s TERM 100 python3 benchmarks/bench_gemm.py --dtype fp8 --granularity blockwise --mb 1 --tune-budget-ms 300 \
    --out-dir $res > $OUT/bench_fp8_blockwise.log 2>&1; echo "fp8 blockwise rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)|memory" $f | head -5; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
