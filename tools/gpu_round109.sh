#!/usr/bin/env bash
# Twenty-first session, first call (commit: see git log, "round 109 script"), on an NVIDIA H200
# (same Hopper chip as the H100, HBM3e at a higher bandwidth): (1) a device-to-device copy's
# bandwidth, the quantisers' ceiling; (2) the GPU kernels of one fp8 blockwise step and one bf16
# step at DeepSeek-V3 and Qwen3-30B-A3B EP8 shapes; (3) the EP8 x 4096 blockwise whole-op bench,
# the same command as round 105 ran on the H100.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 - <<'PY' 2>&1 | tee $OUT/copy_bandwidth.log
import torch
x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); s.record()
for _ in range(10): y.copy_(x)
e.record(); torch.cuda.synchronize()
ms = s.elapsed_time(e) / 10
print(f"copy {2 * x.numel() * 2 / 1e9:.2f} GB moved in {ms:.3f} ms: {2 * x.numel() * 2 / ms / 1e9:.2f} TB/s")
PY
timeout -s TERM 150 python3 tools/probe_grouped_step.py --kernels dsv3_up_ep8,dsv3_down_ep8,qwen3_up,qwen3_down \
    --out $OUT/kernels.jsonl > $OUT/kernels.log 2>&1; echo "kernels rc=$?"
grep -E "kernels_total|probe=kernels " $OUT/kernels.log | cut -c1-220
res=$OUT/res; mkdir -p $res
timeout -s TERM 300 python3 benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity blockwise --ep 8 \
    --tokens-per-expert 4096 --backends TRITON --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    --name fp8_blockwise_grouped_gemm_ep8_tpe4096 > $OUT/bench_grouped.log 2>&1; echo "grouped rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
rm -f $res/*.png
