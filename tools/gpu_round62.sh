#!/usr/bin/env bash
# Thirteenth session, last call, on the final code (the 256 x 128 wgrad pieces reverted; the wgrad
# kernel is gluon-wgrad-r3 again). (1) The float64 wgrad test and the default-wgrad tests.
# (2) The EP8 blockwise grouped whole op.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
timeout -s TERM 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_grouped_gemm.py -m gpu \
    -k "wgrad_warp_specialised or default_wgrad" --tb=short > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest.log | cut -c1-300 | head -20
timeout -s TERM 260 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
