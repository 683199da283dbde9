#!/usr/bin/env bash
# Thirtieth session, on an NVIDIA H100: the EP8 blockwise whole op at DeepSeek-V3's shapes only
# (8 local experts x 4096 tokens, the shapes the blockwise forward target names), round
# 155's command restricted to that model, run twice, to see how firmly its 1.304x (round 155,
# geomean of its 6 cases) sits above 1.3x.
source tools/gpu_round_common.sh
res=$OUT/res; mkdir -p $res
for run in 1 2; do
  timeout -s TERM 270 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
      --tokens-per-expert 4096 --models deepseek-v3 --backends TRITON --target-ms 60 --tune-budget-ms 300 \
      --out-dir $res --name fp8_blockwise_dsv3_ep8_tpe4096_run$run > $OUT/bench_run$run.log 2>&1; echo "run $run rc=$?"
done
rm -f $res/*.png
