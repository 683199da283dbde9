#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H200: the step tuner with the five-round confirmation at
# EP8 x 512 (bf16 over the six MoE presets; fp8 blockwise at Mixtral-8x7B, the only preset whose
# fp8 layers it stored in round 168) into a fresh DB, the candidate for a shipped H200 DB (none exists); then
# whole bf16 steps with that DB against the default on near-balanced and exactly balanced routing.
source tools/gpu_round_common.sh
export OUT
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
DB=$OUT/steps_ep8_tpe512.jsonl
for spec in "bf16 grouped_gemm deepseek-v3,deepseek-v2,qwen3-30b-a3b,mixtral-8x7b,kimi-k2,gpt-oss-20b" \
            "fp8 grouped_gemm_fp8 mixtral-8x7b"; do
    set -- $spec
    timeout -s TERM 150 turbo-dispatch tune --model $3 --ops $2 --fp8 blockwise --step --ep 8 \
        --tokens-per-expert 512 --step-budget-ms 60 --db $DB --no-progress > $OUT/tune_step_$1_tpe512.log 2>&1
    echo "tune $1 rc=$?"; grep -E "LAYER|/|layers by steps|failed|Error" $OUT/tune_step_$1_tpe512.log | cut -c1-260
done
turbo-dispatch db show $DB | tail -1
for routing in near-balanced balanced; do
    timeout -s TERM 90 python3 tools/probe_shipped_db.py --dtype bf16 --ep 8 --tokens-per-expert 512 --db $DB \
        --routing $routing --out $OUT/stepdb_bf16_${routing}_ep8_tpe512.jsonl > $OUT/stepdb_bf16_${routing}_ep8_tpe512.log 2>&1
    echo "probe $routing rc=$?"; grep -E "geomean|FAIL|Error" $OUT/stepdb_bf16_${routing}_ep8_tpe512.log | cut -c1-400
done
