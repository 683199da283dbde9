#!/usr/bin/env bash
# Fifteenth session, second call. 2-D tiles now go to the register-transposed Gluon quantiser
# (REGS_LAUNCH (16, 4, 0, 1), 0.097 vs 0.119 ms geomean for Triton in round 66); token runs stay
# on the shared-memory Gluon kernel while the register kernel's runs variants (lean arm, column
# pieces, two conversions per side) are swept. (1) The dual-quantiser GPU tests and the quantiser
# bit test (quantize.py's _flagged_max). (2) The probe: every variant bit-checked, the sweep, the
# DeepSeek-V3 up_gate and Qwen3 down steps. (3) The per-kernel time of one step.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual" \
    -p no:cacheprovider --tb=short > $OUT/pytest_dual.log 2>&1; echo "pytest dual rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_dual.log | cut -c1-300 | head -20
timeout -s TERM 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemm.py -m gpu -k quantize_bit_exact \
    --tb=short > $OUT/pytest_bits.log 2>&1; echo "pytest bits rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_bits.log | cut -c1-300 | head -10
timeout -s TERM 240 python3 tools/probe_grouped_step.py --sweep --shapes dsv3_up,qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|probe=step|probe=quantisers|Error" $OUT/probe.log | cut -c1-300
timeout -s TERM 80 python3 tools/probe_grouped_step.py --kernels dsv3_up,qwen3_down --out $OUT/kernels.jsonl \
    2>&1 | grep -E "probe=|Error|error" | cut -c1-200; echo "kernels rc=$?"
