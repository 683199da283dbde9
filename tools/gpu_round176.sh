#!/usr/bin/env bash
# Thirty-second session, on an NVIDIA H100: the final code end to end. The shipped DBs (now with
# default_ms on their step entries) validate; `tune --step` on Mixtral-8x7B's bf16 EP8 x 512 layers
# into a fresh DB, then `db prune --min-speedup 1.1` on it keeps or drops each layer's three
# entries together.
source tools/gpu_round_common.sh
export OUT
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
turbo-dispatch db validate turbo_dispatch/tuned/nvidia-h100-80gb-hbm3.jsonl turbo_dispatch/tuned/nvidia-h200.jsonl
DB=$OUT/steps_mixtral_ep8_tpe512.jsonl
timeout -s TERM 120 turbo-dispatch tune --model mixtral-8x7b --ops grouped_gemm --step --ep 8 --tokens-per-expert 512 \
    --db $DB --no-progress > $OUT/tune_step_mixtral.log 2>&1
echo "tune rc=$?"; grep -E "LAYER|/|layers by steps" $OUT/tune_step_mixtral.log | cut -c1-240
turbo-dispatch db prune $DB --min-speedup 1.1
turbo-dispatch db show $DB | cut -c1-60,180-400
