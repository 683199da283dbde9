#!/usr/bin/env bash
# Twenty-sixth session, third call, on an NVIDIA H100: the TORCH attention adapter's new
# FlashAttention path (backends/torch/flash_native.py) against the float64 reference (the
# attention GPU tests), its timings against the paths it replaces (tools/probe_attention.py), with
# dense lse calls that cuDNN serves now take its aten op, which returns the lse (round 139).
# Round 138's commands on the new code.
exec bash tools/gpu_round138.sh
