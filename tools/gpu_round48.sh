#!/usr/bin/env bash
# One device call on the session's final code: the dual-quantiser GPU tests, the probe's bit
# checks (every Gluon launch against Triton, every Triton launch against quantize_cells), the
# step at Qwen3-30B-A3B down and a host profile of it.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual" \
    -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -2 $OUT/pytest.log
timeout -s TERM 150 python3 tools/probe_grouped_step.py --shapes qwen3_down --host-profile qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "FAIL|error=[A-Z]|probe=step|probe=quantisers|host_ms" $OUT/probe.log | cut -c1-300; grep -c PASS $OUT/probe.log
