#!/usr/bin/env bash
# Review mends of the eleventh session: a given amax is always used by the cast (the in-turn
# gradient's rows no longer take the one-pass kernel that recomputed it), shared cast constants
# and padded allocations, the probe's check covers the in-turn form. GPU quantiser bits (in-turn
# included), the fp8 paths and peak memory, then the fp8 rowwise and tensorwise benches.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemm.py -k quantize_bit_exact \
    tests/test_fp8_saved_activation.py tests/test_gpu_fp8_paths.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; grep -E "^FAILED|passed|failed" $OUT/pytest.log | tail -6
timeout -s TERM 90 python3 tools/probe_fp8_dense_step.py --skip quant,weight --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E '"check"|"profile"' $OUT/probe.jsonl | cut -c1-600 | head -8
res=$OUT/res; mkdir -p $res
for g in rowwise tensorwise; do
  timeout -s TERM 140 python3 benchmarks/bench_gemm.py --dtype fp8 --granularity $g --mb 1 --tune-budget-ms 300 \
      --out-dir $res > $OUT/bench_fp8_$g.log 2>&1; echo "fp8 $g rc=$?"
done
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)|memory" $f | head -5; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op " | grep -v linear_peak; done
rm -f $res/*.png $res/*tensorwise*.md
