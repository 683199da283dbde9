# Sourced by the qa/*.sh scripts (not run on its own): the repository root as working directory,
# the output folder, dry runs, and one status line per step, repeated in a summary at the end.
#
# Environment: OUT (default bench-out/qa), PYTHON (default python3), DRY_RUN=1 (same as --dry-run).

QA_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$QA_ROOT"
OUT=${OUT:-bench-out/qa}
PYTHON=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}
QA_FAILED=0
QA_SKIPPED=0
QA_LINES=()

# Prints the calling script's header comment (its usage), without the leading "# ".
qa_usage() {
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

qa_die() {
    echo "qa/$(basename "$0"): $*" >&2
    exit 2
}

# qa_parse ARGS...: the options every script takes (-h/--help, --dry-run) and the script's own:
# each word of QA_VALUE_OPTIONS names an option that takes a value, each of QA_FLAG_OPTIONS one
# that does not; qa_parse leaves them in QA_OPT[name] (a flag as 1), the positional arguments in
# QA_POS and everything after -- in QA_REST.
qa_parse() {
    QA_POS=()
    QA_REST=()
    declare -gA QA_OPT=()
    while [ $# -gt 0 ]; do
        case $1 in
            -h | --help) qa_usage; exit 0 ;;
            --dry-run) DRY_RUN=1 ;;
            --) shift; QA_REST=("$@"); break ;;
            --*)
                local name=${1#--}
                if [[ " ${QA_VALUE_OPTIONS:-} " == *" $name "* ]]; then
                    [ $# -ge 2 ] || qa_die "$1 needs a value"
                    QA_OPT[$name]=$2
                    shift
                elif [[ " ${QA_FLAG_OPTIONS:-} " == *" $name "* ]]; then
                    QA_OPT[$name]=1
                else
                    qa_die "unknown option $1 (see --help)"
                fi ;;
            -*) qa_die "unknown option $1 (see --help)" ;;
            *) QA_POS+=("$1") ;;
        esac
        shift
    done
}

# qa_step [--pytest] NAME LOG COMMAND...: runs COMMAND (an argv; environment through `env`) with
# its stdout and stderr in LOG, shows the log's last lines, records the status (exit 124 or 137,
# `timeout`'s: "time limit"). --pytest: a pytest run, whose exit 5 (no test selected, e.g. a file
# without GPU tests under -m gpu) counts as passed. Under --dry-run it prints the command instead.
qa_step() {
    local pytest=0
    if [ "$1" = --pytest ]; then pytest=1; shift; fi
    local name=$1 log=$2
    shift 2
    if [ "$DRY_RUN" = 1 ]; then
        printf '[dry-run] %s:' "$name"
        printf ' %q' "$@"
        printf '\n'
        return 0
    fi
    mkdir -p "$(dirname "$log")"
    echo "[qa] $name: $*"
    local rc=0
    "$@" > "$log" 2>&1 || rc=$?
    if [ $pytest = 1 ]; then
        grep -E "passed|failed|error|no tests ran" "$log" | tail -n 1 | sed 's/^/    /' || true
    else
        tail -n 5 "$log" | sed 's/^/    /'
    fi
    case $rc in
        0) qa_line "$name" ok "$log" ;;
        5) if [ $pytest = 1 ]; then qa_line "$name" "ok (no test selected)" "$log"
           else qa_line "$name" "FAILED (exit 5)" "$log"; QA_FAILED=1; fi ;;
        124 | 137) qa_line "$name" "FAILED (time limit)" "$log"; QA_FAILED=1 ;;
        *) qa_line "$name" "FAILED (exit $rc)" "$log"; QA_FAILED=1 ;;
    esac
}

# qa_skip NAME REASON: records a step that cannot run here.
qa_skip() {
    qa_line "$1" "SKIPPED ($2)" "-"
    QA_SKIPPED=1
}

qa_line() {
    QA_LINES+=("$(printf '%-44s %-24s %s' "$1" "$2" "$3")")
    echo "[qa] $1: $2"
}

# qa_finish NAME: prints the summary (also written to $OUT/NAME_summary.txt) and exits 1 when a
# step failed, 2 when none failed but one was skipped, else 0.
qa_finish() {
    [ "$DRY_RUN" = 1 ] && exit 0
    mkdir -p "$OUT"
    {
        echo "qa/$1.sh summary ($(date '+%Y-%m-%d %H:%M'), $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
        printf '%s\n' ${QA_LINES[@]+"${QA_LINES[@]}"}
    } | tee "$OUT/$1_summary.txt"
    [ "$QA_FAILED" = 1 ] && exit 1
    [ "$QA_SKIPPED" = 1 ] && exit 2
    exit 0
}
