#!/usr/bin/env bash
# Twentieth session, first call (commit: see git log, "round 105 script"): the backward's dgrad
# beside its wgrad switched on (grouped_gemm.BACKWARD_SIDE_BY_SIDE = True) behind the
# ``overlappable`` gate: (1) tests/test_grouped_gemm.py's GPU-marked tests (round 104 failed five of
# them under the old is_compiling-only gate); (2) test_triton_grouped_gemm.py's CUDA-graph,
# full-op, every-recipe, two-stream and default-wgrad tests; (3) the EP8 blockwise whole op.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "from turbo_dispatch.ops import grouped_gemm as g; print('BACKWARD_SIDE_BY_SIDE', g.BACKWARD_SIDE_BY_SIDE)"
timeout -s TERM 150 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_gpu.log 2>&1
echo "pytest gpu rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_gpu.log | cut -c1-200 | head -12
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "cuda_graph or full_op or every_recipe or side_by_side or default_wgrad" > $OUT/pytest_grouped.log 2>&1
echo "pytest grouped rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_grouped.log | cut -c1-200 | head -12
res=$OUT/res; mkdir -p $res
timeout -s TERM 230 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
