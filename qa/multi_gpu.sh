#!/usr/bin/env bash
# Usage: qa/multi_gpu.sh [--dry-run] [--nproc N] [--time-limit S] [CHECK ...] [-- BENCH_MOE_ARGS]
#
# The multi-GPU checks over NCCL, on N ranks of one host (one GPU each; default 2); naming checks
# runs only those, and arguments after -- go to bench_moe.py (e.g. -- --tokens 128 --profile):
#   moe_nccl_test     tests/test_moe.py -m gpu: MoE dispatch/combine between 2 NCCL processes,
#                     forward and gradients against single-process references;
#   moe_gpu_check     benchmarks/probes/moe_gpu_check.py: the same checks plus larger shapes;
#   bench_moe         benchmarks/bench_moe.py under torchrun: MoE dispatch/combine per registered
#                     backend against the raw all_to_all_single and a peer-to-peer copy of the same
#                     bytes, each row checked; report in $OUT/multi_gpu/bench_moe/;
#   consensus         benchmarks/probes/probe_nccl_consensus.py under torchrun: online autotuning
#                     with rank consensus, one shared tuning DB, then sync_tuning();
#   tune_distributed  turbo-dispatch tune --distributed under torchrun: grouped GEMM keys sharded
#                     over the ranks, the DB validated;
#   tune_step         turbo-dispatch tune --step --distributed: the step tuner over NCCL, the DB
#                     validated.
#
#   --nproc N      ranks (default 2); fewer visible GPUs: every check is skipped (exit 2).
#   --time-limit S seconds per check (default 300).
#   --dry-run      print the commands, run nothing.
#
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0). The packaged tuning DBs are off for the
# tuning checks, so every key is tuned here. Output: $OUT/multi_gpu/ (logs, JUnit XML, tuning
# DBs, the bench_moe report), $OUT/multi_gpu_summary.txt (OUT default bench-out/qa). Exit status: 0 when every check
# passed, 1 when one failed, 2 when they were skipped.
#
# Example: qa/multi_gpu.sh --nproc 2
set -euo pipefail
source "$(dirname "$0")/common.sh"

QA_VALUE_OPTIONS="nproc time-limit"
qa_parse "$@"
nproc=${QA_OPT[nproc]:-2}
time_limit=${QA_OPT[time-limit]:-300}

export NCCL_NVLS_ENABLE=0
dir="$OUT/multi_gpu"
limit=(timeout -s TERM -k 30 "$time_limit")
torchrun=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$nproc")
cli=("$PYTHON" -m turbo_dispatch.cli)
checks=(moe_nccl_test moe_gpu_check bench_moe consensus tune_distributed tune_step)
for c in ${QA_POS[@]+"${QA_POS[@]}"}; do
    [[ " ${checks[*]} " == *" $c "* ]] || qa_die "unknown check $c (known: ${checks[*]})"
done
# wanted NAME: whether the run includes check NAME (all of them when none is named)
wanted() {
    [ ${#QA_POS[@]} -eq 0 ] || [[ " ${QA_POS[*]} " == *" $1 "* ]]
}

if [ "$DRY_RUN" != 1 ]; then
    gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
    if [ "$gpus" -lt "$nproc" ]; then
        for c in "${checks[@]}"; do qa_skip "$c" "needs $nproc GPUs, $gpus visible"; done
        qa_finish multi_gpu
    fi
    mkdir -p "$dir"
    rm -f "$dir"/*.jsonl  # the tuning checks must start from empty DBs
fi

if wanted moe_nccl_test; then
    qa_step --pytest moe_nccl_test "$dir/moe_nccl_test.log" "${limit[@]}" "$PYTHON" -m pytest tests/test_moe.py -m gpu \
        -p no:cacheprovider -o addopts= -rfEs --tb=short --junitxml "$dir/moe_nccl_test.xml"
fi
if wanted moe_gpu_check; then
    qa_step moe_gpu_check "$dir/moe_gpu_check.log" "${limit[@]}" "$PYTHON" benchmarks/probes/moe_gpu_check.py \
        --world "$nproc"
fi
if wanted bench_moe; then
    qa_step bench_moe "$dir/bench_moe.log" "${limit[@]}" "${torchrun[@]}" benchmarks/bench_moe.py \
        --out "$dir/bench_moe" ${QA_REST[@]+"${QA_REST[@]}"}
fi
if wanted consensus; then
    qa_step consensus "$dir/consensus.log" env PRIMUS_TURBO_TUNE_DB="$dir/consensus_shared.jsonl" "${limit[@]}" \
        "${torchrun[@]}" benchmarks/probes/probe_nccl_consensus.py
fi
if wanted tune_distributed; then
    qa_step tune_distributed "$dir/tune_distributed.log" env PRIMUS_TURBO_TUNE_DB_SHIPPED=0 "${limit[@]}" \
        "${torchrun[@]}" -m turbo_dispatch.cli tune --distributed --model qwen3-30b-a3b,mixtral-8x7b --ops grouped_gemm \
        --tokens-per-expert 512 --db "$dir/tune_distributed.jsonl" --no-progress
    qa_step tune_distributed_db "$dir/tune_distributed_db.log" "${cli[@]}" db validate "$dir/tune_distributed.jsonl"
fi
if wanted tune_step; then
    qa_step tune_step "$dir/tune_step.log" env PRIMUS_TURBO_TUNE_DB_SHIPPED=0 "${limit[@]}" \
        "${torchrun[@]}" -m turbo_dispatch.cli tune --distributed --step --model mixtral-8x7b --ops grouped_gemm --ep 8 \
        --tokens-per-expert 512 --db "$dir/tune_step.jsonl" --no-progress
    qa_step tune_step_db "$dir/tune_step_db.log" "${cli[@]}" db validate "$dir/tune_step.jsonl"
fi
qa_finish multi_gpu
