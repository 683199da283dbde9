#!/usr/bin/env bash
# Twenty-fourth session, first call, on an NVIDIA H100: does TMA multicast across a 2-CTA cluster
# lift the blockwise fp8 GEMM? tools/cuda_probe/fp8_blockwise_cluster.cu (plain CUDA: the device's
# Triton 3.6 Gluon has no multicast) checked against float32 and timed in turns with the Gluon WS
# kernel and cuBLAS blockwise (tools/probe_cuda_multicast.py), then one launch of each under ncu.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
nvcc --version | tail -1
cd tools
timeout -s TERM 300 python3 probe_cuda_multicast.py --out $OUT/multicast.jsonl 2>&1 | tee $OUT/multicast.log | cut -c1-300
echo "probe rc=$?"
M="gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum.per_second,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed"
timeout -s TERM 200 ncu --clock-control none --metrics $M -k "regex:fp8bw|blockwise|gemm|sm90" -c 6 \
    python3 probe_cuda_multicast.py --once --shapes 32768x4096x7168 --out $OUT/ncu_once/x.jsonl > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"
grep -E "fp8bw|kernel|Kernel|gpu__time|cycles_elapsed|lts__|l1tex|pipe_fma|issue_active|dram__" $OUT/ncu.txt | cut -c1-160 | head -60
