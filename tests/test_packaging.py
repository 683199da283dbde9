"""The wheel ships the adapters and registry.yaml inside turbo_dispatch, and works installed.

Builds a wheel from a copy of the source tree, installs it into a fresh virtual environment
(no system site-packages, no editable dev install), and runs the console script there.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
# Build outputs and caches that must not leak into the copy we build from (a stale build/lib
# would put files into the wheel that the source tree no longer has).
_IGNORE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                 ".venv", ".whl", "*.pyc")


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _isolated_env() -> dict[str, str]:
    """The environment minus anything that would put the dev tree or user packages on sys.path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV") and not k.startswith("PRIMUS_TURBO_")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.mark.slow
def test_wheel_installs_and_runs(tmp_path):
    env = _isolated_env()

    # 1. Build the wheel from a clean copy of the source tree.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=_IGNORE)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q", "-w", dist],
         cwd=tmp_path, env=env)
    wheels = list(dist.glob("turbo_dispatch-*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]

    names = zipfile.ZipFile(wheel).namelist()
    assert "turbo_dispatch/registry.yaml" in names
    assert "turbo_dispatch/backends/torch/gemm.py" in names
    assert "turbo_dispatch/cli/__init__.py" in names and "turbo_dispatch/cli/__main__.py" in names
    shipped = sorted(p.name for p in (REPO / "turbo_dispatch" / "tuned").glob("*.jsonl"))
    assert shipped and all(f"turbo_dispatch/tuned/{name}" in names for name in shipped), "shipped tuning DBs missing"
    assert not [n for n in names if n.split("/")[0] == "backends"], "wheel ships a top-level 'backends'"

    # 2. Install it into a fresh venv that does not see the dev environment's site-packages.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=tmp_path, env=env)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel], cwd=tmp_path, env=env)

    # torch and PyYAML come from the current interpreter: their site-packages directories go on
    # the new venv's sys.path through a .pth file. Lines of a .pth are appended after the venv's
    # own site-packages, and .pth files inside those directories are not processed, so the dev
    # install's editable finder stays out.
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path, env=env)
    deps = dict.fromkeys(str(Path(m.__file__).resolve().parent.parent) for m in (torch, yaml))
    (Path(site.stdout.strip()) / "zz_host_deps.pth").write_text("\n".join(deps) + "\n")

    # 3. The console script works, and the package comes from the venv, not the repo.
    proc = _run([bindir / "turbo-dispatch", "backends"], cwd=tmp_path, env=env)
    assert "TORCH" in proc.stdout and "gemm" in proc.stdout

    check = (
        "import importlib.util, os, turbo_dispatch, turbo_dispatch.backends.torch.gemm as g\n"
        f"repo = {str(REPO)!r}\n"
        "assert 'site-packages' in turbo_dispatch.__file__, turbo_dispatch.__file__\n"
        "assert not turbo_dispatch.__file__.startswith(repo), turbo_dispatch.__file__\n"
        "assert g.__file__.startswith(os.path.dirname(turbo_dispatch.__file__)), g.__file__\n"
        "assert importlib.util.find_spec('backends') is None\n"
        "from turbo_dispatch.registry import builtin_registry_path\n"
        "assert str(builtin_registry_path()) == os.path.join(os.path.dirname(turbo_dispatch.__file__), 'registry.yaml')\n"
    )
    _run([python, "-c", check], cwd=tmp_path, env=env)
