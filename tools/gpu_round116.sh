#!/usr/bin/env bash
# Twenty-second session, third call (commit: see git log, "round 116 script"), on an NVIDIA H100:
# grouped GEMMs' token buckets (OpSpec.shared_problem) on the GPU: tests/test_grouped_gemm.py's
# GPU tests and the bucket tests, then autotuning under dropless routing
# (tools/probe_dropless_tuning.py, M_total redrawn every step within +-10%) with buckets and with
# exact keys, blockwise fp8 and bf16, at Qwen3-30B-A3B down (EP8, 4096 tokens per expert).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_gpu.log 2>&1
echo "pytest gpu rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_gpu.log | cut -c1-200 | head -12
timeout -s TERM 60 python3 -m pytest -q tests/test_token_buckets.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_buckets.log 2>&1
echo "pytest buckets rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_buckets.log | cut -c1-200 | head -12
timeout -s TERM 150 python3 tools/probe_dropless_tuning.py --shape qwen3_down --steps 30 \
    --out $OUT/dropless_fp8.jsonl > $OUT/dropless_fp8.log 2>&1; echo "dropless fp8 rc=$?"
grep dropless_tuning $OUT/dropless_fp8.log
timeout -s TERM 120 python3 tools/probe_dropless_tuning.py --shape qwen3_down --steps 30 --bf16 \
    --out $OUT/dropless_bf16.jsonl > $OUT/dropless_bf16.log 2>&1; echo "dropless bf16 rc=$?"
grep dropless_tuning $OUT/dropless_bf16.log
