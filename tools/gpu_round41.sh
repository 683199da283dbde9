#!/usr/bin/env bash
# One device call: dual-quantiser GPU tests (every path against quantize_cells, the column-order
# launch included); the quantiser sweep with the one-tile kernel's launch order and a clone/cast
# bandwidth reference on the same operands; the EP8 blockwise grouped bench with the lean
# quotient and the one-tile launch (32, 32, 4).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual" \
    -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest.log
timeout -s TERM 200 python3 tools/probe_grouped_step.py --sweep --shapes dsv3_up \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|probe=step|probe=quantisers|bandwidth_reference" $OUT/probe.log | cut -c1-300
res=$OUT/res; mkdir -p $res
timeout -s TERM 220 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "bench rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
