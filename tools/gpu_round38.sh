#!/usr/bin/env bash
# One device call: the autotuner's timing now covers each candidate's host time (host_cover);
# the EP8 blockwise grouped bench and the dense bf16 bench at micro-batch 1, dmon logging.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
nvidia-smi dmon -s pc -d 1 -o T > $OUT/dmon.log 2>&1 &
DMON=$!
res=$OUT/res; mkdir -p $res
timeout -s TERM 220 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "rc=$?"
timeout -s TERM 170 python3 benchmarks/bench_gemm.py --dtype bf16 --mb 1 --tune-budget-ms 300 --out-dir $res \
    > $OUT/bench_bf16.log 2>&1; echo "rc=$?"
kill $DMON
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
