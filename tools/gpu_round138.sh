#!/usr/bin/env bash
# Twenty-sixth session, second call, on an NVIDIA H100: the TORCH attention adapter's new
# FlashAttention path (backends/torch/flash_native.py) against the float64 reference (the
# attention GPU tests), its timings against the paths it replaces (tools/probe_attention.py), with
# dense calls now on the batch kernels (round 137 had them as packed sequences).
source tools/gpu_round_common.sh
source tools/gpu_attention_checks.sh
