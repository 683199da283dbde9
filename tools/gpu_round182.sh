#!/usr/bin/env bash
# Thirty-fourth session, on an NVIDIA H100: issue 6's blockwise whole op at DeepSeek-V3's EP8 x 4096
# shapes on the code that lands (round 162's command, twice), for the closing note's own figure.
source tools/gpu_round_common.sh
res=$OUT/res; mkdir -p $res
for run in 1 2; do
  timeout -s TERM 80 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
      --tokens-per-expert 4096 --models deepseek-v3 --backends TRITON --target-ms 60 --tune-budget-ms 300 \
      --out-dir $res --name fp8_blockwise_dsv3_ep8_tpe4096_run$run > $OUT/bench_run$run.log 2>&1; echo "run $run rc=$?"
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $res/*run$run.md | grep "^| [a-z]" | grep -v "^| op " | cut -d'|' -f3,5,8-11
done
rm -f $res/*.png
