#!/usr/bin/env bash
# Issue 5, after round 51: the tensorwise two-way cast writes its transposed copy from its own
# division (round 51 caught wrong bytes for float32 inputs), launch shapes from the round-51 sweeps.
# GPU quantiser bit tests (bf16 and float32 inputs), probe check + profile, then the fp8 rowwise
# and tensorwise dense benches at micro-batch 1.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_gemm.py -k "quantize_bit_exact" > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -2 $OUT/pytest.log
timeout -s TERM 120 python3 tools/probe_fp8_dense_step.py --skip quant,weight --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E '"check"|"profile"' $OUT/probe.jsonl | cut -c1-700 | head -12
res=$OUT/res; mkdir -p $res
for g in rowwise tensorwise; do
  timeout -s TERM 150 python3 benchmarks/bench_gemm.py --dtype fp8 --granularity $g --mb 1 --tune-budget-ms 300 \
      --out-dir $res > $OUT/bench_fp8_$g.log 2>&1; echo "fp8 $g rc=$?"
done
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)|memory" $f | head -5; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op " | grep -v linear_peak; done
rm -f $res/*.png
