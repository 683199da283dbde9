#!/usr/bin/env bash
# One device call per part: the grouped GEMM benchmark over EP 8/16/32, tokens per expert 512 to
# 16384 and the three routings, each sweep under its own time limit and report name (the harness
# writes what it measured when stopped); results packed into $OUT/results.tgz.
#   part bf16: bf16 sweeps and fp8 rowwise at EP 8;  part fp8: the other fp8 sweeps.
set -o pipefail
export PYTHONUNBUFFERED=1
part=${1:?usage: bench_gpu_grouped.sh bf16|fp8}
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
res=$OUT/res; mkdir -p $res
run() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout -s TERM $t python3 benchmarks/bench_grouped_gemm.py "$@" --target-ms 60 --tune-budget-ms 300 --out-dir $res > $OUT/last.log 2>&1; echo "rc=$?"; grep -v "^\[" $OUT/last.log | tail -4; }
if [ "$part" = bf16 ]; then
  run 180 --dtype bf16 --ep 8,16,32 --tokens-per-expert 4096 --name bf16_grouped_gemm_tpe4096
  run 150 --dtype bf16 --ep 8,16,32 --tokens-per-expert 512 --name bf16_grouped_gemm_tpe512
  run 150 --dtype bf16 --ep 16,32 --tokens-per-expert 16384 --name bf16_grouped_gemm_tpe16384
  run 80 --dtype fp8 --granularity rowwise --ep 8 --tokens-per-expert 4096 --name fp8_rowwise_grouped_gemm_ep8_tpe4096
else
  run 130 --dtype bf16 --ep 8,16,32 --tokens-per-expert 512 --name bf16_grouped_gemm_tpe512
  run 150 --dtype fp8 --granularity blockwise --ep 8,16,32 --tokens-per-expert 4096 --name fp8_blockwise_grouped_gemm_tpe4096
  run 100 --dtype fp8 --granularity rowwise --ep 8,32 --tokens-per-expert 512,16384 --name fp8_rowwise_grouped_gemm_tpe512-16384
  run 100 --dtype fp8 --granularity blockwise --ep 8,32 --tokens-per-expert 512,16384 --name fp8_blockwise_grouped_gemm_tpe512-16384
fi
for f in $res/*.md; do echo "## $f"; grep -E "^\| grouped|INTERRUPTED|elapsed" $f | head -9; done
(cd $OUT && tar czf results.tgz res && rm -rf res)
