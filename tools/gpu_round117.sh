#!/usr/bin/env bash
# Twenty-second session, fourth call (commit: see git log, "round 117 script"), on an NVIDIA H100:
# the blockwise fp8 whole op under gradient accumulation over every EP8 bench shape
# (probe_grouped_step.py --reuse presets:8:TOKENS): 8 micro-batches on one weight, its tiles made
# once (low_precision.reuse_quantized_weights) against made every step, against the bf16
# torch._grouped_mm step, in turns (3 rounds of 5 timings), per micro-batch. 4096 tokens per expert
# with balanced and skewed routing, 512 with balanced.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
for spec in "4096 balanced" "4096 skewed" "512 balanced"; do
  set -- $spec
  timeout -s TERM 200 python3 tools/probe_grouped_step.py --reuse presets:8:$1 --routing $2 --micro-batches 8 \
      --out $OUT/reuse_$1_$2.jsonl > $OUT/reuse_$1_$2.log 2>&1; echo "reuse $1 $2 rc=$?"
  grep -E "weight_reuse_geomean|FAIL|Error" $OUT/reuse_$1_$2.log | cut -c1-300
done
