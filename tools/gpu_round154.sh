#!/usr/bin/env bash
# Twenty-ninth session, first call, on an NVIDIA H100 (the code of commit 92b1636; its cache-hint switch was
# reverted after this round): the dual quantisers' fp8 stores with a cache
# hint (dual_quantize_gluon.STORE_HINT: 0 none, 1 streaming .cs, 2 evict_first), timed in turns
# next to a clone on the sweep's activations, gradients and expert weights, every variant checked
# bit for bit against the first; then the Gluon quantisers' bit-for-bit GPU tests under each hint.
source tools/gpu_round_common.sh
timeout -s TERM 300 python3 tools/probe_grouped_step.py --quantiser-sweep 'hint=0/1/2' \
    --out $OUT/hint_sweep.jsonl > $OUT/hint_sweep.log 2>&1
echo "sweep rc=$?"; grep -E "probe=(runs|tiles)_sweep" $OUT/hint_sweep.log | sed 's/probe=//' | cut -c1-200
timeout -s TERM 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/test_triton_grouped_gemm.py \
    -k "bit_for_bit or matches_quantize_cells" > $OUT/pytest_quant.log 2>&1
echo "pytest rc=$?"; grep -E "^FAILED|passed|failed" $OUT/pytest_quant.log | cut -c1-200 | head
