#!/usr/bin/env bash
# One device call: the warp-specialised Gluon blockwise kernel in its grouped form (gluon-ws-r3:
# one kernel for dense and M-grouped, group bounds read on the device). Its dense GPU tests under a
# timeout (the kernel changed), then the grouped probe: float64 check over empty / one-row /
# unaligned groups, and DeepSeek-V3 8 x 4096 kernel-only timing against the Triton grouped kernel.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 150 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -x \
    tests/test_triton_gemm.py -k "gluonws and kernel" 2>&1 | tee $OUT/pytest_gluon_ws_r3.log | tail -8 || exit 1
timeout -s TERM 150 python3 tools/probe_gluon_ws.py --grouped --stages 4,6 --out $OUT/probe_gluon_ws_grouped.jsonl 2>&1 | tail -30
