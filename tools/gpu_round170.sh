#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H100: the step tuner over the six MoE presets at EP8 x 4096
# tokens per expert, bf16, into a fresh DB; then whole steps with that DB against the default on
# the near-balanced routing the tuner times on and on the bench's exactly balanced routing.
source tools/gpu_round_common.sh
export OUT
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
MODELS=deepseek-v3,deepseek-v2,qwen3-30b-a3b,mixtral-8x7b,kimi-k2,gpt-oss-20b
DB=$OUT/steps_ep8_tpe4096.jsonl
timeout -s TERM 300 turbo-dispatch tune --model $MODELS --ops grouped_gemm --step --ep 8 \
    --tokens-per-expert 4096 --step-budget-ms 60 --db $DB --no-progress > $OUT/tune_step_bf16_tpe4096.log 2>&1
echo "tune rc=$?"; grep -E "LAYER|/|layers by steps|failed|Error" $OUT/tune_step_bf16_tpe4096.log | cut -c1-260
for routing in near-balanced balanced; do
    timeout -s TERM 130 python3 tools/probe_shipped_db.py --dtype bf16 --ep 8 --tokens-per-expert 4096 --db $DB \
        --routing $routing --rounds 3 --reps 6 --out $OUT/stepdb_bf16_${routing}_ep8_tpe4096.jsonl \
        > $OUT/stepdb_bf16_${routing}_ep8_tpe4096.log 2>&1
    echo "probe $routing rc=$?"; grep -E "geomean|FAIL|Error" $OUT/stepdb_bf16_${routing}_ep8_tpe4096.log | cut -c1-400
done
