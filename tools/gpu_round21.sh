#!/usr/bin/env bash
# One device call after the review mend (shared padded-row allocator, derived step key): the dual
# quantiser's bit checks and the reuse step at one shape, and the step/compile tests on CUDA.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 90 python3 tools/probe_grouped_step.py --shapes dsv3_up --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; grep -E "check=|probe=step" $OUT/step.log | cut -c1-300
timeout -s TERM 150 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_grouped_gemm.py -k "step or compiled or custom_op" \
    tests/test_triton_grouped_gemm.py::test_gpu_blockwise_training_step_in_a_cuda_graph > $OUT/pytest_step.log 2>&1
echo "rc=$?"; tail -2 $OUT/pytest_step.log
