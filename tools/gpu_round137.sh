#!/usr/bin/env bash
# Twenty-sixth session, first call, on an NVIDIA H100: the TORCH attention adapter's new
# FlashAttention path (backends/torch/flash_native.py) against the float64 reference (the
# attention GPU tests), its timings against the paths it replaces (tools/probe_attention.py), and
# probe_grouped_step --graphs with fresh leaves for the capture.
source tools/gpu_round_common.sh
source tools/gpu_attention_checks.sh
timeout -s TERM 120 python3 probe_grouped_step.py --shapes qwen3_down --graphs --out $OUT/grouped_step.jsonl \
    > $OUT/grouped_step.log 2>&1; echo "grouped_step rc=$?"; grep -E "step_graph|Error" $OUT/grouped_step.log | cut -c1-220
