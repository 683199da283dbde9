#!/usr/bin/env bash
# One device call (record; the probe and the kernel it timed were dropped after this run and live
# in commit 64490b7): the dual quantiser's TMA kernel against the pointer kernel
# (tools/probe_dual_quantize.py: bits, then launches swept at the step's operand shapes), the
# grouped GPU tests that run the step and the default wgrad's fallback for token-major operands,
# and the step probe.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 tools/probe_dual_quantize.py --out $OUT/dual.jsonl > $OUT/dual.log 2>&1
echo "rc=$?"; grep -E "FAIL|Error|dual_best|kernel=pointer" $OUT/dual.log | cut -c1-300
grep -c "result=PASS" $OUT/dual.log
timeout -s TERM 180 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/test_triton_grouped_gemm.py \
    -k "default_wgrad or training_step or full_op or fp8_every_recipe" > $OUT/pytest.log 2>&1; echo "rc=$?"
tail -3 $OUT/pytest.log | cut -c1-300
timeout -s TERM 120 python3 tools/probe_grouped_step.py --shapes dsv3_up,dsv3_down,qwen3_up,qwen3_down \
    --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; grep -E "check=|probe=step|probe=quantisers|FAIL|Error" $OUT/step.log | cut -c1-300
