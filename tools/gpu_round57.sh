#!/usr/bin/env bash
# Twelfth session, second call. (1) The blockwise GEMM-only bench again, now fair in layout: the
# activation's 1x128 scales stored M-major (as our quantiser writes them and cuBLASLt reads them)
# and the peer's F.scaled_mm arguments built once, so that no candidate copies scales inside its
# timing (round 56: the best-tile row read row-major scales from global memory, and the peer and
# the dispatched op copied them per call). The dispatched rows name their choice. (2) The bf16
# grouped sweep at 4096 tokens per expert (EP 8/16/32), scored per routing. (3) GROUP_M 16 beside
# 8 for the warp-specialised blockwise kernel at the large dense shapes, where round 56's best
# tile lost most to cuBLASLt.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
res=$OUT/res; mkdir -p $res
timeout -s TERM 180 python3 benchmarks/bench_gemm.py --dtype fp8 --granularity blockwise --mb 1 --tune-budget-ms 300 \
    --out-dir $res > $OUT/bench_blockwise.log 2>&1; echo "blockwise rc=$?"
timeout -s TERM 230 python3 benchmarks/bench_grouped_gemm.py --dtype bf16 --ep 8,16,32 --tokens-per-expert 4096 \
    --name bf16_grouped_gemm_tpe4096 --target-ms 60 --tune-budget-ms 300 --out-dir $res \
    > $OUT/bench_grouped_4096.log 2>&1; echo "grouped bf16 tpe4096 rc=$?"
for f in $res/*.md; do echo "## $f"; grep -E "^- (elapsed|INTERRUPTED)" $f | head -3
  awk '/^## Score/{f=1} /^## All rows/{f=0} f' $f | grep "^| [a-z]" | grep -v "^| op "; done
grep "turbo autotune" $res/*blockwise*.csv | awk -F, '{print $2, $12, $NF}' | cut -c1-160
timeout -s TERM 150 python3 tools/probe_gluon_ws.py --shapes 4096x106496x16384,4096x57344x8192,4096x8192x28672,4096x7168x16384 \
    --tiles 256:3,256:3:16,256:4,256:4:16 --out $OUT/ws_groupm.jsonl > $OUT/ws_groupm.log 2>&1; echo "ws probe rc=$?"
grep -E "shape=|FAIL" $OUT/ws_groupm.log | cut -c1-200 | tail -30
rm -f $res/*.png
