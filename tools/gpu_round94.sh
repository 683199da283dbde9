#!/usr/bin/env bash
# Nineteenth session, sixth call (commit: see git log, "round 94 script"). (1) The TMA runs
# quantiser's strip rule (widest of 8/4/2 column blocks giving every program 12 units, else one
# tile per unit) against one tile per unit and each width forced, in turns, bit-checked; (2) the
# forward's two quantisations serial vs on two streams; (3) the EP8 blockwise bench on this code.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 150 python3 tools/probe_grouped_step.py --spans --out $OUT/spans.jsonl > $OUT/spans.log 2>&1
echo "spans rc=$?"; grep -E "span_sweep|Error|error" $OUT/spans.log | cut -c1-250
timeout -s TERM 120 python3 tools/probe_grouped_step.py --pairs --out $OUT/pairs.jsonl > $OUT/pairs.log 2>&1
echo "pairs rc=$?"; grep -E "pair_sweep|Error|error" $OUT/pairs.log | cut -c1-400
res=$OUT/res; mkdir -p $res
timeout -s TERM 220 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
