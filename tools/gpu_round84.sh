#!/usr/bin/env bash
# Ran on commit c48c66d (PINGPONG in both kernels and the probes); reverted after this round: slower.
# Eighteenth session: the math warpgroups of both warp-specialised blockwise kernels take turns to
# issue their wgmmas (PINGPONG). (1) Each kernel of the fp8 step with PINGPONG off and on, at the
# EP8 bench's sizes, outputs and gradients compared bit for bit; (2) the wgrad kernel alone, off and
# on in turns, at the bench's routings.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
for r in balanced skewed; do
  shapes=dsv3_up_ep8,dsv3_down_ep8,qwen3_down,gptoss_down_ep8
  [ $r = skewed ] && shapes=qwen3_down,gptoss_down_ep8
  timeout -s TERM 150 python3 tools/probe_grouped_step.py --routing $r --pingpong 0,1 \
      --kernels $shapes --out $OUT/kernels_$r.jsonl \
      2>&1 | grep -E "check=|probe=kernel_seq|probe=kernels_total|Error|error" | grep -v "ms=0.00" | cut -c1-160
  echo "kernels $r rc=$?"
done
timeout -s TERM 200 python3 tools/probe_wgrad_ws.py --pingpong 0,1 --shapes dsv3_w13_ep8,qwen3_w13,qwen3_w2,gptoss_w2 \
    --routings balanced,bench_skewed,bench_empty --out $OUT/probe_wgrad.jsonl > $OUT/probe_wgrad.log 2>&1
echo "probe wgrad rc=$?"; grep -E "tflops|error|ok=False" $OUT/probe_wgrad.log | cut -c1-250
