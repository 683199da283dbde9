#!/usr/bin/env bash
# Thirtieth session, first call, on an NVIDIA H100: the GPU-marked tests of the dense, attention,
# compile, capture and MoE files, in one run on the current code (the dense GEMM files last ran
# on a GPU in part, round 58). The grouped files run in round 158.
source tools/gpu_round_common.sh
timeout -s TERM 540 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -n 8 \
    tests/test_gemm.py tests/test_blaslt_gemm.py tests/test_attention.py tests/test_compile.py \
    tests/test_gpu_capture.py tests/test_moe.py \
    > $OUT/pytest_dense_attention.log 2>&1; echo "pytest rc=$?"; tail -6 $OUT/pytest_dense_attention.log
