#!/usr/bin/env bash
# Twenty-eighth session, fourth call, on an NVIDIA H100: is the two-stream forks' host cost the
# allocator's record_stream bookkeeping? (tools/probe_host_alloc.py --record-only: wall time per
# eager step with the forks, the forks without record_stream, and no forks, in turns.)
source tools/gpu_round_common.sh
for s in qwen3_down qwen3_up; do
  timeout -s TERM 100 python3 tools/probe_host_alloc.py --shape $s --record-only --out $OUT/record_$s.jsonl > $OUT/record_$s.log 2>&1
  echo "record $s rc=$?"; grep -E "^probe" $OUT/record_$s.log | cut -c1-300
done
