#!/usr/bin/env bash
# One device call: the grouped fp8 op with the warp-specialised Gluon kernel as its blockwise
# default (forward and dgrad): the grouped GPU tests (fp8 recipes over odd / skewed / balanced
# routings, CUDA-graph capture), then the DeepSeek-V3 whole-op probe against bf16.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -x \
    tests/test_triton_grouped_gemm.py -k "fp8 or graph or full_op" 2>&1 | tee $OUT/pytest_grouped_ws.log | tail -8 || exit 1
timeout -s TERM 150 python3 tools/probe_triton_grouped.py --occupancy --budget 120 --out $OUT/probe_grouped_ws.jsonl \
    2>&1 | grep -v "^\[" | tail -4
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "probe_grouped_ws.jsonl")
for line in open(p) if os.path.exists(p) else []:
    r = json.loads(line)
    if "probe" in r or "kernel-only" in str(r.get("impl", "")):
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "path"})
PY
