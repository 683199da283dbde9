#!/usr/bin/env bash
# Twelfth session, last call. (1) The blockwise GEMM-only bench with the dispatched op pinned per
# backend (round 58's unpinned "default" row resolved to the autotuned pick once that row had
# stored it). (2) The EP8 blockwise grouped whole op re-measured on this code (last: round 44),
# for the bound analysis of tools/fp8_grouped_bound.py on the same run's bf16 step times.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
timeout -s TERM 200 python3 benchmarks/bench_gemm.py --dtype fp8 --granularity blockwise --mb 1 --tune-budget-ms 300 \
    --out-dir $res > $OUT/bench_blockwise.log 2>&1; echo "blockwise rc=$?"
timeout -s TERM 240 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
