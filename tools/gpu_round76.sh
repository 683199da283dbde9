#!/usr/bin/env bash
# Sixteenth session: the runs quantiser now takes its persistent TMA form by default (TMA_RUNS
# (1, 4, maxnreg 96); round 75: 0.160 vs 0.168 ms geomean for one program per tile).
# (1) The dual-quantiser GPU tests. (2) The probe: TMA launches (1, 4/5/6 programs per SM, 2 stages)
# bit-checked and swept, the step checks. (3) Per-kernel time of one step. (4) The EP8 blockwise
# whole op, 28 cases. (5) The other grouped GPU tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual" -p no:cacheprovider --tb=short \
    > $OUT/pytest_dual.log 2>&1; echo "pytest dual rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_dual.log | cut -c1-300 | head -20
timeout -s TERM 300 python3 tools/probe_grouped_step.py --sweep --shapes dsv3_up,qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|probe=step|probe=quantisers|Error" $OUT/probe.log | cut -c1-300
timeout -s TERM 80 python3 tools/probe_grouped_step.py --kernels dsv3_up,qwen3_down --out $OUT/kernels.jsonl \
    2>&1 | grep -E "probe=|Error|error" | cut -c1-200; echo "kernels rc=$?"
res=$OUT/res; mkdir -p $res
timeout -s TERM 300 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "not quantize_cells and not gluon_dual" \
    -p no:cacheprovider --tb=short > $OUT/pytest_grouped.log 2>&1; echo "pytest grouped rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_grouped.log | cut -c1-300 | head -20
