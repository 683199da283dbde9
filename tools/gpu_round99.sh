#!/usr/bin/env bash
# Nineteenth session, eleventh call (commit: see git log, "round 99 script"): tools/debug_fp32_dual.py,
# then the failing test_grouped_gemm.py cases with TRANSPOSE_FIRST forced on (pytest plugin).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
timeout -s TERM 150 python3 tools/debug_fp32_dual.py > $OUT/debug.log 2>&1; echo "debug rc=$?"
grep -v "^\s*$" $OUT/debug.log | cut -c1-400 | tail -30
PYTHONPATH=$PWD/tools/round96_plugins timeout -s TERM 120 python3 -m pytest -q tests/test_grouped_gemm.py \
    -p no:cacheprovider --tb=line -p transpose_first_plugin -k "fp8_dtypes and cuda" > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; grep -E "^FAILED|passed|failed" $OUT/pytest.log | cut -c1-200
