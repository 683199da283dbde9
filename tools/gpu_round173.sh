#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H100: the shipped H100 DB as committed (48 dense entries and
# round 172's 27 step-scoped grouped entries) against the platform default at EP8 x 512, whole
# steps in turns, bf16 on near-balanced routing and fp8 blockwise on balanced routing; then the GPU
# tests of the files this session changed code under.
source tools/gpu_round_common.sh
export OUT
turbo-dispatch db validate turbo_dispatch/tuned/nvidia-h100-80gb-hbm3.jsonl | tail -1
for spec in "bf16 near-balanced" "fp8 balanced"; do
    set -- $spec
    timeout -s TERM 100 python3 tools/probe_shipped_db.py --dtype $1 --ep 8 --tokens-per-expert 512 --routing $2 \
        --out $OUT/shipped_$1_$2_ep8_tpe512.jsonl > $OUT/shipped_$1_$2_ep8_tpe512.log 2>&1
    echo "probe $1 $2 rc=$?"; grep -E "geomean|FAIL|Error" $OUT/shipped_$1_$2_ep8_tpe512.log | cut -c1-400
done
timeout -s TERM 300 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -n 8 tests/test_grouped_gemm.py \
    tests/test_token_buckets.py tests/test_tuning_db.py tests/test_dispatch.py tests/test_step_tuning.py \
    > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pytest.log
