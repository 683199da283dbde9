#!/usr/bin/env bash
# Thirty-third session, on an NVIDIA H100: every test CI runs (the unmarked, CPU-side tests of all
# 28 files) on a GPU host, where torch sees a CUDA device. Round 178 found three GPU-host
# assumptions in the tuning files alone; this round runs the rest.
source tools/gpu_round_common.sh
export OUT
timeout -s TERM 540 python3 -m pytest -q -m "not gpu" -p no:cacheprovider -o addopts="" -n 8 -rfE \
    --durations=10 tests/ > $OUT/pytest_cpu_on_gpu_host.log 2>&1
echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)" $OUT/pytest_cpu_on_gpu_host.log | cut -c1-300; tail -1 $OUT/pytest_cpu_on_gpu_host.log
