#!/usr/bin/env bash
# Sixteenth session, first call. The staged token-run quantiser (dual_quantize_gluon
# _dual_quantize_staged_kernel: 6 barriers per tile in its SASS against 28 for the shared-memory
# kernel) next to the shipped shared-memory kernel and the register kernel's best runs launch.
# (1) The dual-quantiser GPU tests. (2) The probe: every variant bit-checked against the Triton
# kernel, the sweep (median of 20), the Qwen3 down step check.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual" \
    -p no:cacheprovider --tb=short > $OUT/pytest_dual.log 2>&1; echo "pytest dual rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_dual.log | cut -c1-300 | head -20
timeout -s TERM 300 python3 tools/probe_grouped_step.py --sweep --shapes qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|probe=step|probe=quantisers|Error" $OUT/probe.log | cut -c1-300
