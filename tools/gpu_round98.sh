#!/usr/bin/env bash
# Nineteenth session, tenth call (commit: see git log, "round 98 script"): tools/debug_fp32_store.py.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
timeout -s TERM 200 python3 tools/debug_fp32_store.py > $OUT/debug.log 2>&1; echo "debug rc=$?"
grep -v "^\s*$" $OUT/debug.log | cut -c1-400 | tail -40
