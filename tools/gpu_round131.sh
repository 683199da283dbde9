#!/usr/bin/env bash
# Twenty-fourth session, seventh call, on an NVIDIA H100: after the review mend of the TRITON
# adapter's warp-specialised branches (_ws_for_operands), the grouped GPU tests that take them:
# default and pinned configs, token-major operands, the full op, every recipe, CUDA graphs.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 500 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -o addopts="" -rfE --tb=short \
    tests/test_triton_grouped_gemm.py tests/test_grouped_gemm.py > $OUT/pytest_grouped.log 2>&1
echo "pytest rc=$?"
grep -E "^E |^FAILED|^ERROR|passed|failed" $OUT/pytest_grouped.log | cut -c1-240 | head -20
