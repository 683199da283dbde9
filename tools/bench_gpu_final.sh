#!/usr/bin/env bash
# One device call: the dense GEMM families (bf16 at micro-batches 1, 2, 4; fp8 tensorwise,
# rowwise, blockwise at micro-batch 1, each with its Linear peak-memory line) and the fp8 blockwise
# grouped GEMM at EP 8, 4096 tokens per expert (TRITON and autotune; TORCH only emulates it).
# Results are packed after every sweep, so a call stopped by its time limit keeps what it measured.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
res=$OUT/res; mkdir -p $res
pack() { (cd $OUT && tar czf results.tgz res); }
run() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout -s TERM $t python3 "$@" --tune-budget-ms 300 --out-dir $res > $OUT/last.log 2>&1; echo "rc=$?"; grep -E "memory:|INTERRUPTED" $OUT/last.log | head -3; pack; }
run 170 benchmarks/bench_gemm.py --dtype bf16 --mb 1,2,4
run 85 benchmarks/bench_gemm.py --dtype fp8 --granularity tensorwise --mb 1
run 85 benchmarks/bench_gemm.py --dtype fp8 --granularity rowwise --mb 1
run 85 benchmarks/bench_gemm.py --dtype fp8 --granularity blockwise --mb 1
run 110 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 --tokens-per-expert 4096 --backends TRITON --target-ms 60 --name fp8_blockwise_grouped_gemm_ep8_tpe4096
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED|memory)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -rf $res
