#!/usr/bin/env bash
# Thirty-first session, first call, on an NVIDIA H100: what a Gluon launch costs without Triton's
# per-call binding (the compiled kernel's launcher called directly), where the eager blockwise
# step's aten operators come from (grouped by their Python callers), and the whole cProfile.
source tools/gpu_round_common.sh
timeout -s TERM 200 python3 tools/probe_host_layers.py --shape qwen3_down --aten-stacks --out $OUT/layers.jsonl \
    > $OUT/layers.log 2>&1; echo "layers rc=$?"
grep host_layer $OUT/layers.log
timeout -s TERM 150 python3 tools/probe_grouped_step.py --host-profile qwen3_down --host-only \
    --pstats $OUT/host_qwen3_down.pstats > $OUT/host_profile_qwen3_down.log 2>&1
echo "profile rc=$?"; grep host_ms $OUT/host_profile_qwen3_down.log
