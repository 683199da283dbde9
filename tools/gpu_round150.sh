#!/usr/bin/env bash
# Twenty-eighth session, second call, on an NVIDIA H100: why the eager blockwise step's
# allocations cost ~45 us of CPU each (tools/probe_host_alloc.py at Qwen3-30B-A3B down and
# DeepSeek-V3 down): the step's host time with its two-stream forks on and off, each allocation's
# CPU time under torch.profiler, and the same allocations alone.
source tools/gpu_round_common.sh
for s in qwen3_down dsv3_down; do
  timeout -s TERM 200 python3 tools/probe_host_alloc.py --shape $s --out $OUT/alloc_$s.jsonl > $OUT/alloc_$s.log 2>&1
  echo "alloc $s rc=$?"; grep -E "^probe" $OUT/alloc_$s.log | cut -c1-900
done
