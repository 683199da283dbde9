#!/usr/bin/env bash
# Twenty-fourth session, third call, on an NVIDIA H100: the blockwise fp8 grouped step against
# bf16 as the bench times it (flush + host-covering spin before each call) and under sustained
# load (CUDA-graph replays back to back, alternating segments), same process
# (tools/probe_sustained_step.py), after round 126 found every GEMM at the 700 W cap when run
# back to back.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,power.draw,clocks.sm,temperature.gpu --format=csv,noheader
cd tools
timeout -s TERM 560 python3 probe_sustained_step.py --out $OUT/sustained.jsonl 2>&1 | tee $OUT/sustained.log | grep -v '"segment"' | cut -c1-400
echo "probe rc=$?"
