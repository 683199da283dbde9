#!/usr/bin/env bash
# Twenty-first session, fourth call (commit: see git log, "round 112 script"), on an NVIDIA H100:
# where a step's GPU time goes beyond its kernels. Round 109 (H200) summed 24.3 ms of kernels per
# fp8 step at DeepSeek-V3 up_gate EP8 and 30.8 ms per bf16 step, where the bench timed 25.3-25.7
# and 34.8 ms. Per step: the span from the first kernel's start to the last one's end, the time
# some kernel runs, the kernels' summed time, and the step timed as the bench times it.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 tools/probe_grouped_step.py --kernels dsv3_up_ep8,dsv3_down_ep8,qwen3_up,qwen3_down \
    --out $OUT/kernels.jsonl > $OUT/kernels.log 2>&1; echo "kernels rc=$?"
grep -E "kernels_span|kernels_total|kernel_seq" $OUT/kernels.log | cut -c1-220
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,power.draw --format=csv,noheader
