#!/usr/bin/env bash
# Twenty-third session, fourth call, on an NVIDIA H100: the GPU test suite on this session's code
# (the adapter's unchecked launch of an already-checked default config, the candidate list built
# once per problem), run as four pytest processes side by side so that the whole suite fits one
# call (rounds 120-121 ran it in two serial halves and each was cut by its limit).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
run_part() {  # name, files...
  local name=$1; shift
  timeout -s TERM 540 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE --tb=short \
      --durations=5 "$@" > $OUT/pytest_$name.log 2>&1
  echo "part $name rc=$?"
}
run_part grouped tests/test_grouped_gemm.py tests/test_triton_grouped_gemm.py &
run_part triton_gemm tests/test_triton_gemm.py &
run_part fp8_paths tests/test_gpu_fp8_paths.py tests/test_fp8_saved_activation.py tests/test_weight_reuse.py &
run_part rest tests/test_gemm.py tests/test_blaslt_gemm.py tests/test_attention.py tests/test_moe.py \
    tests/test_gpu_capture.py tests/test_compile.py &
wait
for f in $OUT/pytest_*.log; do echo "== $(basename $f)"; grep -E "^E |^FAILED|^ERROR|passed|failed" $f | cut -c1-240 | head -12; done
