#!/usr/bin/env bash
# One device call: GPU tests of the fp8 saved-activation change (peak memory, pre-quantised wgrad
# on every backend) and of the grouped GEMM with int32 offsets; then the bf16 grouped sweep at 512
# tokens per expert again (offset change) and fp8 rowwise grouped at EP 16/32.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
pt() { local t=$1; shift; timeout -s TERM $t python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" "$@"; }
pt 120 -rP tests/test_fp8_saved_activation.py 2>&1 | tee $OUT/pytest_fp8_saved.log | grep -E "peak|passed|failed|FAILED|Error" | head -40
pt 150 -x tests/test_grouped_gemm.py tests/test_gpu_capture.py tests/test_gpu_fp8_paths.py 2>&1 | tee $OUT/pytest_grouped.log | tail -4
res=$OUT/res; mkdir -p $res
run() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout -s TERM $t python3 benchmarks/bench_grouped_gemm.py "$@" --target-ms 60 --tune-budget-ms 300 --out-dir $res 2>&1 | grep -v "^\[" | grep -A8 "^## Score" | grep "^| grouped" ; }
run 90 --dtype bf16 --ep 8,16,32 --tokens-per-expert 512 --name bf16_grouped_gemm_tpe512
run 150 --dtype fp8 --granularity rowwise --ep 16,32 --tokens-per-expert 4096 --name fp8_rowwise_grouped_gemm_ep16-32_tpe4096
(cd $OUT && tar czf results.tgz res && rm -rf res)
