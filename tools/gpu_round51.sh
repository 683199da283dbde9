#!/usr/bin/env bash
# Issue 5, after round 50: tensorwise amax with one atomic per program, the gradient's two fp8
# copies freed one by one. GPU tests of the quantisers and the fp8 op paths, then the probe
# (bits with details, two-way quantiser sweep, weight amax sweep, profiled steps).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_gemm.py -k "quantize_bit_exact or fp8_fwd_dgrad" \
    tests/test_gpu_fp8_paths.py tests/test_fp8_saved_activation.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest.log
timeout -s TERM 240 python3 tools/probe_fp8_dense_step.py --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E '"check"|"profile"' $OUT/probe.jsonl | cut -c1-1200 | head -20
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/probe.jsonl"):
    r = json.loads(line)
    if r["kind"] == "quant":
        print(r["shape"], r["gran"], "clone %.3f two %.3f both %.3f best %s  (%.0f vs clone %.0f GB/s)" % (
            r["clone_ms"], r["two_calls_ms"], r["both_default_ms"], r["best"], r["both_default_gbs"], r["clone_gbs"]))
    if r["kind"] == "weight":
        k = {a: b for a, b in r.items() if a.startswith("k")}; n = {a: b for a, b in r.items() if a.startswith("n") and a != "nk"}
        print(r["nk"], r["gran"], "clone %.3f" % r["clone_ms"], "K default %.3f best %s %.3f" % (r["k_default"], *min(k.items(), key=lambda t: t[1])),
              "| N default %.3f best %s %.3f" % (r["n_default"], *min(n.items(), key=lambda t: t[1])))
PY
