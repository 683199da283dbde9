#!/usr/bin/env bash
# Twenty-third session, third call, on an NVIDIA H100: the rest of the GPU test suite (the
# grouped GEMM files, the fp8 paths, the saved fp8 activation, weight reuse, token buckets).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 560 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE --tb=short --durations=12 \
    tests/test_grouped_gemm.py tests/test_triton_grouped_gemm.py tests/test_gpu_fp8_paths.py \
    tests/test_fp8_saved_activation.py tests/test_weight_reuse.py > $OUT/pytest_gpu_b.log 2>&1
echo "pytest gpu B rc=$?"; grep -E "^E |^FAILED|^ERROR|passed|failed" $OUT/pytest_gpu_b.log | cut -c1-240 | head -30
timeout -s TERM 30 python3 -m pytest -q tests/test_token_buckets.py -p no:cacheprovider > $OUT/pytest_buckets.log 2>&1
echo "buckets rc=$?"; tail -1 $OUT/pytest_buckets.log
