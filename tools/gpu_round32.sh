#!/usr/bin/env bash
# One device call: the step's GPU tests after the b_rows fix (the step in a CUDA graph, full op vs
# TORCH; round 31 ran out of time after every fp8 recipe passed), then the dense bf16 GEMM bench at
# micro-batch 1 and the EP8 blockwise grouped bench timed in turns with a warm call per turn
# (round 31's turns re-resolved every dispatch decision inside the timed calls), dmon logging.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
nvidia-smi dmon -s pc -d 1 -o T > $OUT/dmon.log 2>&1 &
DMON=$!
timeout -s TERM 120 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/test_triton_grouped_gemm.py \
    -k "training_step or full_op" > $OUT/pytest.log 2>&1; echo "rc=$?"
tail -3 $OUT/pytest.log | cut -c1-300
res=$OUT/res; mkdir -p $res
timeout -s TERM 160 python3 benchmarks/bench_gemm.py --dtype bf16 --mb 1 --tune-budget-ms 300 --out-dir $res \
    > $OUT/bench_bf16.log 2>&1; echo "rc=$?"
timeout -s TERM 250 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "rc=$?"
kill $DMON
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
