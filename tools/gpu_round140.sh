#!/usr/bin/env bash
# Twenty-sixth session, fourth call, on an NVIDIA H100: tools/probe_attention.py with the
# "before" column forcing both new paths off, and which kernel returning an lse (cuDNN's aten op,
# FlashAttention-2) is faster at which shape (round 139: cuDNN at B=2 S=4096, not at B=8 S=1024).
source tools/gpu_round_common.sh
cd tools
timeout -s TERM 300 python3 probe_attention.py > $OUT/attention.log 2>&1; echo "attention rc=$?"
sed -n '/== flash_attn_func/,$p' $OUT/attention.log | grep -v "TORCH: \|varlen_attn (" | cut -c1-260
