#!/usr/bin/env bash
# Twentieth session, fourth call (commit: see git log, "round 108 script"): a weight's blockwise
# tiles made once for several micro-batches (low_precision.reuse_quantized_weights): (1) its
# tests on CUDA and test_grouped_gemm.py's GPU tests (the eager step's quantisation path changed);
# (2) probe_grouped_step.py --reuse: 8 micro-batches on one weight, tiles reused against made every
# step against the bf16 torch._grouped_mm peer, in turns, at 512 tokens per local expert (EP8) and
# at DeepSeek-V3's EP8 4096.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 60 python3 -m pytest -q tests/test_weight_reuse.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_reuse.log 2>&1
echo "pytest reuse rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_reuse.log | cut -c1-200 | head -12
timeout -s TERM 150 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_gpu.log 2>&1
echo "pytest gpu rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_gpu.log | cut -c1-200 | head -12
timeout -s TERM 300 python3 tools/probe_grouped_step.py --micro-batches 8 \
    --reuse dsv3_up_ep8_512,dsv3_down_ep8_512,qwen3_up_ep8_512,kimi_up_ep8_512,dsv3_up_ep8 \
    --out $OUT/reuse.jsonl > $OUT/reuse.log 2>&1
echo "reuse rc=$?"; grep -E "weight_reuse|Error|error" $OUT/reuse.log | cut -c1-300
