#!/usr/bin/env bash
# One device call: what the warp-specialised wgrad loses under skewed routing. The same routings
# with every group rounded to 128 tokens (no edge steps) and edge steps without the barrier
# between the math warpgroups, next to the Triton kernel; the float64 GPU test with every variant.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 150 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -x \
    tests/test_triton_grouped_gemm.py -k "wgrad_warp_specialised" > $OUT/pytest_wgrad_ws.log 2>&1; echo "rc=$?"
tail -30 $OUT/pytest_wgrad_ws.log | grep -E "passed|failed|Error|assert" | head -20
timeout -s TERM 150 python3 tools/probe_wgrad_ws.py --shapes dsv3_w13,qwen3_w13,qwen3_w2 \
    --routings balanced,skewed,skewed_aligned,empty,empty_aligned --out $OUT/wgrad_ws.jsonl > $OUT/wgrad_ws.log 2>&1
echo "rc=$?"; cut -c1-250 $OUT/wgrad_ws.log | sed 's/g=[0-9]* tokens=[0-9]* //; s/ rel=[^ ]* ok=True//'
