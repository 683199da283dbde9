#!/usr/bin/env bash
# Issue 5, the final code of this session: the compiled fp8 backward through
# turbo_dispatch::fp8_quantize_both_axes on the GPU (torch.compile MLP cases, aot_eager and
# inductor, against eager), the fp8 op paths, the saved-activation/peak tests and CUDA-graph capture.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 420 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/test_compile.py tests/test_gpu_fp8_paths.py \
    tests/test_fp8_saved_activation.py tests/test_gpu_capture.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -4 $OUT/pytest.log
