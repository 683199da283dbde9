#!/usr/bin/env bash
# Ran at commit 5020bde: its probe options (--diagnose, --compare-module) and kernel knobs were
# reverted in the next commit; this script is kept as the record of what ran.
# Fourteenth session, second call. The wgrad's overlapped promotion (gluon-wgrad-r5: a 64-row math
# warpgroup keeps its next K step's wgmma in flight while it promotes the previous one).
# (1) Its triton 3.6 compile. (2) The float64 wgrad tests (overlapped and not). (3) The wgrad probe:
# overlapped against not, the promotion cut down (timing only), and the previous revision (r3,
# copied next to it) in the same run. (4) The EP8 blockwise whole op. (5) The quantiser bit test
# (quantize.py's NaN-carrying max now one helper).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
timeout -s TERM 90 python3 tools/compile_sm90.py --only grouped_wgrad_fp8_blockwise_gluon_ws 2>&1 | grep -E "^(PASS|FAIL)|^triton"
timeout -s TERM 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_grouped_gemm.py -m gpu \
    -k "wgrad_warp_specialised or default_wgrad" --tb=short > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest.log | cut -c1-300 | head -20
timeout -s TERM 120 python3 tools/probe_wgrad_ws.py --diagnose --compare-module fp8_blockwise_wgrad_ws_r3 \
    --out $OUT/probe_wgrad.jsonl --shapes dsv3_w13,dsv3_w2,qwen3_w13,qwen3_w2 --routings balanced,skewed,empty \
    > /dev/null 2>$OUT/probe_err.log; echo "probe rc=$?"
tail -3 $OUT/probe_err.log
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/probe_wgrad.jsonl") if l.strip()]
for r in rows:
    if "impl" in r:
        print(r.get("shape"), r.get("routing"), r["impl"], r.get("revision", ""), "promote", r.get("promote"),
              "overlap", r.get("overlap"), r.get("tflops") and round(r["tflops"], 1), r.get("ok"), r.get("rel"),
              r.get("error", ""))
PY
timeout -s TERM 230 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
timeout -s TERM 60 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemm.py -m gpu -k quantize_bit_exact \
    --tb=short > $OUT/pytest_bits.log 2>&1; echo "pytest bits rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_bits.log | cut -c1-300 | head -10
