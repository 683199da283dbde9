#!/usr/bin/env bash
# Sixteenth session, fourth call. The probe's sweep and bit checks: the staged token-run kernel
# with div_rn or the Newton reciprocal (_g_scale_reciprocal), and the three-pass kernel (row copy
# in its own pass over the shared tile, one quotient branch per tile for both copies).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 240 python3 tools/probe_grouped_step.py --sweep --shapes qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|Error" $OUT/probe.log | grep -v "tiles=True" | cut -c1-300
grep -E "check=dual_gluon" $OUT/probe.log | grep -c PASS
