#!/usr/bin/env bash
# Thirty-fourth session, on an NVIDIA H100: issue 6's blockwise whole op at DeepSeek-V3's EP8 x 4096
# shapes on the code that lands: round 162's script (the same bench command, twice), then each run's
# score tables. (As run in round 182 the script held its own copy of round 162's loop with an 80 s
# limit per run; each run finished inside it.)
bash tools/gpu_round162.sh
for f in $OUT/res/*.md; do echo "## $f"
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op " | cut -d'|' -f3,5,8-11; done
