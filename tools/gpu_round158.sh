#!/usr/bin/env bash
# Thirtieth session, second call: the GPU-marked tests of the Triton, grouped, fp8-path,
# saved-activation and weight-reuse files, in one run on the current code (round 157 ran the rest).
source tools/gpu_round_common.sh
timeout -s TERM 540 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -n 8 \
    tests/test_triton_gemm.py tests/test_triton_grouped_gemm.py tests/test_grouped_gemm.py \
    tests/test_gpu_fp8_paths.py tests/test_fp8_saved_activation.py tests/test_weight_reuse.py \
    > $OUT/pytest_triton_grouped.log 2>&1; echo "pytest rc=$?"; tail -6 $OUT/pytest_triton_grouped.log
