"""Tests for the turbo-dispatch command line (turbo_dispatch.cli)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import turbo_dispatch
from turbo_dispatch import ConfigError, GlobalBackendManager
from turbo_dispatch.cli import main
from turbo_dispatch.device_platform import default_platform

GEMM_ARGS = ["explain", "gemm", "--m", "8192", "--n", "4096", "--k", "4096", "--dtype", "bf16"]
ENV = "PRIMUS_TURBO_GEMM_BACKEND"


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch):
    """Each test starts and ends with no code settings and no gemm env setting."""
    monkeypatch.delenv(ENV, raising=False)
    GlobalBackendManager.reset()
    yield
    monkeypatch.undo()  # restore the environment before re-reading it
    GlobalBackendManager.reset()


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "gemm" in out and "TORCH" in out and "available" in out
    assert torch.__version__ in out
    assert "versions:" in out
    assert re.search(rf"^\s*turbo_dispatch\s+{re.escape(turbo_dispatch.__version__)}$", out, re.M)
    for op in ("gemm_fp8", "grouped_gemm", "grouped_gemm_fp8", "attention", "moe_dispatch_combine"):
        assert re.search(rf"\s{op}\s", out), op
    assert "CUDNN" in out  # registered for attention; unavailable here, with its reason


def test_explain_bf16(capsys):
    assert main(GEMM_ARGS + ["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "op:      gemm\n" in out
    assert "backend: TORCH" in out and "source:  default" in out
    assert "m=8192,n=4096,k=4096" in out and "platform=cpu" in out


def test_explain_default_device_follows_torch(capsys):
    assert main(GEMM_ARGS) == 0
    expected = default_platform()
    assert f"platform={expected}" in capsys.readouterr().out


def test_explain_fp8_rowwise(capsys):
    assert main(GEMM_ARGS + ["--fp8", "rowwise", "--trans-b", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "op:      gemm_fp8" in out
    assert "backend: TORCH" in out and "source:  default" in out
    assert "granularity=rowwise" in out and "trans_b=1" in out


@pytest.mark.parametrize("recipe, expected", [
    (["--fp8", "blockwise"], "granularity=blockwise,block_size=128"),
    (["--fp8", "mx", "--format", "hybrid"], "granularity=mx_blockwise,block_size=32"),
    (["--fp8", "tensorwise", "--format", "e5m2", "--out-dtype", "fp32"], "out_dtype=fp32,a_fp8=e5m2,b_fp8=e5m2"),
])
def test_explain_fp8_recipes(capsys, recipe, expected):
    assert main(GEMM_ARGS + recipe + ["--device", "cpu"]) == 0
    assert expected in capsys.readouterr().out


def test_explain_bad_recipe_is_an_error(capsys):
    assert main(GEMM_ARGS + ["--fp8", "tensorwise", "--block-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "block_size" in err and "Traceback" not in err


def test_explain_bogus_env_backend(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "bogus")
    # reset() re-reads the environment and rejects the value at once ...
    with pytest.raises(ConfigError):
        GlobalBackendManager.reset()
    # ... and drops the old snapshot, so every later call fails the same way (no stale settings).
    assert main(GEMM_ARGS) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: ") and "Traceback" not in captured.err
    assert "bogus" in captured.err and "valid backends:" in captured.err and "TORCH" in captured.err


def test_explain_pinned_unregistered_backend(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "CUDNN")  # a known backend name that registers no gemm adapter
    GlobalBackendManager.reset()
    assert main(GEMM_ARGS) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert "CUDNN is not registered for gemm" in err


def test_usage_errors_return_2(capsys):
    assert main([]) == 2
    assert main(["explain", "gemm", "--m", "0", "--n", "1", "--k", "1"]) == 2
    assert main(GEMM_ARGS + ["--format", "e5m2"]) == 2  # an fp8 option without --fp8
    assert "add --fp8" in capsys.readouterr().err


def test_help_returns_0(capsys):
    assert main(["--help"]) == 0
    assert "backends" in capsys.readouterr().out


def _console_script() -> list[str]:
    """The installed turbo-dispatch script (next to this interpreter, else on PATH), else -m."""
    here = Path(sys.executable).with_name("turbo-dispatch")
    script = str(here) if here.is_file() else shutil.which("turbo-dispatch")
    return [script] if script else [sys.executable, "-m", "turbo_dispatch.cli"]


def test_console_script_backends(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMUS_TURBO_")}
    proc = subprocess.run(_console_script() + ["backends"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "TORCH" in proc.stdout and "versions:" in proc.stdout
