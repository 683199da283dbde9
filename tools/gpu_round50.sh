#!/usr/bin/env bash
# One device call for issue 5: the fused two-way quantiser of the dense fp8 step (tensorwise /
# rowwise) and the strided-row routing fix. GPU tests of the quantisers and the fp8 op, the
# probe (bits, quantiser timings with a launch sweep, a profiled step), then the fp8 rowwise and
# tensorwise dense benches at micro-batch 1.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_gemm.py -k "quantize_bit_exact or fp8_fwd_dgrad" \
    tests/test_gpu_fp8_paths.py tests/test_fp8_saved_activation.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest.log
timeout -s TERM 120 python3 tools/probe_fp8_dense_step.py --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E '"check"|"profile"' $OUT/probe.jsonl | cut -c1-1500
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/probe.jsonl"):
    r = json.loads(line)
    if r["kind"] == "quant":
        print(r["shape"], r["gran"], "clone %.3f two %.3f both %.3f best %s  (%.0f vs clone %.0f GB/s)" % (
            r["clone_ms"], r["two_calls_ms"], r["both_default_ms"], r["best"], r["both_default_gbs"], r["clone_gbs"]))
PY
res=$OUT/res; mkdir -p $res
for g in rowwise tensorwise; do
  timeout -s TERM 150 python3 benchmarks/bench_gemm.py --dtype fp8 --granularity $g --mb 1 --tune-budget-ms 300 \
      --out-dir $res > $OUT/bench_fp8_$g.log 2>&1; echo "fp8 $g rc=$?"
done
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)|memory" $f | head -5; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op " | grep -v linear_peak; done
rm -f $res/*.png
