#!/usr/bin/env bash
# One device call after the warp-specialised 256-column tile became the sm_90 blockwise default
# (dense and grouped): the Gluon GPU tests (dense kernel against float64 over odd sizes and every
# scale grouping; forward/dgrad/wgrad through the adapter), the grouped fp8 tests (every recipe,
# odd/skewed/balanced routings, CUDA-graph capture, full op), then the blockwise benches: dense
# GEMM only at micro-batch 1 and the grouped EP8 4096-token sweep (whole op, autotuned).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 170 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_gemm.py -k "gluonws" 2>&1 | tee $OUT/pytest_gluonws.log | tail -4
timeout -s TERM 130 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_grouped_gemm.py -k "fp8 or graph or full_op" 2>&1 | tee $OUT/pytest_grouped.log | tail -4
res=$OUT/res; mkdir -p $res
run() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout -s TERM $t python3 "$@" --tune-budget-ms 300 --out-dir $res > $OUT/last.log 2>&1; echo "rc=$?"; }
run 90 benchmarks/bench_gemm.py --dtype fp8 --granularity blockwise --mb 1
run 120 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 --tokens-per-expert 4096 --backends TRITON --target-ms 60 --name fp8_blockwise_grouped_gemm_ep8_tpe4096
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED|memory)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
