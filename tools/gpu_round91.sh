#!/usr/bin/env bash
# Nineteenth session, third call (commit: see git log, "round 91 script"). Round 90: the TMA runs
# quantiser's tile order is best as shipped. Here its memory path in parts (no per-element
# arithmetic; both copies, the row copy, the transposed copy, neither), in turns, next to a clone
# and a read-only sum of the same operand.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 300 python3 tools/probe_grouped_step.py --stores --out $OUT/stores.jsonl > $OUT/stores.log 2>&1
echo "stores rc=$?"; grep -E "stores_sweep|Error|error" $OUT/stores.log | cut -c1-250
