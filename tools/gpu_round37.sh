#!/usr/bin/env bash
# One device call: the Gluon token-run quantiser (tiles stay on Triton) after round 36 chose it:
# bit checks on every launch (stop if any fails), the timed sweep, the step probe at Qwen3 down and
# DeepSeek-V3 up_gate, the GPU step tests, then the EP8 blockwise grouped bench (adaptive host cover).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 tools/probe_grouped_step.py --sweep --shapes qwen3_down,dsv3_up --out $OUT/probe.jsonl \
    > $OUT/probe.log 2>&1; rc=$?; echo "probe rc=$rc"
grep -E "dual_best|geomean|FAIL|probe=step |quantisers|Error|error" $OUT/probe.log | head -60
if [ $rc -ne 0 ]; then tail -30 $OUT/probe.log; exit 1; fi
timeout -s TERM 190 python3 -m pytest -q -x -m gpu tests/test_triton_grouped_gemm.py \
    -k "gluon_dual or training_step or full_op or every_recipe" -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
tail -2 $OUT/pytest.log
res=$OUT/res; mkdir -p $res
timeout -s TERM 200 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
