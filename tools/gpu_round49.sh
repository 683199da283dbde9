#!/usr/bin/env bash
# One device call after the review mends: the timing loops of the harness, the autotuner and the
# probe now go through host_cover.untimed_host_ms / covered_call; the quotient's step is one
# shared function. GPU capture tests (autotune on CUDA), a small dense bench, the probe's checks
# and one step, the dual-quantiser GPU tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -s TERM 100 python3 -m pytest -q -m gpu tests/test_gpu_capture.py tests/test_triton_grouped_gemm.py \
    -k "capture or quantize_cells or gluon_dual" -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -2 $OUT/pytest.log
res=$OUT/res; mkdir -p $res
timeout -s TERM 90 python3 benchmarks/bench_gemm.py --dtype bf16 --models llama3.1-8b --mb 1 --tune-budget-ms 50 \
    --out-dir $res > $OUT/bench.log 2>&1; echo "bench rc=$?"
for f in $res/*.md; do awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
timeout -s TERM 90 python3 tools/probe_grouped_step.py --shapes qwen3_down --out $OUT/probe.jsonl > $OUT/probe.log 2>&1
echo "probe rc=$?"; grep -E "FAIL|probe=step|probe=quantisers" $OUT/probe.log | cut -c1-250; grep -c PASS $OUT/probe.log
rm -f $res/*.png
