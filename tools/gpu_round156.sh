#!/usr/bin/env bash
# Twenty-ninth session, third call, on an NVIDIA H100: what an eager loop of blockwise fp8 grouped
# steps sees when each step is one CUDA graph replayed instead (tools/probe_host_alloc.py
# --graphed): wall per step of 50 back to back, eager against graphed, fp8 and bf16, in turns, at
# the host-bound Qwen3-30B-A3B shapes and the GPU-bound DeepSeek-V3 down.
source tools/gpu_round_common.sh
for shape in qwen3_down qwen3_up dsv3_down; do
  timeout -s TERM 150 python3 tools/probe_host_alloc.py --shape $shape --graphed --out $OUT/graphed_$shape.jsonl \
      > $OUT/graphed_$shape.log 2>&1
  echo "$shape rc=$?"; grep "probe=graphed" $OUT/graphed_$shape.log | sed 's/probe=graphed //' | cut -c1-200
done
