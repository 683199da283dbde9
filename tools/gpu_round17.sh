#!/usr/bin/env bash
# One short device call: the warp-specialised launcher's host time per call after caching the
# descriptor layouts (shared_layout), against cuBLASLt through torch, at two small shapes.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -s TERM 50 python3 tools/probe_gluon_ws.py --overhead --tiles 256:3 \
    --shapes 4096x3584x3584,4096x4096x4096 --out $OUT/ws_overhead2.jsonl > $OUT/ws_overhead2.log 2>&1
echo "rc=$?"; cut -c1-200 $OUT/ws_overhead2.log
