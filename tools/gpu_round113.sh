#!/usr/bin/env bash
# Twenty-first session, fifth call (commit: see git log, "round 113 script"), on an NVIDIA H100:
# the GPU tests on the session's final code (the library is that of round 108 plus the review
# mend a31748d, which no GPU run had checked): tests/test_grouped_gemm.py's GPU-marked tests,
# tests/test_weight_reuse.py, and test_triton_grouped_gemm.py's CUDA-graph, full-op, every-recipe,
# two-stream and default-wgrad tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_grouped_gemm.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_gpu.log 2>&1
echo "pytest gpu rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_gpu.log | cut -c1-200 | head -12
timeout -s TERM 100 python3 -m pytest -q tests/test_weight_reuse.py -p no:cacheprovider --tb=short \
    > $OUT/pytest_reuse.log 2>&1
echo "pytest reuse rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_reuse.log | cut -c1-200 | head -12
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "cuda_graph or full_op or every_recipe or side_by_side or default_wgrad" > $OUT/pytest_grouped.log 2>&1
echo "pytest grouped rc=$?"; grep -E "^E |^FAILED|passed|failed" $OUT/pytest_grouped.log | cut -c1-200 | head -12
