#!/usr/bin/env bash
# One device call: the lean quotient (no per-element select; the Gluon kernels also skip the
# rescaling and the upper clamp where no scale is tiny): bit checks of every path against
# quantize_cells, the quantiser sweep (Triton, one-tile Gluon, pipelined Gluon), the step at two
# shapes, and the dual-quantiser GPU tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 150 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual" \
    -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest.log
timeout -s TERM 380 python3 tools/probe_grouped_step.py --sweep --shapes dsv3_up,qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|probe=step|probe=quantisers" $OUT/probe.log | cut -c1-300
grep -c PASS $OUT/probe.log
