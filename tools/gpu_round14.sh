#!/usr/bin/env bash
# One device call with the TMA-store epilogue as the default (gluon-ws-r7): where the grouped
# blockwise whole op spends its time (DeepSeek-V3 up_gate and down: each GEMM end to end and its
# quantisations alone), then the GPU tests not yet run on it: the grouped fp8 recipes, CUDA-graph
# capture and full op (the grouped WS kernel now TMA-stores), and the dense warp-specialised
# configs through the adapter for the forward, dgrad and wgrad of every layout.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 120 python3 tools/probe_triton_grouped.py --whole-op --out $OUT/whole_op.jsonl \
    > $OUT/whole_op.log 2>&1; echo "rc=$?"; grep "probe=" $OUT/whole_op.log | cut -c1-230
timeout -s TERM 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_grouped_gemm.py -k "fp8 or graph or full_op" > $OUT/pytest_grouped.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest_grouped.log
timeout -s TERM 220 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs \
    tests/test_triton_gemm.py -k "gluonws and fwd_dgrad_wgrad" > $OUT/pytest_gluonws_fdw.log 2>&1; echo "rc=$?"
tail -6 $OUT/pytest_gluonws_fdw.log
