#!/usr/bin/env bash
# Thirty-first session, on an NVIDIA H100: what the shipped DB (now with round 164's MoE grouped GEMM
# keys) gives a user who tunes nothing, against the platform default and the bf16 torch peer, whole
# training steps in turns (tools/probe_shipped_db.py); the DB validated on this machine first.
source tools/gpu_round_common.sh
turbo-dispatch db validate turbo_dispatch/tuned/nvidia-h100-80gb-hbm3.jsonl | tail -1; echo "validate rc=$?"
for spec in "fp8 4096" "bf16 512" "fp8 512" "bf16 4096"; do
    set -- $spec
    timeout -s TERM ${LIMIT:-150} python3 tools/probe_shipped_db.py --dtype $1 --ep 8 --tokens-per-expert $2 \
        --out $OUT/shipped_$1_ep8_tpe$2.jsonl > $OUT/shipped_$1_ep8_tpe$2.log 2>&1
    echo "probe $1 $2 rc=$?"; grep -E "geomean|FAIL|Error" $OUT/shipped_$1_ep8_tpe$2.log | head -5
done
