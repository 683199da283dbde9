#!/usr/bin/env bash
# Twenty-first session, third call (commit: see git log, "round 111 script"), on an NVIDIA H100:
# (1) the host side of one eager fp8 blockwise step at Qwen3-30B-A3B down (EP8, 4096 tokens per
# expert) under cProfile, the whole profile kept; (2) the blockwise whole op at 16384 tokens per
# local expert (EP8/16/32, cases above 131072 routed tokens skipped by the bench), last measured
# on 2026-11-23's code.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 tools/probe_grouped_step.py --host-profile qwen3_down --host-only \
    --pstats $OUT/host_qwen3_down.pstats --out $OUT/host.jsonl > $OUT/host.log 2>&1; echo "host rc=$?"
grep -E "host_ms" $OUT/host.log
res=$OUT/res; mkdir -p $res
timeout -s TERM 420 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8,16,32 \
    --tokens-per-expert 16384 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_16_32_tpe16384 > $OUT/bench_16384.log 2>&1; echo "16384 rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED|models|skipped)" $f | cut -c1-300 | head -4
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
