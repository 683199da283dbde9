#!/usr/bin/env bash
# Twenty-fifth session, second call, on an NVIDIA H100: the blockwise CUDA-graph test after its
# captured output drops its autograd graph (no AccumulateGrad stream-mismatch warning expected),
# the other graph tests beside it, and probe_attention.py's torch varlen_attn line with causal
# passed as the installed torch takes it.
source tools/gpu_round_common.sh
timeout -s TERM 300 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfEw --tb=short \
    -k "cuda_graph" tests/test_triton_grouped_gemm.py tests/test_grouped_gemm.py > $OUT/pytest_graphs.log 2>&1
echo "pytest rc=$?"
grep -E "passed|failed|AccumulateGrad|^FAILED|^ERROR" $OUT/pytest_graphs.log | cut -c1-200 | head
timeout -s TERM 150 python3 tools/probe_attention.py > $OUT/attention.log 2>&1
echo "attention rc=$?"
tail -8 $OUT/attention.log | cut -c1-200
