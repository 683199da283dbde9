#!/usr/bin/env bash
# Twenty-second session, fifth call (commit: see git log, "round 118 script"), on an NVIDIA H100:
# the session's final code: tests/test_grouped_gemm.py's GPU tests, the token-bucket and
# weight-reuse tests, and the host-time probe in its final form (the backward timed through
# host_us, with warm-up calls).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_gpu.log 2>&1
echo "pytest gpu rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_gpu.log | cut -c1-200 | head -12
timeout -s TERM 100 python3 -m pytest -q tests/test_token_buckets.py tests/test_weight_reuse.py -p no:cacheprovider \
    --tb=short > $OUT/pytest_buckets_reuse.log 2>&1
echo "pytest buckets+reuse rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_buckets_reuse.log | head -12
timeout -s TERM 200 python3 tools/probe_host_layers.py --shape qwen3_down --out $OUT/layers.jsonl \
    > $OUT/layers.log 2>&1; echo "layers rc=$?"
grep host_layer $OUT/layers.log
