#!/usr/bin/env bash
# One device call: the dense bf16 GEMM bench over the whole shape set (micro-batches 1, 2 and 4),
# variants timed in turns with a warm call per turn, dmon logging clocks and power.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
nvidia-smi dmon -s pc -d 1 -o T > $OUT/dmon.log 2>&1 &
DMON=$!
res=$OUT/res; mkdir -p $res
timeout -s TERM 540 python3 benchmarks/bench_gemm.py --dtype bf16 --mb 1,2,4 --tune-budget-ms 300 --out-dir $res \
    --name bf16_gemm_mb124 > $OUT/bench_bf16.log 2>&1; echo "rc=$?"
kill $DMON
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
