#!/usr/bin/env bash
# Twentieth session, third call (commit: see git log, "round 107 script"): the blockwise whole op
# beyond EP8 x 4096 tokens, on the code of round 105 (the dgrad beside the wgrad on): EP16 and
# EP32 at 4096 tokens per local expert, then EP8/16/32 at 512 (each sweep under its own limit;
# the bench writes the cases it finished).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
for sweep in "16,32 4096 ep16_32_tpe4096" "8,16,32 512 ep8_16_32_tpe512"; do
  set -- $sweep
  timeout -s TERM 280 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep $1 \
      --tokens-per-expert $2 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
      --name fp8_blockwise_grouped_gemm_$3 > $OUT/bench_$3.log 2>&1; echo "$3 rc=$?"
done
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED|models|skipped)" $f | cut -c1-200 | head -4
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
