#!/usr/bin/env bash
# Nineteenth session, fourth call (commit: see git log, "round 92 script"). Round 91: the TMA runs
# quantiser's time is its read (2.8 TB/s alone) plus its writes (~2.1 TB/s marginal), not
# overlapped. Here: the same parts with and without the row scales' writes (4-byte writes into a
# [rows, column blocks] array, a partial 32-byte sector each), shipped quotient and none, in turns.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 300 python3 tools/probe_grouped_step.py --stores --out $OUT/stores.jsonl > $OUT/stores.log 2>&1
echo "stores rc=$?"; grep -E "stores_sweep|Error|error" $OUT/stores.log | cut -c1-250
