#!/usr/bin/env bash
# Nineteenth session, fifteenth call (commit: see git log, "round 103 script"): the blockwise step
# with the backward's dgrad on a side stream beside its wgrad (BACKWARD_SIDE_BY_SIDE, off by
# default) against without, in turns, balanced and skewed, at the EP8 bench's sizes.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
S=qwen3_down,qwen3_up,gptoss_down_ep8,dsv3_down_ep8,dsv3_up_ep8
for r in balanced skewed; do
  timeout -s TERM 170 python3 tools/probe_grouped_step.py --backward-pairs $S --routing $r \
      --out $OUT/bwd_pairs_$r.jsonl > $OUT/bwd_pairs_$r.log 2>&1; echo "$r rc=$?"
  grep -E "backward_pair|Error|error" $OUT/bwd_pairs_$r.log | cut -c1-300
done
