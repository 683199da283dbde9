#!/usr/bin/env bash
# Twenty-fourth session, second call, on an NVIDIA H100: the SM clock and board power each GEMM of
# the grouped step runs at, bf16 against fp8 (tools/probe_power_clocks.py), after round 125's ncu
# found our blockwise forward and cuBLAS's blockwise kernel both at ~1.47 GHz.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,power.max_limit,enforced.power.limit,temperature.gpu --format=csv
nvidia-smi --query-gpu=power.draw,clocks.sm,clocks_event_reasons.active --format=csv,noheader
cd tools
timeout -s TERM 400 python3 probe_power_clocks.py --out $OUT/power.jsonl 2>&1 | tee $OUT/power.log | cut -c1-400
echo "probe rc=$?"
