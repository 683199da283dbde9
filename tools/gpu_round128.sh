#!/usr/bin/env bash
# Twenty-fourth session, fourth call, on an NVIDIA H100: a plain-CUDA dual token-run quantiser
# (tools/cuda_probe/dual_quantize_runs.cu) checked against float32 and the library's Gluon
# kernel, and timed in turns with it and a clone (tools/probe_cuda_quantizer.py); then the
# multicast probe again through the shared loader (tools/cuda_probe/cubin.py), one shape.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,power.draw,clocks.sm,temperature.gpu --format=csv,noheader
cd tools
timeout -s TERM 300 python3 probe_cuda_quantizer.py --out $OUT/quantizer.jsonl 2>&1 | tee $OUT/quantizer.log | cut -c1-400
echo "quantizer rc=$?"
timeout -s TERM 120 python3 probe_cuda_multicast.py --shapes 8192x4096x7168 --turns 3 --out $OUT/mc/multicast.jsonl 2>&1 | grep '"time"' | cut -c1-200
echo "multicast rc=$?"
