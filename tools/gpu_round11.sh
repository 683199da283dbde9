#!/usr/bin/env bash
# One device call: a's K-block scales copied into shared memory by the loader warp (cp.async,
# completion on the slot's ready barrier; SCALES_IN_SMEM) against global loads in the math
# warpgroups, with GROUP_M 16 beside 8: float64 checks then timings, dense and grouped. Then the
# GPU tests with the scales in shared memory as the default: the dense 256-column kernel tests
# and the grouped fp8 recipes / CUDA-graph tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 130 python3 tools/probe_gluon_ws.py --tiles 256:4,256:4:smem,256:3:smem,256:4:16 \
    --shapes 4096x7168x16384,4096x4096x7168,4096x3584x3584 --out $OUT/ws_smem_dense.jsonl \
    > $OUT/ws_smem_dense.log 2>&1; echo "rc=$?"; grep -v "status=PASS" $OUT/ws_smem_dense.log | tail -20
timeout -s TERM 100 python3 tools/probe_gluon_ws.py --grouped --tiles 256:4,256:4:smem,256:3:smem,128:4:smem \
    --out $OUT/ws_smem_grouped.jsonl > $OUT/ws_smem_grouped.log 2>&1; echo "rc=$?"; tail -20 $OUT/ws_smem_grouped.log
timeout -s TERM 110 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rs \
    tests/test_triton_gemm.py -k "gluonws_128x256x128_s4" > $OUT/pytest_gluonws_smem.log 2>&1; echo "rc=$?"
tail -3 $OUT/pytest_gluonws_smem.log
timeout -s TERM 120 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" \
    tests/test_triton_grouped_gemm.py -k "fp8_every_recipe or graph" > $OUT/pytest_grouped_smem.log 2>&1; echo "rc=$?"
tail -3 $OUT/pytest_grouped_smem.log
