#!/usr/bin/env bash
# One device call: gluon-wgrad-r3 (edge zeroing through a bitcast fp8 load, which triton 3.9 also
# compiles) against float64, the step's quantisers on two streams (bits and CUDA-graph capture),
# and the step probe timing the two streams against one.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/test_triton_grouped_gemm.py \
    -k "wgrad_warp_specialised or two_streams or training_step_in_a_cuda_graph" > $OUT/pytest.log 2>&1; echo "rc=$?"
tail -3 $OUT/pytest.log | cut -c1-300
timeout -s TERM 150 python3 tools/probe_grouped_step.py --shapes dsv3_up,dsv3_down,qwen3_up,qwen3_down \
    --out $OUT/step.jsonl > $OUT/step.log 2>&1
echo "rc=$?"; grep -E "check=step|probe=step|FAIL|Error" $OUT/step.log | cut -c1-300
