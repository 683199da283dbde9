#!/usr/bin/env bash
# One device call: the TMA-store epilogue of the warp-specialised blockwise kernel (each math
# warpgroup stages its half-tile in shared memory and TMA-stores it, not waiting) against the
# masked pointer stores: float64 checks (fp32 and bf16 output, odd N on the pointer path) then
# timings, dense over K = 3584..16384 and grouped DeepSeek-V3; then the dense Gluon GPU tests
# with the new default (3-stage 256-column tile, scales in shared memory, TMA stores).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 230 python3 tools/probe_gluon_ws.py --tiles 256:3,256:3:ptr,256:4,256:4:ptr,128:5,128:6:ptr \
    --shapes 4096x7168x16384,4096x4096x4096,4096x12288x4096,4096x4608x3584,4096x28672x4096,4096x8192x8192 \
    --out $OUT/ws_tma_dense.jsonl > $OUT/ws_tma_dense.log 2>&1; echo "rc=$?"
grep -c "status=PASS" $OUT/ws_tma_dense.log; grep -v "status=PASS" $OUT/ws_tma_dense.log | cut -c1-150 | tail -45
timeout -s TERM 110 python3 tools/probe_gluon_ws.py --grouped --tiles 256:4,256:4:ptr,256:3,128:4 \
    --out $OUT/ws_tma_grouped.jsonl > $OUT/ws_tma_grouped.log 2>&1; echo "rc=$?"; cut -c1-150 $OUT/ws_tma_grouped.log | tail -24
timeout -s TERM 170 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs \
    tests/test_triton_gemm.py -k "gluonws" > $OUT/pytest_gluonws_tma.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest_gluonws_tma.log
