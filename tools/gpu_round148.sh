#!/usr/bin/env bash
# Twenty-seventh session, seventh call, on an NVIDIA H100: the attention GPU tests on the final code
# (after the second review mend: one eager-path choice, the recomputing flash backward removed).
source tools/gpu_round_common.sh
timeout -s TERM 300 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfEs --tb=short \
    tests/test_attention.py > $OUT/pytest_attention.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^SKIPPED|^ERROR" $OUT/pytest_attention.log | cut -c1-220
grep -E "^E " $OUT/pytest_attention.log | head -30 | cut -c1-220
