#!/usr/bin/env bash
# One device call for the warp-specialised blockwise wgrad kernel (fp8_blockwise_wgrad_ws): its
# float64 GPU test, kernel-only timings against the Triton variable-K kernel, then the grouped fp8
# GPU tests that now run it as the wgrad's default (every recipe, CUDA graphs, full op vs TORCH).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 90 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -x \
    tests/test_triton_grouped_gemm.py -k "wgrad_warp_specialised" > $OUT/pytest_wgrad_ws.log 2>&1; echo "rc=$?"
tail -30 $OUT/pytest_wgrad_ws.log | grep -E "passed|failed|Error|assert" | head -20
timeout -s TERM 150 python3 tools/probe_wgrad_ws.py --out $OUT/wgrad_ws.jsonl > $OUT/wgrad_ws.log 2>&1
echo "rc=$?"; cut -c1-260 $OUT/wgrad_ws.log
timeout -s TERM 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_grouped_gemm.py -k "fp8 or graph or full_op or wgrad" > $OUT/pytest_grouped.log 2>&1; echo "rc=$?"
tail -15 $OUT/pytest_grouped.log | grep -E "passed|failed|Error|assert" | head -20
