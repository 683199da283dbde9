#!/usr/bin/env bash
# Thirtieth session, fourth call, on 2 NVIDIA H200 of one host: the multi-GPU paths, never run on
# GPUs before. (1) The NCCL MoE dispatch/combine checks (tests/test_moe.py's gpu test, small and
# large sizes, forward and gradients against single-process references). (2) Offline tuning
# sharded over 2 ranks by torchrun (`turbo-dispatch tune --distributed`, NCCL), its DB validated.
# (3) Online autotuning with rank consensus over NCCL, both ranks writing one shared DB, each rank's
# timings skewed so that alone they would pick different winners (tools/probe_nccl_consensus.py).
source tools/gpu_round_common.sh
# NPROC=1 (the only GPU kinds lent this session were one-GPU machines) still runs every NCCL call of
# (2) and (3) on a one-rank group; the MoE test then skips itself.
NPROC=${NPROC:-2}
nvidia-smi --query-gpu=index,name --format=csv,noheader
export NCCL_NVLS_ENABLE=0
timeout -s TERM 200 python3 -m pytest -q -rs -p no:cacheprovider -o addopts="" -m gpu tests/test_moe.py \
    > $OUT/pytest_moe_nccl.log 2>&1; echo "pytest moe rc=$?"; tail -3 $OUT/pytest_moe_nccl.log
timeout -s TERM 240 torchrun --standalone --nproc_per_node $NPROC -m turbo_dispatch.cli tune --distributed \
    --model qwen3-30b-a3b,mixtral-8x7b --ops grouped_gemm --tokens-per-expert 512 --db $OUT/tune_nccl.jsonl \
    --no-progress > $OUT/tune_nccl.log 2>&1; echo "tune rc=$?"; tail -5 $OUT/tune_nccl.log
timeout -s TERM 60 turbo-dispatch db validate $OUT/tune_nccl.jsonl; echo "validate rc=$?"
PRIMUS_TURBO_TUNE_DB=$OUT/consensus_shared.jsonl timeout -s TERM 240 torchrun --standalone --nproc_per_node $NPROC \
    tools/probe_nccl_consensus.py > $OUT/consensus.log 2>&1; echo "consensus rc=$?"
grep -E "^\{|shared DB|Error|error" $OUT/consensus.log | head -12
