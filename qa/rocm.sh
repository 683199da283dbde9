#!/usr/bin/env bash
# Usage: qa/rocm.sh [--dry-run] [--force] [--time-limit S]
#
# What a ROCm machine (an AMD Instinct GPU, torch built for HIP) should run, in order:
#   1. turbo-dispatch backends: what this machine offers, and why not (logged);
#   2. tests/test_rocm_adapters.py whole: the contract tests on the stand-in aiter, and its
#      gpu-marked tests, which run AITER and CK on this GPU against float64 references
#      (install amd-aiter, and ck4inductor for CK's Inductor config, first; docs/rocm.md);
#   3. tools/compile_rocm.py for this GPU's architecture (the Triton kernels' fit);
#   4. every GPU-marked test file (qa/gpu_tests.sh all);
#   5. the benchmark families that have a ROCm path (qa/perf.sh: gemm, gemm_fp8, grouped_gemm,
#      grouped_gemm_fp8, dispatch_overhead, wrappers, attention; blaslt_switch times cuBLAS's
#      preferred-library switch and is left out).
#
# NOT YET RUN: no AMD GPU has run this script (or any of this repository's GPU code) so far; every
# figure in docs/performance.md comes from NVIDIA H100/H200. Expect the first run to find
# failures: the tests and families are the ones the CUDA machines run, and nothing ROCm-specific
# (HIPBLASLT, the Triton kernels compiled for AMD, torch's HIP kernels behind TORCH) has run on
# hardware.
#
#   --force        run even where torch is not a ROCm build (to rehearse the commands on CUDA).
#   --time-limit S seconds per test file and per benchmark family (default 900 and 540).
#   --dry-run      print the commands, run nothing.
#
# Output: $OUT/backends.log, $OUT/rocm_adapters.log, $OUT/compile_rocm.{log,json}, $OUT/gpu_tests/,
# $OUT/perf/ and their summaries (OUT default bench-out/qa/rocm).
# Exit status: 1 when a test file or a family failed, else 0.
#
# Example: qa/rocm.sh
set -euo pipefail
export OUT=${OUT:-bench-out/qa/rocm}
source "$(dirname "$0")/common.sh"

QA_VALUE_OPTIONS=time-limit QA_FLAG_OPTIONS=force
qa_parse "$@"
[ ${#QA_POS[@]} -eq 0 ] && [ ${#QA_REST[@]} -eq 0 ] || qa_die "no positional arguments (see --help)"
test_limit=${QA_OPT[time-limit]:-900}
perf_limit=${QA_OPT[time-limit]:-540}
export DRY_RUN  # the scripts below print their commands too

if [ "$DRY_RUN" != 1 ] && [ -z "${QA_OPT[force]:-}" ]; then
    hip=$("$PYTHON" -c "import torch; print(torch.version.hip or '')" 2>/dev/null || true)
    if [ -z "$hip" ]; then
        qa_die "this torch is not a ROCm build (torch.version.hip is empty); --force runs anyway"
    fi
    echo "[qa] ROCm: HIP $hip; $("$PYTHON" -c "import torch; print(torch.cuda.get_device_name())" 2>&1)"
fi

arch=gfx942  # what --dry-run prints; a real run asks the GPU
if [ "$DRY_RUN" != 1 ]; then
    arch=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_properties(0).gcnArchName.split(':')[0])" \
           2>/dev/null || echo gfx942)
fi
qa_step backends "$OUT/backends.log" "$PYTHON" -m turbo_dispatch.cli backends
qa_step --pytest rocm_adapters "$OUT/rocm_adapters.log" timeout -s TERM -k 30 "$test_limit" \
    "$PYTHON" -m pytest tests/test_rocm_adapters.py -p no:cacheprovider -o addopts= -rfEs --tb=short \
    --junitxml "$OUT/rocm_adapters.xml"
qa_step compile_rocm "$OUT/compile_rocm.log" timeout -s TERM -k 30 "$test_limit" \
    "$PYTHON" tools/compile_rocm.py --arch "$arch" --json "$OUT/compile_rocm.json"

rc=$QA_FAILED
qa/gpu_tests.sh --time-limit "$test_limit" all || rc=1
qa/perf.sh --time-limit "$perf_limit" gemm gemm_fp8 grouped_gemm grouped_gemm_fp8 \
    dispatch_overhead wrappers attention || rc=1
exit $rc
