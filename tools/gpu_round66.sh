#!/usr/bin/env bash
# Fifteenth session, first call: the register-transposed Gluon dual quantiser
# (dual_quantize_gluon._dual_quantize_regs_kernel; not the default yet). (1) The dual-quantiser
# GPU tests, now with the register kernel for runs and 2-D tiles. (2) The probe: every Triton
# and Gluon variant bit-checked (check_dual, check_gluon_variants), the sweep timing each variant
# on the sweep operands next to a clone and a cast, then the DeepSeek-V3 up_gate step.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual" \
    -p no:cacheprovider --tb=short > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest.log | cut -c1-300 | head -20
timeout -s TERM 330 python3 tools/probe_grouped_step.py --sweep --shapes dsv3_up \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|probe=step|probe=quantisers|Error" $OUT/probe.log | cut -c1-300
