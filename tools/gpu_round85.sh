#!/usr/bin/env bash
# Ran on commit f1f11bb (backends/triton/sass_yield.py and probe_grouped_step --yield); both removed after this round: every rewrite was slower.
# Eighteenth session: the promotion bursts of the warp-specialised blockwise kernels made to yield
# the warp scheduler by a cubin rewrite (backends/triton/sass_yield.py: the yield flag cleared, and
# the reuse flags with it, on part of each FFMA/FMUL burst). Each kernel of the fp8 step under each
# rewrite (tools/probe_grouped_step.py --yield), in two turns, outputs and gradients bit-compared.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
for r in balanced skewed; do
  shapes=dsv3_up_ep8,qwen3_down,gptoss_down_ep8,dsv3_down_ep8
  [ $r = skewed ] && shapes=qwen3_down,dsv3_up_ep8
  timeout -s TERM 240 python3 tools/probe_grouped_step.py --routing $r --yield $shapes --out $OUT/yield_$r.jsonl \
      2>&1 | grep -E "check=|probe=yield_kernel|Error|error|Traceback" | cut -c1-220
  echo "yield $r rc=$?"
done
