#!/usr/bin/env bash
# Fourteenth session, last call, on the final code (the wgrad kernel back at gluon-wgrad-r3).
# (1) The quantiser bit test (quantize.py's NaN-carrying max is now one helper, `_nan_max`).
# (2) Which kernels one blockwise step runs, and for how long (torch.profiler, the spin that
# covers host time left out), at DeepSeek-V3 up_gate and Qwen3 down, against the bf16 step.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 300 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemm.py -m gpu -k quantize_bit_exact \
    --tb=short > $OUT/pytest_bits.log 2>&1; echo "pytest bits rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_bits.log | cut -c1-300 | head -10
timeout -s TERM 150 python3 tools/probe_grouped_step.py --kernels dsv3_up,qwen3_down --out $OUT/kernels.jsonl \
    2>&1 | grep -E "probe=|Error|error" | cut -c1-200; echo "kernels rc=$?"
