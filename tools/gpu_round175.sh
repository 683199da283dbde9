#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H200: the shipped H200 DB as committed (round 174's 30
# step-scoped grouped entries) read from the package against the platform default, whole bf16
# steps at EP8 x 512 on near-balanced routing, in turns.
source tools/gpu_round_common.sh
export OUT
turbo-dispatch db validate turbo_dispatch/tuned/nvidia-h200.jsonl turbo_dispatch/tuned/nvidia-h100-80gb-hbm3.jsonl
timeout -s TERM 100 python3 tools/probe_shipped_db.py --dtype bf16 --ep 8 --tokens-per-expert 512 --routing near-balanced \
    --out $OUT/shipped_bf16_near-balanced_ep8_tpe512.jsonl > $OUT/shipped_bf16_near-balanced_ep8_tpe512.log 2>&1
echo "probe rc=$?"; grep -E "geomean|FAIL|Error" $OUT/shipped_bf16_near-balanced_ep8_tpe512.log | cut -c1-400
