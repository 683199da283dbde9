#!/usr/bin/env bash
# Twenty-ninth session, second call, on an NVIDIA H100: the EP8 blockwise whole op at 4096 tokens per
# local expert (round 105's command) on this session's code, to keep the standing figure current
# (round 105 ran before the host-side changes of sessions 21-29; no GPU kernel changed since).
source tools/gpu_round_common.sh
res=$OUT/res; mkdir -p $res
timeout -s TERM 420 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
