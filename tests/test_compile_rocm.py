"""The Triton kernels compile for AMD MI300 (gfx942) and MI350 (gfx950) on a CPU-only machine, and
the configs the adapters offer there fit: LDS within the GPU's limit, nothing spilled to scratch.

Runs ``tools/compile_rocm.py`` in a subprocess (the tool unsets TRITON_INTERPRET, which this test
session sets, before importing triton) on a small subset: each family's default config, a few
families, so it stays within a couple of minutes on two cores. The full sweep is
``python tools/compile_rocm.py [--arch gfx950]``. Where this triton cannot compile for AMD (no AMD
backend, no built-in linker, no ROCm device libraries in the wheel), the tool says why and exits
77, and the test skips with that reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "compile_rocm.py"


def _tool(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "rocm.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a cold compile, not a stale cache hit
    proc = subprocess.run([sys.executable, str(TOOL), *args, "--json", str(out)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    return proc, (json.loads(out.read_text()) if out.exists() else {})


def test_gfx942_defaults_compile_and_fit(tmp_path):
    families = ["dense_bf16", "dense_fp32", "dense_fp8_rowwise", "grouped_bf16", "grouped_wgrad_bf16",
                "grouped_fp8_blockwise", "quantize_kmajor_blockwise", "dual_quantize_runs", "attention_fwd_128_128",
                "attention_bwd_64_64"]
    proc, report = _tool(tmp_path, "--defaults-only", "--only", ",".join(families))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {}
    for r in report["rows"]:
        rows.setdefault(r["family"], []).append(r)
    assert set(rows) == set(families)
    # Not offered on MI300, each with the adapter's reason: tf32x3 dots (fp32) and OCP fp8.
    assert [r["status"] for r in rows["dense_fp32"]] == ["NOT-OFFERED"] and "tf32x3" in rows["dense_fp32"][0]["reason"]
    for name in ("dense_fp8_rowwise", "grouped_fp8_blockwise"):
        assert [r["status"] for r in rows[name]] == ["NOT-OFFERED"] and "gfx950" in rows[name][0]["reason"]
    compiled = [r for r in report["rows"] if "vgpr" in r]
    assert {r["family"] for r in compiled} == set(families) - {"dense_fp32", "dense_fp8_rowwise",
                                                                "grouped_fp8_blockwise"}
    for r in compiled:
        assert r["status"] == "PASS", r
        assert r["lds"] <= 64 * 1024 and r["scratch"] == 0 and r["programs_per_cu"] >= 1, r
    # The Hopper-sized bf16 defaults are offered with fewer stages on gfx942 (64 KiB of LDS).
    gemm = next(r for r in compiled if r["kernel"] == "_gemm_kernel")
    assert gemm["config"][4] == 2 and gemm["lds"] <= 64 * 1024


def test_gfx950_fp8_defaults_compile_and_fit(tmp_path):
    families = ["dense_fp8_blockwise", "grouped_fp8_rowwise", "grouped_wgrad_fp8_blockwise"]
    proc, report = _tool(tmp_path, "--arch", "gfx950", "--defaults-only", "--only", ",".join(families))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    compiled = [r for r in report["rows"] if "vgpr" in r]
    assert {r["family"] for r in compiled} == set(families)
    for r in compiled:
        assert r["status"] == "PASS" and r["lds"] <= 160 * 1024 and r["scratch"] == 0, r


def test_the_fit_check(tmp_path):
    """The check's rules on made-up kernels: LDS over the arch's limit, scratch spills and too few
    programs per CU fail; VGPRs spilled into AGPRs only make a note."""
    code = ("import sys; sys.path.insert(0, 'tools'); from compile_rocm import check\n"
            "base = dict(lds=65536, scratch=0, vgpr_spills=0, programs_per_cu=2)\n"
            "print(check(base, 2, 'gfx942'))\n"
            "print(check({**base, 'lds': 65537}, 1, 'gfx942'))\n"
            "print(check({**base, 'lds': 65537}, 1, 'gfx950'))\n"
            "print(check({**base, 'scratch': 8, 'vgpr_spills': 2}, 1, 'gfx942'))\n"
            "print(check({**base, 'vgpr_spills': 1}, 3, 'gfx942'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "([], [])"
    assert "LDS 65537 B > 65536 B" in lines[1] and lines[2] == "([], [])"
    assert "spills to scratch (2 VGPRs, 8 B)" in lines[3]
    assert "asks for 3 programs per CU, 2 fit" in lines[4] and "1 VGPRs spilled into AGPRs" in lines[4]
