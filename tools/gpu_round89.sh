#!/usr/bin/env bash
# Nineteenth session, first call, on commit (see git log: "round 89 script"). What the quantisers'
# correctly rounded division costs: (1) the Gluon runs (TMA) and tiles kernels with
# dual_quantize_gluon.QUOTIENT_MODE 2 (shipped), 1 (a multiply by RN(1/scale)) and 0 (no
# per-element arithmetic) in turns on the sweep's operands, next to a clone; (2) ncu on DeepSeek-V3's
# x in the three modes; (3) the dual-quantiser GPU tests (the default mode's bits).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 200 python3 tools/probe_grouped_step.py --quotient --out $OUT/quotient.jsonl > $OUT/quotient.log 2>&1
echo "quotient rc=$?"; grep -E "quotient_sweep|Error|error" $OUT/quotient.log | cut -c1-400
timeout -s TERM 150 ncu --clock-control none --kernel-name regex:"dual_quantize|elementwise|copy" --launch-count 8 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section InstructionStats python3 tools/ncu_dual_quantize.py > $OUT/ncu.txt 2>&1; echo "ncu rc=$?"
grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Registers Per|Issued Warp|No Eligible|Eligible Warps|Memory Throughput|Executed Ipc|Mem Busy|Mem Pipes|Executed Instructions  " $OUT/ncu.txt | cut -c1-150 | head -90
timeout -s TERM 200 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -p no:cacheprovider --tb=short \
    -k "dual" > $OUT/pytest_dual.log 2>&1; echo "pytest dual rc=$?"
grep -E "^E |^FAILED|passed|failed|Error" $OUT/pytest_dual.log | cut -c1-300 | head -20
