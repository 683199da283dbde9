#!/usr/bin/env bash
# One device call with the TMA-store epilogue as the default (gluon-ws-r7): the dense blockwise
# GEMM-only bench (every offered tile, fastest passing, against F.scaled_mm), the grouped blockwise
# whole-op EP8 sweep at 4096 tokens per expert, then the dense warp-specialised GPU tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
run() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout -s TERM $t python3 "$@" --tune-budget-ms 300 --out-dir $res > $OUT/last.log 2>&1; echo "rc=$?"; }
run 150 benchmarks/bench_gemm.py --dtype fp8 --granularity blockwise --mb 1
run 150 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 --tokens-per-expert 4096 --backends TRITON --target-ms 60 --name fp8_blockwise_grouped_gemm_ep8_tpe4096
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED|memory)" $f; awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
timeout -s TERM 230 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs \
    tests/test_triton_gemm.py -k "gluonws" > $OUT/pytest_gluonws.log 2>&1; echo "rc=$?"
tail -6 $OUT/pytest_gluonws.log
