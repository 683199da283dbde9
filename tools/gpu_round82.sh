#!/usr/bin/env bash
# Seventeenth session, on the final wgrad code (work-item counter and word-wise edge zeroing the
# only paths): (1) the EP8 blockwise whole op, 28 cases, as rounds 76 and 80; (2) the grouped GPU
# tests other than the wgrad ones round 80 ran (CUDA graphs with changing routing, the training
# step in a CUDA graph, the full op against torch, every fp8 recipe, the fresh-thread TMA launch),
# then the wgrad ones again.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
timeout -s TERM 200 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
timeout -s TERM 300 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "cuda_graph or full_op or fresh_thread or every_recipe or wgrad" > $OUT/pytest_grouped.log 2>&1
echo "pytest grouped rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_grouped.log | cut -c1-300 | head -20
