#!/usr/bin/env bash
# Twelfth session, first call: gemm_fp8 on pre-quantised operands (GPU tests), the blockwise
# GEMM-only bench with the dispatched op's rows (default and autotuned) beside F.scaled_mm and our
# best tile, then the bf16 grouped sweeps re-measured under the current harness (in turns, host
# covered; last measured 2026-11-23 before both), scored per routing.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 -m pytest -q -p no:cacheprovider tests/test_gemm.py -k "prequantized and cuda" \
    > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; grep -E "^FAILED|passed|failed" $OUT/pytest.log | tail -8
res=$OUT/res; mkdir -p $res
timeout -s TERM 180 python3 benchmarks/bench_gemm.py --dtype fp8 --granularity blockwise --mb 1 --tune-budget-ms 300 \
    --out-dir $res > $OUT/bench_blockwise.log 2>&1; echo "blockwise rc=$?"
for t in 16384 512; do
  ep=$([ $t = 16384 ] && echo 16,32 || echo 8,16,32)
  timeout -s TERM 170 python3 benchmarks/bench_grouped_gemm.py --dtype bf16 --ep $ep --tokens-per-expert $t \
      --name bf16_grouped_gemm_tpe$t --target-ms 60 --tune-budget-ms 300 --out-dir $res \
      > $OUT/bench_grouped_$t.log 2>&1; echo "grouped bf16 tpe$t rc=$?"
done
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
