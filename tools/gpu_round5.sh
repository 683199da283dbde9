#!/usr/bin/env bash
# One device call: the warp-specialised Gluon blockwise kernel after loading scales one K block
# ahead (gluon-ws-r2): its GPU tests under a timeout, then tools/probe_gluon_ws.py (pipeline depth
# x scale look-ahead against cuBLASLt and the Triton tile, GEMM only).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 170 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -x \
    tests/test_triton_gemm.py -k "gluonws" 2>&1 | tee $OUT/pytest_gluon_ws_r2.log | tail -15 || exit 1
timeout -s TERM 200 python3 tools/probe_gluon_ws.py --out $OUT/probe_gluon_ws_r2.jsonl 2>&1 | tail -40
