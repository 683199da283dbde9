"""The qa/ scripts parse, show their usage, and build the commands they would run (--dry-run), on
a CPU-only machine and in seconds, so that they cannot rot between the GPU runs that use them.

One real run goes through the whole chain (qa/perf.sh -> benchmarks/suite.py -> a bench script)
with the cheapest family; the GPU work itself is left to the GPU machines.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
QA = REPO / "qa"
SCRIPTS = ["gpu_tests.sh", "perf.sh", "multi_gpu.sh", "rocm.sh"]


def _qa(script: str, *args: str, out: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMUS_TURBO_")}
    env.update(PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    env.pop("DRY_RUN", None)
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(QA / script), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS + ["common.sh"])
def test_script_parses(script):
    proc = subprocess.run(["bash", "-n", str(QA / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_is_executable_strict_and_documents_itself(script):
    path = QA / script
    assert os.access(path, os.X_OK)
    assert "set -euo pipefail" in path.read_text()
    proc = _qa(script, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"Usage: qa/{script}") and "Example: qa/" in proc.stdout
    assert f"qa/{script}" in (QA / "README.md").read_text()


def test_perf_dry_run_calls_the_suite_once_per_family_under_a_time_limit(tmp_path):
    proc = _qa("perf.sh", "--dry-run", "--quick", "--time-limit", "100", "gemm", "dispatch_overhead",
               "--", "--only", "bf16_gemm", out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[dry-run] gemm: timeout -s TERM -k 30 220 ")
    assert (f"benchmarks/suite.py --family gemm --time-limit 100 --out {tmp_path}/perf --quick --only bf16_gemm"
            in lines[0])
    assert "--family dispatch_overhead" in lines[1]
    every = _qa("perf.sh", "--dry-run", "all")
    families = [line.split(":")[0].removeprefix("[dry-run] ") for line in every.stdout.splitlines()]
    assert families[:6] == ["gemm", "gemm_fp8", "grouped_gemm", "grouped_gemm_fp8", "dispatch_overhead",
                            "blaslt_switch"]


def test_perf_refuses_an_unknown_family_and_a_missing_one():
    bad = _qa("perf.sh", "--dry-run", "gemmm")
    assert bad.returncode == 2 and "unknown family gemmm" in bad.stderr and "grouped_gemm_fp8" in bad.stderr
    none = _qa("perf.sh")
    assert none.returncode == 2 and "Usage: qa/perf.sh" in none.stderr


def test_perf_runs_a_family_end_to_end(tmp_path):
    """perf.sh -> suite.py -> bench_dispatch_overhead.py, a few hundred calls: the reports, the
    suite's record and the summary land under $OUT."""
    proc = _qa("perf.sh", "--quick", "dispatch_overhead", "--", "--", "--iters", "200", "--rounds", "2",
               out=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((tmp_path / "perf" / "dispatch_overhead_quick.json").read_text())["results"]
    record = json.loads((tmp_path / "perf" / "suite.jsonl").read_text().splitlines()[0])
    assert record["status"] == "ok" and record["quick"]
    assert "dispatch_overhead" in (tmp_path / "perf_summary.txt").read_text()


def test_gpu_tests_dry_run_runs_gpu_marked_tests_per_file(tmp_path):
    proc = _qa("gpu_tests.sh", "--dry-run", "--time-limit", "77", "gemm", "tests/test_moe.py", "--", "-x",
               out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    gemm, moe = proc.stdout.splitlines()
    assert gemm.startswith("[dry-run] test_gemm: timeout -s TERM -k 30 77 ")
    assert "-m pytest tests/test_gemm.py -m gpu " in gemm and gemm.endswith(f"{tmp_path}/gpu_tests/test_gemm.xml -x")
    assert "tests/test_moe.py" in moe
    every = _qa("gpu_tests.sh", "--dry-run").stdout.splitlines()
    assert len(every) == len(list((REPO / "tests").glob("test_*.py")))
    missing = _qa("gpu_tests.sh", "--dry-run", "no_such_file")
    assert missing.returncode == 2 and "no test file no_such_file" in missing.stderr


def test_multi_gpu_dry_run_names_every_nccl_check(tmp_path):
    proc = _qa("multi_gpu.sh", "--dry-run", "--nproc", "4", out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "tests/test_moe.py -m gpu" in out and "benchmarks/probes/moe_gpu_check.py --world 4" in out
    assert out.count("torch.distributed.run --standalone --nproc_per_node 4") == 4
    assert f"--nproc_per_node 4 benchmarks/bench_moe.py --out {tmp_path}/multi_gpu/bench_moe" in out
    assert "benchmarks/probes/probe_nccl_consensus.py" in out
    assert "-m turbo_dispatch.cli tune --distributed --model" in out and "tune --distributed --step" in out
    assert out.count("turbo_dispatch.cli db validate") == 2
    for path in ("benchmarks/probes/moe_gpu_check.py", "benchmarks/bench_moe.py",
                 "benchmarks/probes/probe_nccl_consensus.py"):
        assert (REPO / path).is_file()


def test_multi_gpu_runs_only_the_named_checks_and_passes_bench_arguments(tmp_path):
    proc = _qa("multi_gpu.sh", "--dry-run", "bench_moe", "--", "--tokens", "128", "--profile", out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[dry-run] bench_moe:")
    assert lines[0].endswith(f"--out {tmp_path}/multi_gpu/bench_moe --tokens 128 --profile")
    unknown = _qa("multi_gpu.sh", "--dry-run", "no_such_check", out=tmp_path)
    assert unknown.returncode == 2 and "unknown check no_such_check" in unknown.stderr


def test_rocm_dry_run_runs_the_gpu_tests_and_the_perf_families(tmp_path):
    proc = _qa("rocm.sh", "--dry-run", out=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "-m pytest tests/test_gemm.py -m gpu" in proc.stdout
    assert "benchmarks/suite.py --family grouped_gemm_fp8" in proc.stdout
    assert "--family blaslt_switch" not in proc.stdout
    assert "no AMD GPU has run" in (QA / "rocm.sh").read_text()
