#!/usr/bin/env bash
# Thirty-first session, on an NVIDIA H100: offline tuning of the MoE presets' grouped GEMM keys
# (bf16, fp8 blockwise and rowwise; every GEMM of a training step) at EP8 for the DB shipped in the
# package, which held dense GEMM keys only. Tokens per expert from TPES (default 4096 512).
source tools/gpu_round_common.sh
MODELS=deepseek-v3,deepseek-v2,qwen3-30b-a3b,mixtral-8x7b,kimi-k2,gpt-oss-20b
export PRIMUS_TURBO_TUNE_BUDGET_MS=${BUDGET_MS:-1000}
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
for tpe in ${TPES:-4096 512}; do
    timeout -s TERM ${TUNE_LIMIT:-270} turbo-dispatch tune --model $MODELS --ops grouped_gemm,grouped_gemm_fp8 \
        --fp8 blockwise,rowwise --ep 8 --tokens-per-expert $tpe --db $OUT/moe_ep8_tpe$tpe.jsonl --no-progress \
        > $OUT/tune_ep8_tpe$tpe.log 2>&1
    echo "tune tpe=$tpe rc=$?"; tail -4 $OUT/tune_ep8_tpe$tpe.log
    turbo-dispatch db validate $OUT/moe_ep8_tpe$tpe.jsonl > /dev/null 2>&1; echo "validate rc=$?"
done
