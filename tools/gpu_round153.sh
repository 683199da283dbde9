#!/usr/bin/env bash
# Twenty-eighth session, fifth call, on an NVIDIA H100: side_by_side without record_stream.
# (1) The GPU tests of the two-stream paths and the grouped op; (2) the new reuse test with the
# callers' wait removed (a mutation: it must fail); (3) host and GPU time of the eager step with
# the forks as they are now, as they were (record_stream), and without forks, in turns.
source tools/gpu_round_common.sh
timeout -s TERM 330 python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -n 8 \
    tests/test_grouped_gemm.py tests/test_weight_reuse.py \
    tests/test_triton_grouped_gemm.py \
    > $OUT/pytest_grouped.log 2>&1; echo "pytest rc=$?"; tail -4 $OUT/pytest_grouped.log
timeout -s TERM 60 python3 - > $OUT/mutation.log 2>&1 <<'PY'
import pytest, sys
from turbo_dispatch.backends import quantizer
quantizer._wait_for_callers = lambda side, current, index: side.wait_stream(current)  # the mutation
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", "-m", "gpu",
                      "tests/test_triton_grouped_gemm.py::test_gpu_side_output_block_reused_after_the_caller_switched_streams"]))
PY
echo "mutation rc=$? (must be 1)"; tail -3 $OUT/mutation.log
for s in qwen3_down qwen3_up dsv3_down; do
  timeout -s TERM 100 python3 tools/probe_host_alloc.py --shape $s --record-only --reps 10 --out $OUT/record_$s.jsonl > $OUT/record_$s.log 2>&1
  echo "record $s rc=$?"; grep -E "^probe" $OUT/record_$s.log | cut -c1-330
done
