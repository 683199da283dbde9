#!/usr/bin/env bash
# Sixteenth session. The persistent TMA form of the runs kernel (a ring of tiles filled by TMA
# copies while the current tile is quantised), bit-checked and swept next to the one-program-per-
# tile runs kernel: (stages, programs per SM) (2, 3), (1, 4), (3, 2), (2, 2).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 240 python3 tools/probe_grouped_step.py --sweep --shapes qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|Error|probe=step" $OUT/probe.log | grep -v "tiles=True" | cut -c1-300
grep -E "dual_sweep .*runs" $OUT/probe.log | grep -v "tiles=True" | cut -c1-200
grep -E "check=dual_gluon" $OUT/probe.log | grep -c PASS
