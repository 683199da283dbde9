#!/usr/bin/env bash
# Thirty-first session, on an NVIDIA H100: the shipped DB as committed (dense keys plus the four
# grouped keys db prune --min-speedup 1.25 kept) against the platform default at EP8 x 512, whole
# steps in turns; then the GPU tests of the files this session changed the code under.
source tools/gpu_round_common.sh
export OUT
turbo-dispatch db validate turbo_dispatch/tuned/nvidia-h100-80gb-hbm3.jsonl | tail -1
for spec in "bf16 512" "fp8 512"; do
    set -- $spec
    timeout -s TERM 120 python3 tools/probe_shipped_db.py --dtype $1 --ep 8 --tokens-per-expert $2 \
        --out $OUT/shipped_$1_ep8_tpe$2.jsonl > $OUT/shipped_$1_ep8_tpe$2.log 2>&1
    echo "probe $1 $2 rc=$?"; grep -E "geomean|FAIL|Error|mixtral" $OUT/shipped_$1_ep8_tpe$2.log | cut -c1-400
done
timeout -s TERM 300 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -n 8 tests/test_grouped_gemm.py \
    tests/test_token_buckets.py tests/test_tuning_db.py tests/test_dispatch.py > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pytest.log
