"""benchmarks/bench_dispatch_overhead.py's host path on the CPU: each op pinned to each backend that
serves it, the plain torch call and the autotuned op (fresh DB, shipped DBs off), with the verdicts
against the best pinned backend, and a wrong pinned backend failing the run. Timings on a CPU mean
nothing; these tests check the rows, the verdicts' arithmetic and the files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent / "benchmarks" / "bench_dispatch_overhead.py"
OPS = ["gemm bf16", "gemm_fp8 tensorwise", "gemm_fp8 blockwise", "grouped_gemm bf16"]


def _bench(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "overhead.json"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRIMUS_TURBO_")}
    clean["PYTHONPATH"] = os.pathsep.join([str(HERE), clean.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--iters", "200", "--rounds", "2",
                           "--json", str(out), *args], env={**clean, **env}, capture_output=True, text=True,
                          timeout=300)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_host_path_rows_verdicts_and_the_fresh_db(tmp_path):
    stale = tmp_path / "overhead_tuned.jsonl"
    stale.write_text("not a tuning db\n")  # a previous run's file must not serve this one
    proc, report = _bench(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["case"][:3] for r in report["results"]] == ["(a)", "(b)", "(c)", "(d)"]  # the overhead rows stay
    host = report["host_path"]
    assert host["interrupted"] is None and list(host["sizes"]) == ["tiny"]
    assert [v["op"] for v in host["verdicts"]] == OPS
    for verdict in host["verdicts"]:
        rows = {r["variant"]: r for r in host["rows"] if r["op"] == verdict["op"]}
        assert rows["TORCH pinned"]["check"] == "PASS" and rows["TORCH pinned"]["us"] > 0
        auto = rows[f"autotune -> {verdict['auto_backend']}"]
        assert verdict["auto_source"] == "autotune" and auto["us"] == verdict["auto_us"]
        assert verdict["best_pinned"] == "TORCH" and verdict["best_pinned_us"] == rows["TORCH pinned"]["us"]
        assert verdict["within_factor"] == (verdict["auto_us"] <= 1.1 * verdict["best_pinned_us"])
        torch_row = rows[verdict["torch"]]
        assert torch_row["x_torch"] == pytest.approx(1.0) and verdict["torch_us"] == torch_row["us"]
        assert auto["x_torch"] == pytest.approx(auto["us"] / torch_row["us"])
        # The 5 us rule applies where the plain call does the op's work: the bf16 ops.
        assert ("within_torch_us" in verdict) == verdict["op"].endswith("bf16")
        assert any("us per call" in note for note in verdict["auto_notes"]), verdict["auto_notes"]
    assert any(r["variant"] == "torch._scaled_mm (pre-quantised)" for r in host["rows"])
    # The autotuned rows tuned into the fresh DB beside the report, with their host time per call.
    db = Path(host["tuning_db"])
    assert db == stale
    results = [json.loads(line) for line in db.read_text().splitlines() if '"result"' in line]
    assert sorted(r["op"] for r in results) == ["gemm", "gemm_fp8", "gemm_fp8", "grouped_gemm"]
    assert all(r["host_us"] > 0 and "gpu_us" not in r for r in results)
    assert "Host path: wall time per call" in proc.stdout and "<= 1.1x best" in proc.stdout


def test_a_wrong_pinned_backend_fails_the_run(tmp_path):
    registry = tmp_path / "plugins.yaml"
    registry.write_text("version: 1\nops:\n  gemm:\n    backends:\n      - name: WRONG_FAST\n"
                        "        adapter: fixture_backends:WrongFastGemm\n        platforms: [cpu]\n")
    proc, report = _bench(tmp_path, PRIMUS_TURBO_EXTRA_REGISTRY=str(registry))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = [r for r in report["host_path"]["rows"] if r["op"] == "gemm bf16"]
    wrong = next(r for r in rows if r["variant"] == "WRONG_FAST pinned")
    assert wrong["check"] == "FAIL" and "rel err" in wrong["note"] and "us" not in wrong
    verdict = report["host_path"]["verdicts"][0]
    assert verdict["best_pinned"] == "TORCH" and verdict["auto_backend"] == "TORCH"  # the gate kept it out
    assert "FAIL: gemm bf16 tiny WRONG_FAST pinned" in proc.stderr


def test_host_sizes_are_checked_and_can_be_switched_off(tmp_path):
    proc, _ = _bench(tmp_path, "--host-sizes", "tiny,huge")
    assert proc.returncode == 2 and "--host-sizes: unknown huge" in proc.stderr
    proc, report = _bench(tmp_path, "--host-sizes", "")
    assert proc.returncode == 0 and "host_path" not in report
