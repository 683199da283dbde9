#!/usr/bin/env bash
# Twenty-second session, second call (commit: see git log, "round 115"), on an NVIDIA H100: where
# the host time of one eager blockwise fp8 grouped step goes, layer by layer
# (tools/probe_host_layers.py, batches of back-to-back calls behind one GPU spin), and the aten
# operators of five steps (fp8 and bf16). Round 114 ran the first form of the probe (one call per
# GPU spin, a synchronisation between calls), which timed the host's wake-up after each
# synchronisation; its log is kept for that reason only.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
timeout -s TERM 300 python3 tools/probe_host_layers.py --shape qwen3_down --aten --out $OUT/layers.jsonl \
    > $OUT/layers.log 2>&1; echo rc=$?
grep host_layer $OUT/layers.log
