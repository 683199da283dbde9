#!/usr/bin/env bash
# Twenty-seventh session, fourth call, on an NVIDIA H100: the compiled attention path's backward
# op starting from the forward op's out and lse (cuDNN kernel op or FlashAttention-2), the
# attention GPU tests, then tools/probe_attention.py --only compiled (shipped against the
# recomputing backward before it, in one process). Round 142 ran the first form, which took
# FlashAttention for GQA causal where SDPA picks cuDNN (3.68 ms against 2.63); compiled calls now
# take the kernel their eager call (or SDPA's own choice) runs. Round 144: cuDNN takes GQA/MQA
# (torch 2.11+), the grid checks it; the probe times GPU work with the host covered, and host time.
# Round 145: compiled mode="reduce-overhead" (CUDA graphs) in the tests and the probe.
# The same commands as round 142 (the library and tests changed between the rounds).
exec bash tools/gpu_round142.sh
