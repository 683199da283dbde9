# Sourced by the attention rounds (tools/gpu_round137.sh on): the attention GPU tests against the
# float64 reference, then tools/probe_attention.py's timings; leaves the shell in tools/.
timeout -s TERM 240 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfEs --tb=short \
    tests/test_attention.py > $OUT/pytest_attention.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|^FAILED|^SKIPPED|^ERROR" $OUT/pytest_attention.log | cut -c1-220
cd tools
timeout -s TERM 200 python3 probe_attention.py > $OUT/attention.log 2>&1; echo "attention rc=$?"
sed -n '/== flash_attn_func/,$p' $OUT/attention.log | cut -c1-260
