#!/usr/bin/env bash
# One device call: the dense bf16 GEMM bench at micro-batch 1 and the EP8 blockwise grouped bench
# after the time_rows fix (rounds 31-33 re-timed each shape's last variant in a block after the
# turns, overwriting its figures), dmon logging clocks and power.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
nvidia-smi dmon -s pc -d 1 -o T > $OUT/dmon.log 2>&1 &
DMON=$!
res=$OUT/res; mkdir -p $res
timeout -s TERM 160 python3 benchmarks/bench_gemm.py --dtype bf16 --mb 1 --tune-budget-ms 300 --out-dir $res \
    > $OUT/bench_bf16.log 2>&1; echo "rc=$?"
timeout -s TERM 250 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "rc=$?"
kill $DMON
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
