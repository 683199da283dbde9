#!/usr/bin/env bash
# One device call: the dual quantiser's runs mode with fewer registers (chunks of 16-32 rows, a
# register cap, the two quantisations computed one after the other), swept with bit checks, then
# the blockwise step (eager and from a CUDA graph) with the fastest launch.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 240 python3 tools/probe_grouped_step.py --sweep --graphs --shapes dsv3_up,dsv3_down,qwen3_up,qwen3_down \
    --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; grep -E "dual_|probe=step|FAIL|Error" $OUT/step.log | cut -c1-300
