#!/usr/bin/env bash
# Twenty-first session, second call (commit: see git log, "round 110 script"), on an NVIDIA H200:
# round 109 found the dual quantisers at 2.35-2.6 TB/s there, as on the H100, against a copy's
# 4.25 TB/s, so on this GPU they are not bound by the memory. Launch settings of the Gluon dual
# quantiser timed in turns, each bit-checked against the shipped one: the persistent TMA runs
# kernel's (ring stages, programs per SM, maxnreg) and the 2-D tiles kernel's (rows per thread,
# warps, maxnreg).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 420 python3 tools/probe_grouped_step.py --out $OUT/quantiser_sweep.jsonl --quantiser-sweep \
    "runs=1,4,96/2,3,96/2,3,128/1,5,96/1,3,128/2,2,168/3,2,128;tiles=16,4,0/16,4,128/8,8,0/8,8,96/4,16,0/32,2,0" \
    > $OUT/quantiser_sweep.log 2>&1; echo "sweep rc=$?"
grep -E "_sweep|error|Error" $OUT/quantiser_sweep.log | cut -c1-200
