#!/usr/bin/env bash
# One single-GPU session: install, GPU correctness suite, overhead and wrapper benches.
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a $OUT/gpu.txt
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
{ turbo-dispatch backends; for g in "" "--fp8 tensorwise" "--fp8 rowwise" "--fp8 blockwise" "--fp8 mx"; do
  turbo-dispatch explain gemm --m 8192 --n 4096 --k 4096 --dtype bf16 $g; done; } > $OUT/cli.txt 2>&1
timeout ${PYTEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider -rfE -m gpu "$@" tests/ 2>&1 | tee $OUT/pytest.txt | tail -25
{ for d in cuda cpu; do python3 benchmarks/bench_dispatch_overhead.py --device $d --rounds 5 --json $OUT/overhead_$d.json; done
  python3 benchmarks/bench_wrappers.py --json $OUT/wrappers.json; } 2>&1 | tee $OUT/bench.txt | grep -E "^\||torch|FAIL"
