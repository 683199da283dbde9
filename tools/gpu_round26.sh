#!/usr/bin/env bash
# One device call: the dual quantiser with its passes unrolled and with L2 eviction hints (swept,
# bit-checked), the blockwise step eager and replayed from a CUDA graph (how much of it is host
# time), and the dense bf16 GEMM bench at micro-batch 1 (issue 5's bf16 target, not re-run since 11-22).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 tools/probe_grouped_step.py --sweep --graphs --shapes dsv3_up,qwen3_up,qwen3_down \
    --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; grep -E "dual_|probe=step|FAIL" $OUT/step.log | cut -c1-300
res=$OUT/res; mkdir -p $res
timeout -s TERM 150 python3 benchmarks/bench_gemm.py --dtype bf16 --mb 1 --tune-budget-ms 300 --out-dir $res \
    > $OUT/bench_bf16.log 2>&1; echo "rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
