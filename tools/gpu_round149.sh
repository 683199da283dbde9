#!/usr/bin/env bash
# Twenty-eighth session, first call, on an NVIDIA H100: where the eager blockwise step's host time
# goes on the current code (cProfile of 30 steps at Qwen3-30B-A3B down, the whole profile kept),
# the layer probe as this session's baseline, and the aten operators a step dispatches.
source tools/gpu_round_common.sh
timeout -s TERM 150 python3 tools/probe_grouped_step.py --host-profile qwen3_down --host-only \
    --pstats $OUT/host_qwen3_down.pstats > $OUT/host_profile_qwen3_down.log 2>&1
echo "profile rc=$?"; grep host_ms $OUT/host_profile_qwen3_down.log
timeout -s TERM 240 python3 tools/probe_host_layers.py --shape qwen3_down --aten --out $OUT/layers.jsonl \
    > $OUT/layers.log 2>&1; echo "layers rc=$?"
grep host_layer $OUT/layers.log
