#!/usr/bin/env bash
# One device call (gluon-ws-r8): the dense 256-column warp-specialised tile splits a short last
# wave into 128-column halves (_split_tail). float64 checks (a split case with a half wholly past
# N among them), then split against whole at shapes whose last wave is short (N = 3584 / 4608 /
# 28672) and two whose is not (the refactor's regression check); the grouped kernel (same tile
# code, no split) checked and timed again; then the dense kernel GPU tests of the default tile.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 190 python3 tools/probe_gluon_ws.py --tiles 256:3,256:3:whole,256:4,256:4:whole \
    --shapes 4096x3584x18944,4096x4608x3584,4096x3584x3584,4096x28672x4096,4096x7168x16384,4096x4096x4096 \
    --out $OUT/ws_split_dense.jsonl > $OUT/ws_split_dense.log 2>&1; echo "rc=$?"
grep -c "status=PASS" $OUT/ws_split_dense.log; grep -v "status=PASS" $OUT/ws_split_dense.log | cut -c1-120 | tail -40
timeout -s TERM 75 python3 tools/probe_gluon_ws.py --grouped --tiles 256:4 \
    --out $OUT/ws_split_grouped.jsonl > $OUT/ws_split_grouped.log 2>&1; echo "rc=$?"; cut -c1-140 $OUT/ws_split_grouped.log | tail -9
timeout -s TERM 130 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs \
    tests/test_triton_gemm.py -k "gluonws_128x256x128_s3 and blockwise_kernel" > $OUT/pytest_gluonws_split.log 2>&1
echo "rc=$?"; tail -6 $OUT/pytest_gluonws_split.log
