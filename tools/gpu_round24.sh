#!/usr/bin/env bash
# One device call: the dual quantiser's launch order (COLS_FASTEST) and chunking swept with bit
# checks, then the blockwise training step (fwd + dgrad + wgrad through the public op, the
# warp-specialised wgrad at its new default) against bf16 at four shapes.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 240 python3 tools/probe_grouped_step.py --sweep --shapes dsv3_up,dsv3_down,qwen3_up,qwen3_down \
    --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; grep -E "dual_|probe=step|FAIL" $OUT/step.log | cut -c1-300
