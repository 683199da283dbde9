#!/usr/bin/env bash
# Nineteenth session, sixteenth call (commit: see git log, "round 104 script"): GPU tests with the
# backward's dgrad beside its wgrad on by default: CUDA graphs (changing routing, the blockwise
# training step), the full op against torch, every fp8 recipe, the two-stream tests, the default
# wgrad; tests/test_grouped_gemm.py's GPU-marked tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
timeout -s TERM 300 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "cuda_graph or full_op or every_recipe or side_by_side or default_wgrad" > $OUT/pytest_grouped.log 2>&1
echo "pytest grouped rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_grouped.log | cut -c1-200 | head -12
timeout -s TERM 120 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_gpu.log 2>&1
echo "pytest gpu rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_gpu.log | cut -c1-200 | head -12
