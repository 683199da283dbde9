#!/usr/bin/env bash
# Twenty-third session, fifth call, on an NVIDIA H100: the eager blockwise step's host time before
# and after this session's adapter trims, in the same call. old_src.tar (not committed) is
# `git archive` of commit 1cbde81, the last before them; each version is installed into
# its own folder and put first on PYTHONPATH, and the probe (this tree's tools/probe_host_layers.py,
# which only reads functions both versions have) runs three times per version, in turns.
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
mkdir -p /tmp/old /tmp/old_site /tmp/new_site
tar -xf old_src.tar -C /tmp/old
python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/old_site /tmp/old 2>&1 | tail -2
python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/new_site . 2>&1 | tail -2
for v in old new; do
  PYTHONPATH=/tmp/${v}_site python3 -c "import turbo_dispatch.backends.triton.grouped_gemm as g; \
print('$v', g.__file__, hasattr(g, '_fp8_configs_for'))"
done
LAYERS=step,forward,backward,run_fp8,adapter_run,bf16_step
for i in 1 2 3; do
  for v in old new; do
    PYTHONPATH=/tmp/${v}_site timeout -s TERM 80 python3 tools/probe_host_layers.py --shape qwen3_down \
        --layers $LAYERS --reps 15 --out $OUT/host_${v}_$i.jsonl > $OUT/host_${v}_$i.log 2>&1
    echo "$v $i rc=$?"; grep -E "host_layer" $OUT/host_${v}_$i.log | sed 's/probe=host_layer shape=qwen3_down //'
  done
done
