#!/usr/bin/env bash
# One device call: the pipelined Gluon dual quantiser (cp.async, persistent): its launches swept
# against the one-tile Gluon kernel and the Triton kernel (host time now covered in the probe's
# timing), bit checks of every launch, a cProfile of the fp8 step's host side, the step at two
# shapes, and the Gluon quantiser GPU tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 400 python3 tools/probe_grouped_step.py --sweep --shapes dsv3_up,qwen3_down \
    --host-profile qwen3_down --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|probe=step|probe=quantisers|host_ms" $OUT/probe.log | cut -c1-400
timeout -s TERM 150 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "gluon_dual" -p no:cacheprovider \
    > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest.log
