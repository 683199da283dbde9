#!/usr/bin/env bash
# Nineteenth session, seventh call (commit: see git log, "round 95 script"). GPU tests of the
# strip-written row scales and of the forward's two quantisers on two streams (side_by_side):
# the new tests, the dual quantiser's, the training step in a CUDA graph, CUDA graphs with
# changing routing, the full op against torch, every fp8 recipe, the fresh-thread TMA launch, the
# default wgrad, and the compiled blockwise step.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 380 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "strips or side_by_side or dual or cuda_graph or full_op or fresh_thread or every_recipe or default_wgrad" \
    > $OUT/pytest_grouped.log 2>&1; echo "pytest grouped rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_grouped.log | cut -c1-300 | head -20
timeout -s TERM 150 python3 -m pytest -q tests/test_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "compiled_matches_eager and blockwise or gpu" > $OUT/pytest_compile.log 2>&1; echo "pytest compile rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_compile.log | cut -c1-300 | head -20
