#!/usr/bin/env bash
# Nineteenth session, thirteenth call (commit: see git log, "round 101 script"): a float32 weight's
# transposed fp8 copy now comes from torch's copy of its row copy; tools/debug_fp32_dual.py, then
# tests/test_grouped_gemm.py's GPU and cuda cases (the TORCH-pinned _scaled_grouped_mm test now
# pinned), the new float32 dual-quantiser test and the dual/strips tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
timeout -s TERM 120 python3 tools/debug_fp32_dual.py > $OUT/debug.log 2>&1; echo "debug rc=$?"
grep -v "^\s*$" $OUT/debug.log | cut -c1-300 | tail -8
timeout -s TERM 250 python3 -m pytest -q tests/test_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "cuda or gpu" > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest.log | cut -c1-200 | head -12
timeout -s TERM 150 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "dual or strips or float32 or side_by_side" > $OUT/pytest_dual.log 2>&1
echo "pytest dual rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_dual.log | cut -c1-200 | head -12
