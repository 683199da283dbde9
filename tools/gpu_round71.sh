#!/usr/bin/env bash
# Sixteenth session, third call. (1) ncu on the staged token-run quantiser (the default now) and
# torch's clone of DeepSeek-V3's x: stall reasons, issue rate, DRAM throughput. (2) The probe's
# sweep: staged launches (transposed chunk 16, read chunk 64, 8 warps, maxnreg 80) bit-checked
# and timed next to the shipped (32, 32, 4, 96).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 150 ncu --clock-control none --kernel-name regex:"dual_quantize|elementwise|copy" --launch-count 4 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section InstructionStats python3 tools/ncu_dual_quantize.py > $OUT/ncu.txt 2>&1; echo "ncu rc=$?"
grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|L2 Hit|Memory Throughput|Compute \(SM\)|Executed Ipc|L1/TEX Hit|Mem Busy|Max Bandwidth|Mem Pipes" $OUT/ncu.txt | cut -c1-150 | head -80
timeout -s TERM 240 python3 tools/probe_grouped_step.py --sweep --shapes qwen3_down \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|Error" $OUT/probe.log | grep -v "tiles=True" | cut -c1-300
