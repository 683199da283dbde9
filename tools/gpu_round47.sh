#!/usr/bin/env bash
# One device call: the Gluon quantiser's transposed pass with 8 threads along the columns
# (ldmatrix.trans reads) as the default: the dual-quantiser GPU tests, the quantiser sweep (the
# old 16- and a 32-thread form as variants, every variant bit-checked), the EP8 blockwise bench.
# (Ran at commit 66dd77b; the 8-thread form was slower and was reverted, see dual_quantize_gluon.)
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py \
    -k "quantize_cells or gluon_dual" -p no:cacheprovider \
    > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -2 $OUT/pytest.log
timeout -s TERM 200 python3 tools/probe_grouped_step.py --sweep --shapes qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|probe=step|probe=quantisers" $OUT/probe.log | cut -c1-300; grep -c PASS $OUT/probe.log
res=$OUT/res; mkdir -p $res
timeout -s TERM 220 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "bench rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
