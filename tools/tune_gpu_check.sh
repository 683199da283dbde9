#!/usr/bin/env bash
# Issue-4 GPU check: cold tuning of a model preset, a fresh process that reuses the DB, and the
# same DB loaded as a shipped DB. Writes logs and the DB under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().lower().replace(' ', '-'))")
db=$OUT/$name.jsonl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export PRIMUS_TURBO_TUNE_BUDGET_MS=${PRIMUS_TURBO_TUNE_BUDGET_MS:-500}
start=$(date +%s)
timeout ${TUNE_TIMEOUT:-400} python3 -m turbo_dispatch.cli tune --model llama3.1-8b --ops gemm,gemm_fp8 \
    --db "$db" --no-progress 2>&1 | tee $OUT/tune.log
echo "tune wall time: $(( $(date +%s) - start )) s" | tee -a $OUT/tune.log
python3 -m turbo_dispatch.cli db show "$db" | tail -1 | tee -a $OUT/tune.log
echo "== fresh process, user DB =="
PRIMUS_TURBO_TUNE_DB="$db" PRIMUS_TURBO_AUTO_TUNE=1 PRIMUS_TURBO_TUNE_DB_SHIPPED=0 \
    python3 tools/db_reuse_check.py --json $OUT/reuse.json 2>&1 | tee $OUT/reuse.log
echo "== fresh process, the same file as a shipped DB =="
cp "$db" "turbo_dispatch/tuned/$name.jsonl"
PRIMUS_TURBO_TUNE_DB=off PRIMUS_TURBO_AUTO_TUNE=1 python3 tools/db_reuse_check.py 2>&1 | tail -3 | tee $OUT/shipped.log
python3 -m pytest -q -m gpu tests/test_tuning_db.py tests/test_gpu_capture.py 2>&1 | tail -4 | tee $OUT/pytest.log
