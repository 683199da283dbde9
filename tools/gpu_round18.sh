#!/usr/bin/env bash
# One device call: the chunked dual quantiser's launch sweep, its bit-exactness checks, and the
# blockwise grouped step with and without quantisation reuse vs bf16 (tools/probe_grouped_step.py).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 300 python3 tools/probe_grouped_step.py --sweep --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; cut -c1-400 $OUT/step.log | tail -40
