#!/usr/bin/env bash
# Twenty-fifth session, first call, on an NVIDIA H100: can the blockwise step's quantisers run
# beside its GEMMs on SMs a capped GEMM leaves free (tools/probe_overlap.py)? Timing only.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
cd tools && timeout -s TERM 540 python3 probe_overlap.py --out $OUT/overlap.jsonl > $OUT/overlap.log 2>&1
echo "probe rc=$?"
grep -v '"probe": "gemm"' $OUT/overlap.log | tail -5 | cut -c1-300
