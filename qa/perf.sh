#!/usr/bin/env bash
# Usage: qa/perf.sh [--dry-run] [--quick] [--time-limit S] FAMILY... | all [-- SUITE_ARGS...]
#
# Runs the benchmark families of benchmarks/suite.py, one suite call per family, each under
# `timeout`: the suite shares S seconds among the family's runs (a run out of time writes the
# rows it measured, marked INTERRUPTED), and this script stops the whole call S + 120 seconds in.
#
#   FAMILY         gemm, gemm_fp8, grouped_gemm, grouped_gemm_fp8, dispatch_overhead,
#                  blaslt_switch, wrappers, fused_producers, attention, model, moe_layer,
#                  step_host, attention_self_delta
#                  (`python3 benchmarks/suite.py --list`); all.
#   --time-limit S seconds per family (default 540).
#   --quick        each script's smoke form (runs on a CPU-only machine too).
#   --dry-run      print the suite commands, run nothing.
#   SUITE_ARGS     after --, passed to every suite call (e.g. -- --only fp8_blockwise_gemm, or
#                  -- -- --models deepseek-v3 to reach the bench scripts).
#
# Output: $OUT/perf/ (the benches' CSV/markdown/PNG reports, one log per run, suite.jsonl),
# $OUT/perf/<family>.log (the suite's own lines), $OUT/perf_summary.txt (OUT default
# bench-out/qa). Exit status: 0 when every family's runs passed or were skipped for want of a
# GPU, 1 otherwise.
#
# Example: qa/perf.sh gemm_fp8 grouped_gemm_fp8 --time-limit 600
set -euo pipefail
source "$(dirname "$0")/common.sh"

QA_VALUE_OPTIONS=time-limit QA_FLAG_OPTIONS=quick
qa_parse "$@"
time_limit=${QA_OPT[time-limit]:-540}
quick=()
[ -n "${QA_OPT[quick]:-}" ] && quick=(--quick)
families=(${QA_POS[@]+"${QA_POS[@]}"})
suite_args=(${QA_REST[@]+"${QA_REST[@]}"})
if [ ${#families[@]} -eq 0 ]; then
    qa_usage >&2
    exit 2
fi

known=$("$PYTHON" benchmarks/suite.py --list | cut -f1)
if [ "${families[0]}" = all ]; then
    mapfile -t families <<< "$known"
fi
for f in "${families[@]}"; do
    if ! grep -qx "$f" <<< "$known"; then
        qa_die "unknown family $f; known: $(echo $known)"
    fi
done

for f in "${families[@]}"; do
    qa_step "$f" "$OUT/perf/$f.log" timeout -s TERM -k 30 $((time_limit + 120)) "$PYTHON" benchmarks/suite.py \
        --family "$f" --time-limit "$time_limit" --out "$OUT/perf" ${quick[@]+"${quick[@]}"} \
        ${suite_args[@]+"${suite_args[@]}"}
done
qa_finish perf
