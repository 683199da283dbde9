#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H100: the step tuner with the stricter confirmation (five
# rounds in turns, the tuned step faster in every one) at EP8 x 4096, fp8 blockwise and bf16, into
# fresh DBs; whole steps with a DB against the default (near-balanced routing) where it stored any.
source tools/gpu_round_common.sh
export OUT
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
MODELS=deepseek-v3,deepseek-v2,qwen3-30b-a3b,mixtral-8x7b,kimi-k2,gpt-oss-20b
for spec in "fp8 grouped_gemm_fp8 250" "bf16 grouped_gemm 200"; do
    set -- $spec
    DB=$OUT/steps_$1_ep8_tpe4096.jsonl
    timeout -s TERM $3 turbo-dispatch tune --model $MODELS --ops $2 --fp8 blockwise --step --ep 8 \
        --tokens-per-expert 4096 --step-budget-ms 60 --db $DB --no-progress > $OUT/tune_step_$1_tpe4096.log 2>&1
    echo "tune $1 rc=$?"; grep -E "LAYER|/|layers by steps|failed|Error" $OUT/tune_step_$1_tpe4096.log | cut -c1-260
done
for dt in fp8 bf16; do
    DB=$OUT/steps_${dt}_ep8_tpe4096.jsonl
    [ -s $DB ] || { echo "$dt: nothing stored"; continue; }
    timeout -s TERM 110 python3 tools/probe_shipped_db.py --dtype $dt --ep 8 --tokens-per-expert 4096 --db $DB \
        --routing near-balanced --rounds 3 --reps 6 --out $OUT/stepdb_${dt}_nb_ep8_tpe4096.jsonl \
        > $OUT/stepdb_${dt}_nb_ep8_tpe4096.log 2>&1
    echo "probe $dt rc=$?"; grep -E "geomean|FAIL|Error" $OUT/stepdb_${dt}_nb_ep8_tpe4096.log | cut -c1-400
done
