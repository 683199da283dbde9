#!/usr/bin/env bash
# Nineteenth session, fifth call (commit: see git log, "round 93 script"). Round 92: the token-run
# quantiser's row-scale writes (a 4-byte store per row per tile into [rows, column blocks]) cost
# 1.10x at DeepSeek-V3's EP8 operands. Strips (RUNS_SPAN column blocks per work unit, their row
# scales kept in shared memory and written as one vector store per row; rows padded to 16
# floats): (1) widths 0/2/4/8/16 in turns, bit-checked against one tile per unit; (2) the dual
# tests and the compiled step on the GPU; (3) the EP8 blockwise bench at the default width 8.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 tools/probe_grouped_step.py --spans --out $OUT/spans.jsonl > $OUT/spans.log 2>&1
echo "spans rc=$?"; grep -E "span_sweep|Error|error" $OUT/spans.log | cut -c1-250
timeout -s TERM 150 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "dual" > $OUT/pytest_dual.log 2>&1; echo "pytest dual rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_dual.log | cut -c1-300 | head -20
timeout -s TERM 150 python3 -m pytest -q tests/test_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "compiled_matches_eager and blockwise" > $OUT/pytest_compile.log 2>&1; echo "pytest compile rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_compile.log | cut -c1-300 | head -20
res=$OUT/res; mkdir -p $res
timeout -s TERM 220 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
