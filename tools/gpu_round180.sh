#!/usr/bin/env bash
# Thirty-third session, on an NVIDIA H100: round 179's CPU-side run again after its mend (e4545ac),
# and the GPU tests of the files it touched (the Gluon entry points' device check among them).
source tools/gpu_round_common.sh
export OUT
python3 -c "import numpy; print('numpy', numpy.__version__)"
timeout -s TERM 420 python3 -m pytest -q -m "not gpu" -p no:cacheprovider -o addopts="" -n 8 -rfEs \
    tests/ > $OUT/pytest_cpu_on_gpu_host.log 2>&1
echo "cpu-side pytest rc=$?"; grep -E "^(FAILED|ERROR)" $OUT/pytest_cpu_on_gpu_host.log | cut -c1-300
grep -E "^SKIPPED" $OUT/pytest_cpu_on_gpu_host.log | cut -c1-250 | sort | uniq -c | sort -rn | head -12
tail -1 $OUT/pytest_cpu_on_gpu_host.log
timeout -s TERM 150 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -n 8 -rfE tests/test_triton_grouped_gemm.py \
    tests/test_triton_gemm.py tests/test_attention.py tests/test_compile.py tests/test_blaslt_gemm.py \
    > $OUT/pytest_gpu_touched.log 2>&1
echo "gpu pytest rc=$?"; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu_touched.log | cut -c1-300; tail -1 $OUT/pytest_gpu_touched.log
