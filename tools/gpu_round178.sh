#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H100: the review mend (739a5c3: autotune.timing_set_count,
# keys.looked_up, the step tuner's platform) on the GPU: the tuning and token-bucket GPU tests, and
# tune --step on Mixtral-8x7B's bf16 EP8 x 512 layers.
source tools/gpu_round_common.sh
export OUT
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
timeout -s TERM 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -n 8 tests/test_tuning_db.py \
    tests/test_token_buckets.py tests/test_dispatch.py > $OUT/pytest.log 2>&1
echo "pytest rc=$?"; tail -1 $OUT/pytest.log
timeout -s TERM 150 turbo-dispatch tune --model mixtral-8x7b --ops grouped_gemm --step --ep 8 --tokens-per-expert 512 \
    --db $OUT/steps_mixtral_ep8_tpe512.jsonl --no-progress > $OUT/tune_step_mixtral.log 2>&1
echo "tune rc=$?"; grep -E "LAYER|/|layers by steps" $OUT/tune_step_mixtral.log | cut -c1-240
