#!/usr/bin/env bash
# Usage: qa/gpu_tests.sh [--dry-run] [--time-limit S] [TEST_FILE... | all] [-- PYTEST_ARGS...]
#
# Runs the GPU-marked tests (pytest -m gpu) one test file at a time, so that each file gets its
# own log, JUnit XML and time limit, and one slow file cannot hide the others' results.
#
#   TEST_FILE      tests/test_gemm.py, test_gemm.py or gemm; "all" (the default): every
#                  tests/test_*.py (a file without GPU tests counts as passed).
#   --time-limit S seconds per file (default 900); the file is stopped and counted failed.
#   --dry-run      print the pytest commands, run nothing.
#   PYTEST_ARGS    after --, passed to every pytest call (e.g. -- -k fp8 -x).
#
# With pytest-xdist installed, each file runs on $WORKERS workers (default 8; WORKERS=0: none).
# Output: $OUT/gpu_tests/<file>.log and <file>.xml, $OUT/gpu_tests_summary.txt (OUT default
# bench-out/qa). Exit status: 0 when every file passed, 1 otherwise.
#
# Example: qa/gpu_tests.sh gemm grouped_gemm -- -x
set -euo pipefail
source "$(dirname "$0")/common.sh"

QA_VALUE_OPTIONS=time-limit
qa_parse "$@"
time_limit=${QA_OPT[time-limit]:-900}
files=(${QA_POS[@]+"${QA_POS[@]}"})
pytest_args=(${QA_REST[@]+"${QA_REST[@]}"})

if [ ${#files[@]} -eq 0 ] || [ "${files[0]}" = all ]; then
    files=(tests/test_*.py)
fi
resolved=()
for f in "${files[@]}"; do
    for candidate in "$f" "tests/$f" "tests/test_$f.py" "tests/$f.py"; do
        if [ -f "$candidate" ]; then resolved+=("$candidate"); continue 2; fi
    done
    qa_die "no test file $f (tried tests/test_$f.py)"
done

workers=()
if [ "${WORKERS:-8}" != 0 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
    workers=(-n "${WORKERS:-8}")
fi

for f in "${resolved[@]}"; do
    stem=$(basename "$f" .py)
    log="$OUT/gpu_tests/$stem.log"
    cmd=(timeout -s TERM -k 30 "$time_limit" "$PYTHON" -m pytest "$f" -m gpu -p no:cacheprovider -o addopts=
         -rfEs --tb=short ${workers[@]+"${workers[@]}"} --junitxml "$OUT/gpu_tests/$stem.xml"
         ${pytest_args[@]+"${pytest_args[@]}"})
    qa_step --pytest "$stem" "$log" "${cmd[@]}"
done
qa_finish gpu_tests
