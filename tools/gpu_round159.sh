#!/usr/bin/env bash
# Thirtieth session, third call, on an NVIDIA H200: every GPU-marked test file in one run (rounds
# 157-158 ran them on the H100), with the reasons of skips and expected failures listed (-rsx).
source tools/gpu_round_common.sh
timeout -s TERM 560 python3 -m pytest -q -rsx -p no:cacheprovider -o addopts="" -m gpu -n 8 tests/ \
    > $OUT/pytest_all.log 2>&1; echo "pytest rc=$?"; tail -4 $OUT/pytest_all.log
