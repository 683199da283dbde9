#!/usr/bin/env bash
# One device call: the blockwise training step captured in a CUDA graph and replayed with other
# routings (bit-exact against eager), plus the graph-capture and fp8 fast-path test files.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs \
    tests/test_triton_grouped_gemm.py -k "training_step or graph" tests/test_gpu_capture.py > $OUT/pytest_graph.log 2>&1
echo "rc=$?"; tail -6 $OUT/pytest_graph.log
