"""The training examples (examples/) run on the CPU with their tiny presets and their loss falls.

Each runs in a subprocess, as a user would start it (train_moe.py under torchrun with 2 gloo
ranks), with the tuning DBs off so that the run does not depend on what this machine has stored.
"""
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FINAL = re.compile(r"^final loss (\S+) \(first (\S+)\)$", re.MULTILINE)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMUS_TURBO_")}
    env.update(PRIMUS_TURBO_TUNE_DB="off", PRIMUS_TURBO_TUNE_DB_SHIPPED="0")
    return env


def _final_and_first(proc: subprocess.CompletedProcess) -> tuple[float, float]:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    found = FINAL.findall(proc.stdout)
    assert len(found) == 1, proc.stdout
    final, first = map(float, found[0])
    assert math.isfinite(final) and math.isfinite(first), proc.stdout
    return final, first


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fp8", ["none", "rowwise"])
def test_train_llama_tiny_loss_falls(fp8):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_llama.py"), "--tiny", "--steps", "8",
                           "--no-progress", "--fp8", fp8], env=_env(), capture_output=True, text=True, timeout=300)
    final, first = _final_and_first(proc)
    assert final < first, proc.stdout
    assert f"fp8 {fp8}" in proc.stdout and "step 8/8 loss" in proc.stdout


def test_train_moe_tiny_under_torchrun_loss_falls():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_free_port()), str(EXAMPLES / "train_moe.py"), "--tiny", "--steps", "4",
                           "--no-progress"], env=_env(), capture_output=True, text=True, timeout=300)
    final, first = _final_and_first(proc)
    assert final < first, proc.stdout
    assert "moe: 2 ranks" in proc.stdout and "(4 per rank)" in proc.stdout
    # rank 0 alone prints the (rank-averaged) losses
    assert len(re.findall(r"^step \d+/4 loss ", proc.stdout, re.MULTILINE)) == 4, proc.stdout
