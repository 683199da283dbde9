#!/usr/bin/env bash
# Seventeenth session, last call: bind_cuda_context now marks a thread bound only once the driver
# reported a context (host code). The fresh-thread TMA launch test and the dual-quantiser tests
# on the final code.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -s TERM 240 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py tests/test_triton_gemm.py \
    -k "fresh_thread or gluon_dual or bind_cuda" -p no:cacheprovider --tb=short > $OUT/pytest_final.log 2>&1
echo "pytest rc=$?"; grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_final.log | cut -c1-300 | head -20
