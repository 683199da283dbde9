#!/usr/bin/env bash
# Nineteenth session, eighth call: bisect round 95's three failures of tests/test_grouped_gemm.py
# on the GPU (fp32-input blockwise128 a.grad NaN, the rowwise _scaled_grouped_mm expectation):
# HEAD; HEAD with side_by_side serial; HEAD with unpadded row scales; the session's base 3667a1c.
set -o pipefail
export PYTHONUNBUFFERED=1
K="fp8_dtypes and cuda or scaled_grouped_mm_is_used"
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
for v in head serial unpadded; do
  case $v in head) P="";; serial) P="-p serial_plugin";; unpadded) P="-p unpadded_plugin";; esac
  PYTHONPATH=$PWD/tools/round96_plugins timeout -s TERM 100 python3 -m pytest -q tests/test_grouped_gemm.py -p no:cacheprovider \
     --tb=line $P -k "$K" > $OUT/bisect_$v.log 2>&1; echo "$v rc=$?"
  grep -E "^FAILED|passed|failed" $OUT/bisect_$v.log | cut -c1-200
done
# base_tree: git archive 3667a1c, unpacked in the working tree before the call (then removed)
cd base_tree && python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
timeout -s TERM 100 python3 -m pytest -q tests/test_grouped_gemm.py -p no:cacheprovider --tb=line -k "$K" \
   > $OUT/bisect_base.log 2>&1; echo "base rc=$?"
grep -E "^FAILED|passed|failed" $OUT/bisect_base.log | cut -c1-200
