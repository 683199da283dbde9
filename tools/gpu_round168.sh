#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H100: the step tuner (`turbo-dispatch tune --step`) over the
# six MoE presets at EP8 x 512 tokens per expert, bf16 and fp8 blockwise, into a fresh DB; then
# whole steps with that DB against the platform default, in turns (probe_shipped_db.py --db).
source tools/gpu_round_common.sh
export OUT
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
MODELS=deepseek-v3,deepseek-v2,qwen3-30b-a3b,mixtral-8x7b,kimi-k2,gpt-oss-20b
TPE=512
DB=$OUT/steps_ep8_tpe$TPE.jsonl
for ops in grouped_gemm grouped_gemm_fp8; do
    timeout -s TERM 200 turbo-dispatch tune --model $MODELS --ops $ops --fp8 blockwise --step --ep 8 \
        --tokens-per-expert $TPE --db $DB --no-progress > $OUT/tune_step_${ops}_tpe$TPE.log 2>&1
    echo "tune $ops rc=$?"; grep -E "LAYER|/|layers by steps|failed|Error" $OUT/tune_step_${ops}_tpe$TPE.log | cut -c1-260
done
turbo-dispatch db show $DB | tail -2
for dt in bf16 fp8; do
    timeout -s TERM 100 python3 tools/probe_shipped_db.py --dtype $dt --ep 8 --tokens-per-expert $TPE --db $DB \
        --out $OUT/stepdb_${dt}_ep8_tpe$TPE.jsonl > $OUT/stepdb_${dt}_ep8_tpe$TPE.log 2>&1
    echo "probe $dt rc=$?"; grep -E "geomean|FAIL|Error" $OUT/stepdb_${dt}_ep8_tpe$TPE.log | cut -c1-400
done
