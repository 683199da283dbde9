#!/usr/bin/env bash
# One device call: the warp-specialised Gluon kernel's 256-column tile (two 128-column halves per
# math warpgroup) against its 128-column tile, the Triton tile and cuBLASLt. Each tile is first
# checked against float64 (dense: odd sizes, a wholly-out-of-range second half; grouped: empty,
# one-row and unaligned groups), then timed: dense at three shapes, grouped at DeepSeek-V3 8 x 4096.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 240 python3 tools/probe_gluon_ws.py --tiles 128:6,256:3,256:4 \
    --shapes 4096x7168x16384,4096x4096x7168,8192x14336x4096,4096x2048x7168 --out $OUT/ws_wide_dense.jsonl \
    2>&1 | tee $OUT/ws_wide_dense.log | grep -v '"PASS"' | tail -40
timeout -s TERM 200 python3 tools/probe_gluon_ws.py --grouped --tiles 128:4,256:3,256:4 --out $OUT/ws_wide_grouped.jsonl \
    2>&1 | tee $OUT/ws_wide_grouped.log | tail -40
