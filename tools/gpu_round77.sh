#!/usr/bin/env bash
# Sixteenth session, last call: round 76's probe failed in its first backward ("invalid device
# context": Triton encoded the runs quantiser's TMA descriptor on the autograd thread before any
# context was current there); bind_cuda_context now runs before every TMA launch. (1) The
# dual-quantiser GPU tests and the fresh-thread test. (2) The probe's checks and step checks
# (DeepSeek-V3 up_gate first: a process whose first backward is the fp8 step). (3) The other
# grouped GPU tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 240 python3 tools/probe_grouped_step.py --shapes dsv3_up,qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "FAIL|error=[A-Z]|probe=step|Error" $OUT/probe.log | cut -c1-300; grep -c PASS $OUT/probe.log
timeout -s TERM 150 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual or fresh_thread" \
    -p no:cacheprovider --tb=short > $OUT/pytest_dual.log 2>&1; echo "pytest dual rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_dual.log | cut -c1-300 | head -20
timeout -s TERM 300 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "not quantize_cells and not gluon_dual and not fresh_thread" \
    -p no:cacheprovider --tb=short > $OUT/pytest_grouped.log 2>&1; echo "pytest grouped rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_grouped.log | cut -c1-300 | head -20
