#!/usr/bin/env bash
# One device call: ncu on the one-tile Gluon quantiser with 1, 2 and 4 columns per thread in its
# transposed pass and on torch's clone; dual-quantiser GPU tests; the sweep with the column
# layouts and every Gluon variant bit-checked against the Triton kernel.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
timeout -s TERM 150 ncu --clock-control none --kernel-name regex:"dual_quantize|elementwise|copy" --launch-count 8 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats python3 tools/ncu_dual_quantize.py > $OUT/ncu.txt 2>&1; echo "ncu rc=$?"
grep -E "^  [_a-zA-Z].*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|L2 Hit|Memory Throughput|Compute \(SM\)" $OUT/ncu.txt | cut -c1-150 | head -120
timeout -s TERM 120 python3 -m pytest -q -m gpu tests/test_triton_grouped_gemm.py -k "quantize_cells or gluon_dual" \
    -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"; tail -3 $OUT/pytest.log
timeout -s TERM 200 python3 tools/probe_grouped_step.py --sweep --shapes dsv3_up \
    --out $OUT/probe.jsonl > $OUT/probe.log 2>&1; echo "probe rc=$?"
grep -E "dual_sweep_geomean|dual_best|FAIL|error=[A-Z]|probe=step|probe=quantisers" $OUT/probe.log | cut -c1-300
