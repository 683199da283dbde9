#!/usr/bin/env bash
# Twenty-eighth session, third call, on an NVIDIA H100: what an eager training loop sees of the
# blockwise step (tools/probe_host_alloc.py: wall time per step back to back, GPU time, the caching
# allocator's counters, the two-stream forks on and off, the bf16 step) at four shapes.
source tools/gpu_round_common.sh
for s in qwen3_down qwen3_up dsv3_down dsv3_up; do
  timeout -s TERM 130 python3 tools/probe_host_alloc.py --shape $s --reps 10 --out $OUT/alloc_$s.jsonl > $OUT/alloc_$s.log 2>&1
  echo "alloc $s rc=$?"; grep -E "^probe=(wall|host_us_alloc|empties)" $OUT/alloc_$s.log | cut -c1-400
done
