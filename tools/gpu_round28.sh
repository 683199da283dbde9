#!/usr/bin/env bash
# Closing device call of the seventh session, on the shipped defaults (warp-specialised wgrad
# gluon-wgrad-r2 at 4 stages): the grouped GPU tests that run it (float64 kernel test, every fp8
# recipe, CUDA graphs, the whole step in a graph, full op vs TORCH, the step's custom op and
# compiled path), the step probe eager and from a CUDA graph, and the EP8 whole-op bench.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 240 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_grouped_gemm.py tests/test_grouped_gemm.py \
    -k "wgrad or fp8_every_recipe or cuda_graph or full_op or step or compiled or custom_op" \
    > $OUT/pytest_grouped.log 2>&1; echo "rc=$?"
tail -3 $OUT/pytest_grouped.log
timeout -s TERM 120 python3 tools/probe_grouped_step.py --graphs --shapes dsv3_up,dsv3_down,qwen3_up,qwen3_down \
    --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; grep -E "probe=step|FAIL|Error" $OUT/step.log | cut -c1-300
res=$OUT/res; mkdir -p $res
timeout -s TERM 150 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench.log 2>&1; echo "rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED|memory)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
