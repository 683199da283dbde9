#!/usr/bin/env bash
# One device call: the GPU tests of the warp-specialised 256-column tile (dense kernel against
# float64 over odd sizes and scale groupings; forward/dgrad/wgrad through the adapter), the
# grouped fp8 tests with it as the default (every recipe, odd/skewed/balanced routings, CUDA-graph
# capture, full op), then the dense blockwise GEMM-only bench, whose best-tile search now runs
# each tile on the kernel its `kernel` field names (it ran every tile on the Triton kernel before).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 230 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs \
    tests/test_triton_gemm.py -k "gluonws_128x256" > $OUT/pytest_gluonws_wide.log 2>&1; echo "rc=$?"
tail -6 $OUT/pytest_gluonws_wide.log
timeout -s TERM 190 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_grouped_gemm.py -k "fp8 or graph or full_op" > $OUT/pytest_grouped.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest_grouped.log
res=$OUT/res; mkdir -p $res
timeout -s TERM 150 python3 benchmarks/bench_gemm.py --dtype fp8 --granularity blockwise --mb 1 --tune-budget-ms 300 \
    --out-dir $res > $OUT/bench_blockwise.log 2>&1; echo "rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
