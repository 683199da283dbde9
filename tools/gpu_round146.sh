#!/usr/bin/env bash
# Twenty-seventh session, fifth call, on an NVIDIA H100: the compiled attention path's backward
# op starting from the forward op's out and lse (cuDNN kernel op or FlashAttention-2), the
# attention GPU tests, then tools/probe_attention.py --only compiled (shipped against the
# recomputing backward before it, in one process). Round 142 ran the first form, which took
# FlashAttention for GQA causal where SDPA picks cuDNN (3.68 ms against 2.63); compiled calls now
# take the kernel their eager call (or SDPA's own choice) runs. Round 144: cuDNN takes GQA/MQA
# (torch 2.11+), the grid checks it; the probe times GPU work with the host covered, and host time.
# Round 145: compiled mode="reduce-overhead" (CUDA graphs) in the tests and the probe; round 146:
# the probe resets dynamo per variant (round 145 hit the recompile limit) and logs recompiles.
source tools/gpu_round_common.sh
# The tests ran in round 145 on the same library and test code (85 passed).
cd tools
TORCH_LOGS=recompiles timeout -s TERM 220 python3 probe_attention.py --only compiled > $OUT/attention_compiled.log 2>&1
echo "probe rc=$?"; grep -v "^W\|^  warn" $OUT/attention_compiled.log | tail -20 | cut -c1-220
