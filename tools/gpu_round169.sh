#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H100: round 168's step-tuned DB (EP8 x 512) against the
# default on the near-balanced routing the tuner timed on (round 168 probed the bench's exactly
# balanced routing); then the step tuner goes on with the fp8 blockwise layers round 168's time
# limit stopped (the layers already stored are skipped), into a copy of round 168's DB.
source tools/gpu_round_common.sh
export OUT
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
MODELS=deepseek-v3,deepseek-v2,qwen3-30b-a3b,mixtral-8x7b,kimi-k2,gpt-oss-20b
DB=$OUT/steps_ep8_tpe512.jsonl
cp benchmarks/results/h100_2026-11-25r168_steps_ep8_tpe512.jsonl $DB
timeout -s TERM 100 python3 tools/probe_shipped_db.py --dtype bf16 --ep 8 --tokens-per-expert 512 --db $DB \
    --routing near-balanced --out $OUT/stepdb_bf16_nb_ep8_tpe512.jsonl > $OUT/stepdb_bf16_nb_ep8_tpe512.log 2>&1
echo "probe rc=$?"; grep -E "geomean|FAIL|Error" $OUT/stepdb_bf16_nb_ep8_tpe512.log | cut -c1-400
timeout -s TERM 420 turbo-dispatch tune --model $MODELS --ops grouped_gemm_fp8 --fp8 blockwise --step --ep 8 \
    --tokens-per-expert 512 --step-budget-ms 60 --db $DB --no-progress > $OUT/tune_step_fp8_tpe512.log 2>&1
echo "tune rc=$?"; grep -E "LAYER|/|layers by steps|failed|Error" $OUT/tune_step_fp8_tpe512.log | cut -c1-260
turbo-dispatch db show $DB | tail -1
