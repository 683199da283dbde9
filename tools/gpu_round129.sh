#!/usr/bin/env bash
# Twenty-fourth session, fifth call, on an NVIDIA H100: the GPU tests of the Triton/Gluon grouped
# and dense GEMM files on this session's code (a pinned or tuned warp-specialised config is now
# checked once by the adapter and launched directly), spread over 8 pytest-xdist workers so that
# their kernel compiles run side by side (one process reached 37 of 50 grouped tests in 420 s).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 570 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -o addopts="" -rfE --tb=short \
    --durations=8 tests/test_triton_grouped_gemm.py tests/test_triton_gemm.py > $OUT/pytest_triton.log 2>&1
echo "pytest rc=$?"
grep -E "^E |^FAILED|^ERROR|passed|failed|slowest|s call" $OUT/pytest_triton.log | cut -c1-240 | head -30
