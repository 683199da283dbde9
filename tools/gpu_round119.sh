#!/usr/bin/env bash
# Twenty-third session, first call, on an NVIDIA H100: where the eager blockwise step's host time
# goes now (cProfile of 30 steps at Qwen3-30B-A3B down and DeepSeek-V3 up_gate, the whole profile
# kept), and the layer probe as the baseline of this session's host-time work.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
for s in qwen3_down dsv3_up; do
  timeout -s TERM 150 python3 tools/probe_grouped_step.py --host-profile $s --pstats $OUT/host_$s.pstats \
      > $OUT/host_profile_$s.log 2>&1; echo "profile $s rc=$?"; grep host_ms $OUT/host_profile_$s.log
done
timeout -s TERM 200 python3 tools/probe_host_layers.py --shape qwen3_down --out $OUT/layers.jsonl \
    > $OUT/layers.log 2>&1; echo "layers rc=$?"
grep host_layer $OUT/layers.log
