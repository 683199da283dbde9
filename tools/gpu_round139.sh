#!/usr/bin/env bash
# Twenty-sixth session, third call, on an NVIDIA H100: the TORCH attention adapter's new
# FlashAttention path (backends/torch/flash_native.py) against the float64 reference (the
# attention GPU tests), its timings against the paths it replaces (tools/probe_attention.py), with
# dense lse calls that cuDNN serves now take its aten op, which returns the lse (round 139).
source tools/gpu_round_common.sh
timeout -s TERM 240 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfEs --tb=short \
    tests/test_attention.py > $OUT/pytest_attention.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^SKIPPED|^ERROR" $OUT/pytest_attention.log | cut -c1-220
cd tools
timeout -s TERM 200 python3 probe_attention.py > $OUT/attention.log 2>&1; echo "attention rc=$?"
sed -n '/== flash_attn_func/,$p' $OUT/attention.log | cut -c1-260
