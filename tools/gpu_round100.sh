#!/usr/bin/env bash
# Nineteenth session, twelfth call (commit: see git log, "round 100 script"): tools/debug_fp32_dual.py
# with the float32 values transposed before the fp8 conversion, then tests/test_grouped_gemm.py's GPU
# and cuda cases and the Triton dual-quantiser GPU tests, on the rule (no plugin).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
timeout -s TERM 120 python3 tools/debug_fp32_dual.py > $OUT/debug.log 2>&1; echo "debug rc=$?"
grep -v "^\s*$" $OUT/debug.log | cut -c1-300 | tail -20
timeout -s TERM 250 python3 -m pytest -q tests/test_grouped_gemm.py -p no:cacheprovider --tb=line \
    -k "cuda or gpu" > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^FAILED|passed|failed" $OUT/pytest.log | cut -c1-200
timeout -s TERM 120 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=line \
    -k "dual or strips" > $OUT/pytest_dual.log 2>&1
echo "pytest dual rc=$?"; grep -E "^FAILED|passed|failed" $OUT/pytest_dual.log | cut -c1-200
