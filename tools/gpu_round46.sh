#!/usr/bin/env bash
# One device call for issue 5: the fp8 tensorwise and rowwise dense benches (full op against the
# torch recipe and against bf16 torch.matmul, memory line), micro-batch 1.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
for g in rowwise tensorwise; do
  timeout -s TERM 150 python3 benchmarks/bench_gemm.py --dtype fp8 --granularity $g --mb 1 --tune-budget-ms 300 \
      --out-dir $res > $OUT/bench_fp8_$g.log 2>&1; echo "fp8 $g rc=$?"
done
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)|memory" $f | head -5; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op " | grep -v linear_peak; done
rm -f $res/*.png
