#!/usr/bin/env bash
# Twenty-fifth session, fourth call, on an NVIDIA H100 (round 134 again after the compiled backward moved to the padded path): the TORCH attention adapter's varlen path
# through torch.nn.attention.varlen.varlen_attn. The attention GPU tests (the new native-path
# tests against the float64 reference and under torch.compile, and every older one), then
# probe_attention.py: the varlen call through the op, the same call forced onto the padded path,
# dense, and torch's varlen_attn itself, in one process.
source tools/gpu_round_common.sh
timeout -s TERM 400 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfEs --tb=short \
    tests/test_attention.py > $OUT/pytest_attention.log 2>&1
echo "pytest rc=$?"
grep -E "passed|failed|^FAILED|^ERROR|^SKIPPED|^E " $OUT/pytest_attention.log | cut -c1-220 | head -30
cd tools && timeout -s TERM 150 python3 probe_attention.py > $OUT/attention.log 2>&1
echo "attention rc=$?"
tail -7 $OUT/attention.log | cut -c1-220
