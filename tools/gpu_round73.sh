#!/usr/bin/env bash
# Sixteenth session, final call, on the final code: the runs kernel (the staged design, fixed at
# (32, 32, 4, maxnreg 96)) and the tiles kernel; the shared-memory kernel, the three-pass kernel,
# the register kernel's runs path and the fast-scale/reciprocal options deleted. (1) The grouped
# GEMM GPU tests. (2) The probe: every Gluon launch bit-checked, the sweep, the step checks at
# DeepSeek-V3 up_gate and Qwen3 down. (3) Per-kernel time of one step. (4) The EP8 blockwise whole
# op, 28 cases, as rounds 68 and 70.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 300 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_grouped.log 2>&1; echo "pytest grouped rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_grouped.log | cut -c1-300 | head -20
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
