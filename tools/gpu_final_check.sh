#!/usr/bin/env bash
# The whole GPU test suite (time-limited), then the fp8 benchmark families whose autotuned rows
# depend on the autotune budget rule, re-run after fixing it.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
timeout -s TERM 320 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -x -o addopts="" 2>&1 | tee $OUT/pytest_gpu.log | tail -15
res=$OUT/res; mkdir -p $res
run() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout -s TERM $t python3 "$@" --out-dir $res 2>&1 | grep -v "^\[" | tail -12; }
run 100 benchmarks/bench_gemm.py --dtype fp8 --granularity rowwise --mb 1 --tune-budget-ms 300
run 45 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity rowwise --models deepseek-v3 --ep 8 --tokens-per-expert 4096 --routings balanced,skewed --tune-budget-ms 300
run 40 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --models deepseek-v3 --ep 8 --tokens-per-expert 4096 --routings balanced --tune-budget-ms 300
(cd $OUT && tar czf results.tgz res && rm -rf res)
