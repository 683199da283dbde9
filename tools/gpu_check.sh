#!/usr/bin/env bash
# One GPU session: install, run the correctness suite (GPU params included), the overhead bench.
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a $OUT/gpu.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
turbo-dispatch backends 2>&1 | tee $OUT/backends.txt
for g in "" "--fp8 tensorwise" "--fp8 rowwise" "--fp8 blockwise" "--fp8 mx"; do
  turbo-dispatch explain gemm --m 8192 --n 4096 --k 4096 --dtype bf16 $g 2>&1 | tee -a $OUT/explain.txt
done
timeout 420 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_gemm.py tests/test_gpu_capture.py tests/test_gpu_fp8_paths.py tests/test_compile.py tests/test_dispatch.py tests/test_low_precision.py "$@" 2>&1 | tee $OUT/pytest.txt | tail -40
for d in cuda cpu; do python3 benchmarks/bench_dispatch_overhead.py --device $d --json $OUT/overhead_$d.json 2>&1 | tee -a $OUT/overhead.txt; done
