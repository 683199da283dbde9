#!/usr/bin/env bash
# One device call: the blockwise grouped training step with quantisation reuse (dual quantiser):
# bit-exactness checks and step timings vs the per-GEMM quantisation and bf16 (probe_grouped_step),
# the grouped fp8 GPU tests (now through the reuse path), and the EP8 whole-op bench.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 tools/probe_grouped_step.py --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; cut -c1-400 $OUT/step.log | tail -30
timeout -s TERM 170 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_grouped_gemm.py -k "fp8 or graph or full_op" > $OUT/pytest_grouped.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest_grouped.log
res=$OUT/res; mkdir -p $res
timeout -s TERM 150 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench.log 2>&1; echo "rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED|memory)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
