#!/usr/bin/env bash
# Thirty-first session, on an NVIDIA H100: round 164's MoE tuning again, the candidates now timed on
# near-balanced routing (checked on a random split as before), written over the shipped H100 DB's
# grouped keys; then round 165's probe of what the shipped DB gives against the platform default.
source tools/gpu_round_common.sh
export OUT
BUDGET_MS=600 TPES="4096 512" bash -c 'source tools/gpu_round164.sh' 2>&1 | grep -E "rc=|keys:"
python3 - <<'PY'
import json, os, pathlib
out = pathlib.Path(os.environ["OUT"])
f = pathlib.Path("turbo_dispatch/tuned/nvidia-h100-80gb-hbm3.jsonl")
keep = [l for l in f.read_text().splitlines() if '"op": "grouped_gemm' not in l]
f.write_text("\n".join(keep) + "\n")
PY
turbo-dispatch db merge -o $OUT/shipped_h100.jsonl turbo_dispatch/tuned/nvidia-h100-80gb-hbm3.jsonl \
    $OUT/moe_ep8_tpe4096.jsonl $OUT/moe_ep8_tpe512.jsonl | tail -1
cp $OUT/shipped_h100.jsonl turbo_dispatch/tuned/nvidia-h100-80gb-hbm3.jsonl
LIMIT=120 bash -c 'source tools/gpu_round165.sh' 2>&1 | grep -E "rc=|geomean"
