#!/usr/bin/env bash
# Ran at commit 5020bde: its probe options (--diagnose, --compare-module) and kernel knobs were
# reverted in the next commit; this script is kept as the record of what ran.
# Fourteenth session, first call. (1) The wgrad kernel restructured (gluon-wgrad-r5: x's rows in
# 64-row pieces, an optional third math warpgroup for a 192-row tile): its triton 3.6 compile and
# the float64 wgrad tests. (2) What the promotion costs: the default config as shipped, with the
# row scales only and with no promotion (timing only), the 192-row tile, and the previous revision
# (r3, copied next to it) in the same run. (3) Which kernels one blockwise step runs, and for how
# long (torch.profiler), at DeepSeek-V3 up_gate and Qwen3 down, against the bf16 step.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 90 python3 tools/compile_sm90.py --only grouped_wgrad_fp8_blockwise_gluon_ws 2>&1 | grep -E "^(PASS|FAIL)|^triton"
timeout -s TERM 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_grouped_gemm.py -m gpu \
    -k "wgrad_warp_specialised or default_wgrad" --tb=short > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest.log | cut -c1-300 | head -20
timeout -s TERM 200 python3 tools/probe_wgrad_ws.py --diagnose --compare-module fp8_blockwise_wgrad_ws_r3 \
    --out $OUT/probe_wgrad.jsonl --shapes dsv3_w13,dsv3_w2,qwen3_w13,qwen3_w2 --routings balanced,skewed \
    > /dev/null 2>$OUT/probe_err.log; echo "probe rc=$?"
tail -3 $OUT/probe_err.log
python3 - <<'PY'
import json, os
rows = [json.loads(l) for l in open(os.environ["OUT"] + "/probe_wgrad.jsonl") if l.strip()]
for r in rows:
    if "impl" in r:
        print(r.get("shape"), r.get("routing"), r["impl"], r.get("revision", ""), "promote", r.get("promote"),
              r.get("tflops") and round(r["tflops"], 1), r.get("ok"), r.get("rel"), r.get("error", ""))
PY
timeout -s TERM 150 python3 tools/probe_grouped_step.py --kernels dsv3_up,qwen3_down --out $OUT/kernels.jsonl \
    2>&1 | grep -E "probe=|Error|error" | cut -c1-220; echo "kernels rc=$?"
