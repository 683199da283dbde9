#!/usr/bin/env bash
# One device call: the GEMM and grouped-GEMM benchmark families, each under its own time limit
# (the harness writes what it measured when stopped), results packed into $OUT/results.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
res=$OUT/res; mkdir -p $res
run() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout -s TERM $t python3 "$@" --out-dir $res 2>&1 | tail -25; }
run 150 benchmarks/bench_gemm.py --dtype bf16 --mb 1 --tune-budget-ms 300
run 90 benchmarks/bench_gemm.py --dtype fp8 --granularity rowwise --mb 1 --tune-budget-ms 300
run 90 benchmarks/bench_gemm.py --dtype fp8 --granularity blockwise --mb 1 --tune-budget-ms 300
run 110 benchmarks/bench_grouped_gemm.py --dtype bf16 --models deepseek-v3,mixtral-8x7b,qwen3-30b-a3b --ep 8 --tokens-per-expert 4096 --tune-budget-ms 300
run 45 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity rowwise --models deepseek-v3 --ep 8 --tokens-per-expert 4096 --routings balanced,skewed --tune-budget-ms 300
run 55 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --models deepseek-v3 --ep 8 --tokens-per-expert 4096 --routings balanced --tune-budget-ms 300
(cd $OUT && tar czf results.tgz res && rm -rf res)
