#!/usr/bin/env bash
# One device call (gluon-ws-r8): launch overhead of the warp-specialised launcher (eager vs
# CUDA-graph replay vs host time per launch) at small and large shapes, then the grouped fp8 GPU
# tests (every recipe, CUDA-graph capture, full op) on r8's refactored tile code.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 60 python3 tools/probe_gluon_ws.py --overhead --tiles 256:3 \
    --shapes 4096x3584x3584,4096x4096x4096,4096x7168x16384 --out $OUT/ws_overhead.jsonl > $OUT/ws_overhead.log 2>&1
echo "rc=$?"; cut -c1-200 $OUT/ws_overhead.log
timeout -s TERM 190 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_grouped_gemm.py -k "fp8 or graph or full_op" > $OUT/pytest_grouped.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest_grouped.log
