#!/usr/bin/env bash
# One device call: the grouped kernels' GPU tests (wgrad rewrite gg-r3), the blockwise fp8 GEMM
# kernel variants (tools/probe_fp8_blockwise.py) and the wgrad kernel probe; JSON lines under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 170 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider -o addopts="" 2>&1 | tee $OUT/pytest_grouped.log | tail -6
timeout -s TERM 190 python3 tools/probe_fp8_blockwise.py --out $OUT/blockwise.jsonl > $OUT/blockwise.log 2>&1
grep -E "BEST|production|cublaslt|ERROR" $OUT/blockwise.log | cut -c1-200
timeout -s TERM 150 python3 tools/probe_triton_grouped.py --wgrad --budget 110 --out $OUT/wgrad.jsonl > $OUT/wgrad.log 2>&1
tail -30 $OUT/wgrad.log | cut -c1-220
