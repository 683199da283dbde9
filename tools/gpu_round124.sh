#!/usr/bin/env bash
# Twenty-third session, sixth call, on an NVIDIA H100: the GPU tests round 122 did not reach on
# this session's code (its grouped and Triton-GEMM parts were cut by their limit): all of
# tests/test_triton_grouped_gemm.py, and the last 60 GPU tests of tests/test_triton_gemm.py,
# side by side.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -m pytest --co -q -m gpu -p no:cacheprovider -o addopts="" tests/test_triton_gemm.py 2>/dev/null \
    | grep "::" | tail -60 > /tmp/tail_ids
timeout -s TERM 420 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE --tb=short \
    tests/test_triton_grouped_gemm.py > $OUT/pytest_triton_grouped.log 2>&1 &
timeout -s TERM 420 python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfE --tb=short \
    $(cat /tmp/tail_ids) > $OUT/pytest_triton_gemm_tail.log 2>&1 &
wait
for f in $OUT/pytest_*.log; do echo "== $(basename $f)"; grep -E "^E |^FAILED|^ERROR|passed|failed" $f | cut -c1-240 | head -12; done
