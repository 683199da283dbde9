#!/usr/bin/env bash
# One device call: the dense GEMM families at every micro-batch (bf16, fp8 tensorwise, rowwise),
# each under its own time limit (the harness writes what it measured when stopped); results
# packed into $OUT/results.tgz.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
res=$OUT/res; mkdir -p $res
run() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout -s TERM $t python3 "$@" --out-dir $res 2>&1 | tail -22; }
run 300 benchmarks/bench_gemm.py --dtype bf16 --mb 1,2,4 --tune-budget-ms 300
run 120 benchmarks/bench_gemm.py --dtype fp8 --granularity tensorwise --mb 1 --tune-budget-ms 300
run 110 benchmarks/bench_gemm.py --dtype fp8 --granularity rowwise --mb 2,4 --models llama3.1-70b,llama3.1-405b,qwen2.5-72b --tune-budget-ms 300
(cd $OUT && tar czf results.tgz res && rm -rf res)
