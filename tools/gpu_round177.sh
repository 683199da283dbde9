#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H100: the step tuner on DeepSeek-V3's fp8 blockwise layers at
# EP8 x 4096 (the shapes where the issue-6 whole-op ratio sits at 1.305-1.314x), with the time
# round 171's run lacked: does any config beat the default TRITON configs in the step?
source tools/gpu_round_common.sh
export OUT
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
timeout -s TERM 540 turbo-dispatch tune --model deepseek-v3 --ops grouped_gemm_fp8 --fp8 blockwise --step --ep 8 \
    --tokens-per-expert 4096 --step-budget-ms 60 --db $OUT/steps_fp8_dsv3_ep8_tpe4096.jsonl --no-progress \
    > $OUT/tune_step_fp8_dsv3_tpe4096.log 2>&1
echo "tune rc=$?"; grep -E "LAYER|/|layers by steps|failed|Error" $OUT/tune_step_fp8_dsv3_tpe4096.log | cut -c1-300
