#!/usr/bin/env bash
# Seventeenth session: where one fp8 step's GPU time goes at the EP8 bench's own sizes and
# routings, kernel by kernel in launch order (the forward and dgrad apart), fp8 against bf16;
# and the wgrad kernel alone at DeepSeek-V3's 32 local experts.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
for r in balanced skewed empty; do
  timeout -s TERM 120 python3 tools/probe_grouped_step.py --routing $r \
      --kernels dsv3_up_ep8,dsv3_down_ep8,qwen3_down,gptoss_down_ep8 --out $OUT/kernels_$r.jsonl \
      2>&1 | grep -E "probe=kernel_seq|probe=kernels_total|Error|error" | cut -c1-160; echo "kernels $r rc=$?"
done
timeout -s TERM 120 python3 tools/probe_wgrad_ws.py --flags 11 --shapes dsv3_w13_ep8 \
    --routings balanced,bench_skewed,bench_empty --out $OUT/probe_wgrad.jsonl > $OUT/probe_wgrad.log 2>&1
echo "probe wgrad rc=$?"; grep -E "tflops|error" $OUT/probe_wgrad.log | cut -c1-250
