#!/usr/bin/env bash
# Twenty-third session, second call, on an NVIDIA H100: the GPU test suite outside the grouped
# GEMM files (dense GEMM, fp8 GEMM, BLAS-Lt, attention, MoE, capture, compile), the first full
# run of these files since round 32: the resolver (token buckets) and quantiser code they share
# changed since. Round 121 runs the grouped and fp8-path files.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 560 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE --tb=short --durations=12 \
    tests/test_gemm.py tests/test_triton_gemm.py tests/test_blaslt_gemm.py tests/test_attention.py tests/test_moe.py \
    tests/test_gpu_capture.py tests/test_compile.py > $OUT/pytest_gpu_a.log 2>&1
echo "pytest gpu A rc=$?"; grep -E "^E |^FAILED|^ERROR|passed|failed" $OUT/pytest_gpu_a.log | cut -c1-240 | head -30
