#!/usr/bin/env bash
# Sixteenth session, last call: the grouped GEMM GPU tests on the final code, the dual-quantiser
# tests first (round 73's run of the whole file hit its 300 s limit with no failure seen).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual" \
    -p no:cacheprovider --tb=short > $OUT/pytest_dual.log 2>&1; echo "pytest dual rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_dual.log | cut -c1-300 | head -20
timeout -s TERM 420 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "not quantize_cells and not gluon_dual" \
    -p no:cacheprovider --tb=short --durations=8 > $OUT/pytest_grouped.log 2>&1; echo "pytest grouped rc=$?"
grep -E "^E |^FAILED|passed|failed|Error|s call" $OUT/pytest_grouped.log | cut -c1-300 | head -30
