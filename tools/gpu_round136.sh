#!/usr/bin/env bash
# Twenty-fifth session, fifth call, on an NVIDIA H100: after the review mend (one CUDA-graph
# capture helper, probe_record.capture_graph, for four probes; one per-sequence varlen reference
# in the attention tests), a short run of each probe that now captures through it, and the
# attention GPU tests.
source tools/gpu_round_common.sh
timeout -s TERM 150 python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE --tb=short \
    tests/test_attention.py > $OUT/pytest_attention.log 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|^FAILED" $OUT/pytest_attention.log | cut -c1-200
cd tools
timeout -s TERM 110 python3 probe_overlap.py --shapes qwen3_down_ep8 --caps 132,116 --pair-caps 116 \
    --out $OUT/overlap.jsonl > $OUT/overlap.log 2>&1; echo "overlap rc=$?"; tail -2 $OUT/overlap.log | cut -c1-220
timeout -s TERM 80 python3 probe_sustained_step.py --seconds 0.6 --segments 1 \
    --shapes qwen3-30b-a3b/down/EP8/4096tpe/balanced --out $OUT/sustained.jsonl > $OUT/sustained.log 2>&1
echo "sustained rc=$?"; tail -2 $OUT/sustained.log | cut -c1-220
timeout -s TERM 100 python3 probe_step_capture.py > $OUT/step_capture.log 2>&1; echo "step_capture rc=$?"
cat $OUT/step_capture.log | cut -c1-200
timeout -s TERM 120 python3 probe_grouped_step.py --shapes qwen3_down --graphs --out $OUT/grouped_step.jsonl \
    > $OUT/grouped_step.log 2>&1; echo "grouped_step rc=$?"; grep step_graph $OUT/grouped_step.log | cut -c1-220
