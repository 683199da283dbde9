# Sourced by the GPU round scripts (tools/gpu_roundNNN.sh from round 133 on): what every device
# call does first. Installs this checkout without touching the image's torch/triton, and records
# the GPU, its driver, its top SM clock and its temperature before the round's work starts.
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
