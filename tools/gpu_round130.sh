#!/usr/bin/env bash
# Twenty-fourth session, sixth call, on an NVIDIA H100: a short run of each probe of rounds 125-128
# after they were moved onto the shared helpers (tools/probe_record.py, tools/cuda_probe/cubin.py),
# to check that they still run and give the same kind of figures; plus probe_attention.py.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,power.draw,clocks.sm,temperature.gpu --format=csv,noheader
cd tools
timeout -s TERM 120 python3 probe_cuda_multicast.py --shapes 8192x4096x7168 --turns 2 --out $OUT/mc/multicast.jsonl 2>&1 | grep '"time"' | cut -c1-160; echo "multicast rc=$?"
timeout -s TERM 120 python3 probe_cuda_quantizer.py --shapes 65536x2048 --turns 2 --out $OUT/q/quantizer.jsonl 2>&1 | cut -c1-200; echo "quantizer rc=$?"
timeout -s TERM 120 python3 probe_power_clocks.py --seconds 0.6 --out $OUT/power.jsonl 2>&1 | cut -c1-260; echo "power rc=$?"
timeout -s TERM 150 python3 probe_sustained_step.py --seconds 0.6 --segments 1 --shapes qwen3-30b-a3b/down/EP8/4096tpe/balanced --out $OUT/sustained.jsonl 2>&1 | cut -c1-260; echo "sustained rc=$?"
cd ..
timeout -s TERM 120 python3 tools/probe_attention.py 2>&1 | tail -12 | cut -c1-200; echo "attention rc=$?"
