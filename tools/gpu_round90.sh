#!/usr/bin/env bash
# Nineteenth session, second call (commit: see git log, "round 90 script"). Round 89 showed the
# token-run quantiser's arithmetic is not its bound (no per-element arithmetic: 1.02x). Here the
# persistent TMA runs kernel's tile order (RUNS_GROUP_R row blocks walked down per column block)
# with the shipped quotient and with none, in turns, bit-checked; then the dual-quantiser tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 300 python3 tools/probe_grouped_step.py --order --out $OUT/order.jsonl > $OUT/order.log 2>&1
echo "order rc=$?"; grep -E "order_sweep|Error|error" $OUT/order.log | cut -c1-250
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "dual" > $OUT/pytest_dual.log 2>&1; echo "pytest dual rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_dual.log | cut -c1-300 | head -20
