#!/usr/bin/env bash
# Thirty-fourth session, on 2 NVIDIA H100 of one host (the first multi-GPU machine lent): round
# 160's multi-GPU paths with 2 ranks (the NCCL MoE test, `tune --distributed` over NCCL, online
# consensus over NCCL with one shared DB), then the step tuner sharded over 2 NCCL ranks
# (`tune --step --distributed`, so far run only on gloo) and its DB validated.
source tools/gpu_round_common.sh
export OUT
NPROC=2 bash tools/gpu_round160.sh 2>&1 | grep -v "^Successfully\|^\s*$"
export PRIMUS_TURBO_TUNE_DB_SHIPPED=0
DB=$OUT/steps_nccl_mixtral_ep8_tpe512.jsonl
timeout -s TERM 150 torchrun --standalone --nproc_per_node 2 -m turbo_dispatch.cli tune --distributed \
    --model mixtral-8x7b --ops grouped_gemm --step --ep 8 --tokens-per-expert 512 --db $DB --no-progress \
    > $OUT/tune_step_nccl.log 2>&1
echo "tune --step --distributed rc=$?"; grep -E "LAYER|layers by steps|rank|Error" $OUT/tune_step_nccl.log | cut -c1-240 | head -20
turbo-dispatch db validate $DB; echo "validate rc=$?"
turbo-dispatch db show $DB | cut -c1-60,180-400
rm -f $OUT/*.lock  # the DB writers' lock sidecars would take 3 of the 8 files a call returns
