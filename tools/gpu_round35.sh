#!/usr/bin/env bash
# One device call: the dual quantiser's transposed-second-load launches (bit checks on every
# launch, a timed sweep on DeepSeek-V3 / Qwen3 / GPT-OSS operands), ncu on the old and new runs
# launch, the step probe at Qwen3 down and DeepSeek-V3 up_gate, then the GPU step tests.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
cat > $OUT/ncu_dual.py <<'PY'
import torch
import turbo_dispatch.backends.triton.dual_quantize as DQ
x = torch.randn(1, 32768, 7168, device="cuda", dtype=torch.bfloat16)
for launch in ((64, 4, 0, False), (16, 4, 0, True)):
    DQ.LAUNCH[False] = launch
    for _ in range(2):
        DQ.dual_quantize(x, torch.float8_e4m3fn, 128, False)
torch.cuda.synchronize()
PY
timeout -s TERM 120 ncu --clock-control none --kernel-name regex:_dual_quantize --launch-skip 1 --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 $OUT/ncu_dual.py > $OUT/ncu_dual.txt 2>&1; echo "ncu rc=$?"
grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|L2 Hit|Theoretical Occ" $OUT/ncu_dual.txt | head -60
timeout -s TERM 240 python3 tools/probe_grouped_step.py --sweep --shapes qwen3_down,dsv3_up --out $OUT/probe.jsonl \
    > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_best|geomean|FAIL|step |quantisers|Error|error" $OUT/probe.log | head -60
timeout -s TERM 200 python3 -m pytest -q -x -m gpu tests/test_triton_grouped_gemm.py \
    -k "training_step or full_op or every_recipe" -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
tail -5 $OUT/pytest.log
