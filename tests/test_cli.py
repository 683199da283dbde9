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


GROUPED_ARGS = ["explain", "grouped_gemm", "--groups", "16", "--tokens", "65536", "--n", "2048", "--k", "768",
                "--device", "cpu"]


def test_explain_grouped_gemm_bf16_and_fp8(capsys):
    assert main(GROUPED_ARGS) == 0
    out = capsys.readouterr().out
    assert "op:      grouped_gemm\n" in out and "g=16,m=65536,n=2048,k=768,trans_b=1,variable_k=0" in out
    assert main(GROUPED_ARGS + ["--weight-kn", "--fp8", "blockwise", "--out-dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "op:      grouped_gemm_fp8\n" in out and "trans_b=0" in out and "out_dtype=fp32" in out
    assert "granularity=blockwise,block_size=128" in out and "backend: TORCH" in out


def test_explain_grouped_gemm_fp8_states_a_db_entrys_bf16_peer(tmp_path, capsys):
    """A tuned grouped_gemm_fp8 entry's comparison with the bf16 op reaches the command line."""
    from db_lines import db_file
    from turbo_dispatch.low_precision import Float8QuantConfig
    from turbo_dispatch.op_spec import get_op_spec
    from turbo_dispatch.registry import get_registry
    from turbo_dispatch.tuning.codec import encode_key
    from turbo_dispatch.tuning.stamp import current_stamp

    assert main(GROUPED_ARGS + ["--fp8", "blockwise"]) == 0
    key = capsys.readouterr().out.split("key:", 1)[1].split()[0]
    spec = get_op_spec("grouped_gemm_fp8")
    a = torch.empty(65536, 768, dtype=torch.bfloat16, device="meta")
    b = torch.empty(16, 2048, 768, dtype=torch.bfloat16, device="meta")
    lens = torch.empty(16, dtype=torch.int64, device="meta")
    cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
    problem = spec.shared_problem(spec.problem_from_call(a, b, lens, config=cfg))._replace(platform="cpu")
    identity = get_registry().get("grouped_gemm_fp8", "TORCH").adapter.identity(None)
    db = db_file(tmp_path / "db.jsonl", [{
        "type": "result", "stamp": current_stamp("cpu").id, "op": "grouped_gemm_fp8", "key": encode_key(problem),
        "backend": "TORCH", "config": None, "identity": identity, "time_ms": 1.39, "peer_op": "grouped_gemm",
        "peer_backend": "TORCH", "peer_us": 930.0, "peer_winner_us": 1390.0}])
    GlobalBackendManager.set_tune_db(db)
    assert main(GROUPED_ARGS + ["--fp8", "blockwise"]) == 0
    out = capsys.readouterr().out
    assert key in out and "source:  tuned-db" in out
    assert "bf16 peer grouped_gemm TORCH: 0.930 ms per call; this fp8 choice 1.390 ms = 0.67x its speed: " \
           "fp8 loses on this key" in out


def test_explain_grouped_gemm_usage_errors(capsys):
    assert main(GROUPED_ARGS + ["--out-dtype", "fp32"]) == 2
    assert "--out-dtype applies to the fp8 op" in capsys.readouterr().err
    assert main(["explain", "grouped_gemm", "--groups", "0", "--tokens", "1", "--n", "1", "--k", "1"]) == 2


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
