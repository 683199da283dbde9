#!/usr/bin/env bash
# Twenty-sixth session, fifth call, on an NVIDIA H100: after the review mend (the TORCH attention
# adapter asks the cuDNN-lse gate once per call; one describe() for the cuDNN lse path), the
# attention GPU tests.
source tools/gpu_round_common.sh
timeout -s TERM 240 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfEs --tb=short \
    tests/test_attention.py > $OUT/pytest_attention.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/pytest_attention.log | cut -c1-220
