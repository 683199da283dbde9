"""The Triton GEMM kernels compile for Hopper (sm_90) on a CPU-only machine, and every config that
asks for more than one persistent program per SM gets that many in the compiled kernel; the Gluon
attention forward (its switchable variants too) and backward, and their sliding-window kernels,
compile there without spills.

Runs ``tools/compile_sm90.py --occupancy-only`` in a subprocess (the tool unsets TRITON_INTERPRET,
which this test session sets, before importing triton). The fit is read from the cubin that
Triton's own ptxas produced for sm_90, so a kernel change that adds registers or shared memory
fails here, not silently on the GPU as a slower grid.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nvidia_toolchain() -> str | None:
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    missing = [t for t in ("ptxas", "cuobjdump") if not (bindir / t).exists()]
    return f"triton ships no {missing} (needed to compile for sm_90)" if missing else None


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_occupancy_configs_fit_on_sm90(tmp_path):
    out = tmp_path / "sm90.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a cold compile, not a stale cache hit
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_sm90.py"), "--occupancy-only",
                           "--json", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    families = {r["family"] for r in rows}
    # Each family's default compiled; the blockwise families offer multi-program configs. The
    # Gluon families compile on the releases the library runs them on, and only there.
    assert {"dense_fp8_blockwise", "dense_bf16", "grouped_fp8_blockwise", "grouped_wgrad_bf16"} <= families
    gluon_families = {"dense_fp8_blockwise_gluon", "dense_fp8_blockwise_gluon_ws", "grouped_fp8_blockwise_gluon_ws",
                      "grouped_wgrad_fp8_blockwise_gluon_ws", "attention_gluon_fwd", "attention_gluon_bwd"}
    assert gluon_families <= families if report["gluon_checked"] else not gluon_families & families
    multi = [r for r in rows if r["occupancy"] > 1]
    assert {r["family"] for r in multi} >= {"dense_fp8_blockwise", "grouped_fp8_blockwise"}
    for r in rows:
        assert r["status"] == "PASS", r
        assert r["fit"] >= r["occupancy"] and r["loop_spills"] <= 1 and not r["serialised"], r
        # Only the warp-specialised kernel's wide tile spills at all (a per-tile index table, outside
        # its K loop), and the attention backward's d128 dK/dV kernel on triton 3.6 (one value,
        # once per program); every other kernel fits its registers outright.
        assert r["stack"] == 0 or (r["family"].endswith("gluon_ws") and r["config"][1] == 256) or (
            r["family"].startswith("attention_gluon_bwd") and r["stack"] <= 16), r
    # The reason occupancy exists: the Triton blockwise K loop waits for all of its MMAs every step.
    assert all(r["wgmma_waits"] == [0] for r in rows if "blockwise" in r["family"] and "gluon" not in r["family"])
    # The reason the Gluon kernel exists: it waits for all but the newest wgmma, and ptxas keeps
    # them asynchronous (no serialisation note).
    gluon = [r for r in rows if r["family"] == "dense_fp8_blockwise_gluon"]
    assert all(1 in r["wgmma_waits"] for r in gluon) and (gluon or not report["gluon_checked"]), gluon


def _gluon_family_rows(tmp_path, family: str, first: int | None = None) -> list[dict]:
    """compile_sm90's rows for the Gluon ``family`` (its ``first`` configs where given), compiled
    cold in a subprocess; skips where this Triton release is not one the Gluon kernels are checked
    on, fails if the tool does."""
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path / f"{family}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    limit = [] if first is None else ["--first", str(first)]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_sm90.py"), "--only", family,
                           "--json", str(out), *limit], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    if not report["gluon_checked"]:
        pytest.skip(f"triton {report['triton']} is not a release the Gluon kernels are checked on")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return report["rows"]


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_gluon_attention_forward_fits_on_sm90(tmp_path):
    """Every variant of the Gluon attention forward (head dims 64 and 128, full and causal)
    compiles for sm_90 without a spill, within one SM's shared memory, its wgmmas asynchronous."""
    rows = _gluon_family_rows(tmp_path, "attention_gluon_fwd")
    assert sorted((r["config"][2], r["config"][3]) for r in rows) == [(64, False), (64, True), (128, False),
                                                                      (128, True)]
    for r in rows:
        assert r["status"] == "PASS" and r["stack"] == 0 and r["loop_spills"] == 0 and not r["serialised"], r
        assert r["shared"] <= 227 * 1024 and r["fit"] == 1, r


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_gluon_attention_forward_variants_fit_on_sm90(tmp_path):
    """The switchable variants of the Gluon attention forward (three math warpgroups at d64, the
    folded scale, the emulated exponentials; attention_gluon.VARIANT_SWITCHES) compile for sm_90
    as the default ones do: no spill, one program per SM, wgmmas asynchronous; the three-warpgroup
    kernel runs 13 warps under the 128-register cap that four warpgroups share."""
    rows = _gluon_family_rows(tmp_path, "attention_gluon_fwd_variants")
    math_wgs = {r["config"][7] for r in rows}
    assert math_wgs == {2, 3} and any(r["config"][8] for r in rows) and any(r["config"][9] for r in rows)
    for r in rows:
        assert r["status"] == "PASS" and r["stack"] == 0 and r["loop_spills"] == 0 and not r["serialised"], r
        assert r["shared"] <= 227 * 1024 and r["fit"] == 1, r
        if r["config"][7] == 3:
            assert r["config"][5] == 13 and r["regs"] <= 128 and not r["config"][6], r


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_gluon_attention_backward_fits_on_sm90(tmp_path):
    """Both Gluon attention backward kernels (dK/dV and dQ; head dims 64 and 128, full and causal,
    and the causal heavy-first variants) compile for sm_90 with no spill inside a wgmma loop,
    within one SM's shared memory, their wgmmas asynchronous."""
    rows = _gluon_family_rows(tmp_path, "attention_gluon_bwd")
    assert sorted((r["config"][6], r["config"][2], r["config"][3]) for r in rows) == [
        (kernel, d, causal) for kernel in ("dkdv", "dq") for d in (64, 128) for causal in (False, True)]
    heavy_first = _gluon_family_rows(tmp_path, "attention_gluon_bwd_heavy_first")
    assert sorted((r["config"][6], r["config"][2], r["config"][3], r["config"][7]) for r in heavy_first) == [
        (kernel, d, True, True) for kernel in ("dkdv", "dq") for d in (64, 128)]
    for r in rows + heavy_first:
        # A few bytes of stack outside the loops are allowed (triton 3.6 keeps one value there in
        # the d128 dK/dV kernel, reloaded once per program).
        assert r["status"] == "PASS" and r["loop_spills"] == 0 and r["stack"] <= 16 and not r["serialised"], r
        assert r["shared"] <= 227 * 1024 and r["fit"] == 1 and 1 in r["wgmma_waits"], r


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_gluon_attention_window_kernels_fit_on_sm90(tmp_path):
    """The sliding-window (``WINDOW``) kernels compile as the default ones do: the forward on two
    math warpgroups, pipelined and not, full and causal, with the softmax options, without a spill;
    both backward kernels with no spill inside a wgmma loop and no more stack than the default
    ones; every wgmma asynchronous, one program per SM."""
    fwd = _gluon_family_rows(tmp_path, "attention_gluon_fwd_window")
    assert {(r["config"][2], r["config"][3], r["config"][6]) for r in fwd} == {
        (d, causal, pipe) for d in (64, 128) for causal in (False, True) for pipe in (False, True)}
    for r in fwd:
        assert r["config"][7] == 2 and r["config"][10], r
        assert r["status"] == "PASS" and r["stack"] == 0 and r["loop_spills"] == 0 and not r["serialised"], r
        assert r["shared"] <= 227 * 1024 and r["fit"] == 1, r
    bwd = _gluon_family_rows(tmp_path, "attention_gluon_bwd_window")
    assert sorted((r["config"][6], r["config"][2], r["config"][3]) for r in bwd) == [
        (kernel, d, causal) for kernel in ("dkdv", "dq") for d in (64, 128) for causal in (False, True)]
    for r in bwd:
        assert r["config"][8] and r["status"] == "PASS" and r["loop_spills"] == 0 and not r["serialised"], r
        assert r["stack"] <= 8 and r["shared"] <= 227 * 1024 and r["fit"] == 1 and 1 in r["wgmma_waits"], r


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_gluon_attention_varlen_kernels_fit_on_sm90(tmp_path):
    """The packed-sequence (``VARLEN``) kernels compile as the dense ones do: the default forward
    variants a varlen call runs (full and causal, d64 and d128) without a spill; both backward
    kernels without a window with no spill inside a wgmma loop and no more stack than the dense
    ones; every wgmma asynchronous, one program per SM. The families' other variants (pipelining
    flipped, windows) are left to ``tools/compile_sm90.py`` run in full, which takes minutes."""
    fwd = _gluon_family_rows(tmp_path, "attention_gluon_fwd_varlen", first=4)
    assert {(r["config"][2], r["config"][3]) for r in fwd} == {(d, c) for d in (64, 128) for c in (False, True)}
    for r in fwd:
        assert r["config"][11] and r["status"] == "PASS" and r["stack"] == 0 and r["loop_spills"] == 0, r
        assert not r["serialised"] and r["shared"] <= 227 * 1024 and r["fit"] == 1, r
    bwd = _gluon_family_rows(tmp_path, "attention_gluon_bwd_varlen", first=8)
    assert sorted((r["config"][6], r["config"][2], r["config"][3], r["config"][8]) for r in bwd) == [
        (kernel, d, causal, False) for kernel in ("dkdv", "dq") for d in (64, 128) for causal in (False, True)]
    for r in bwd:
        assert r["config"][9] and r["status"] == "PASS" and r["loop_spills"] == 0 and not r["serialised"], r
        assert r["stack"] <= 8 and r["shared"] <= 227 * 1024 and r["fit"] == 1 and 1 in r["wgmma_waits"], r


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_programs_per_sm_model():
    """The fit model against hand-computed Hopper limits."""
    checks = [
        # 4 warps at 166 regs -> 168 x 32 = 5376 per warp, 3 warps per 16384-register
        # sub-partition: 3 programs by registers; 73752 + 1024 bytes of shared memory: 3 of 228 KiB.
        (166, 73752, 4, 3),
        (190, 98336, 4, 2),  # 192 x 32 = 6144 per warp: 2 per sub-partition
        (177, 131104, 8, 1),
        (87, 49176, 4, 4),  # shared memory: 4 x 50200 <= 233472
        (64, 240000, 4, 0),  # more shared memory than an SM has
    ]
    assert _tool_output("programs_per_sm", f"[f(r, s, w) for r, s, w, _ in {checks!r}]") == str([c[3] for c in checks])


def _tool_output(name: str, expr: str) -> str:
    """What ``expr`` prints with ``f`` = compile_sm90's ``name``, run in a subprocess: importing
    the tool unsets TRITON_INTERPRET, which this session needs."""
    code = f"import sys; sys.path.insert(0, 'tools'); from compile_sm90 import {name} as f; print({expr})"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


_CARRIED_WGMMA = '''
import sys
sys.path.insert(0, "tools")
import compile_sm90 as CS
import torch
from triton.runtime import driver
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def carried(c, steps, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, 64, 16])
    smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float16)
    a = gl.allocate_shared_memory(gl.float16, [64, 64], smem)
    b = gl.allocate_shared_memory(gl.float16, [64, 64], smem)
    zero = gl.zeros((64, 64), dtype=gl.float32, layout=layout)
    acc = zero
    prev = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
    for _ in range(1, steps):
        cur = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
        acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
        prev = cur  # the in-flight partial crosses the back edge: a register copy
    acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    gl.store(c + rows[:, None] * 64 + cols[None, :], acc)


driver.set_active(CS._OfflineDriver(90))
print(len(CS._resources(carried.warmup(torch.empty((64, 64)), 8, num_warps=4, grid=(1,)), 4)["serialised"]))
'''


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_serialisation_check_catches_a_carried_wgmma(tmp_path):
    """The check the Gluon kernel's design rests on can fail: a wgmma partial carried in flight
    across a loop's back edge (the obvious way to write the overlap) is serialised by ptxas, and
    the tool sees it."""
    pytest.importorskip("triton.experimental.gluon")
    script = tmp_path / "carried.py"
    script.write_text(_CARRIED_WGMMA)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) >= 1, proc.stdout


_LOOP_SASS = """
        /*0100*/                   STL [R1], R2 ;
        /*0110*/                   WARPGROUP.ARRIVE ;
        /*0120*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R28, gdesc[UR28], RZ, !UPT ;
        /*0130*/                   %s
        /*0140*/              @P0 BRA 0x130 ;
        /*0150*/               @P1 BRA 0x110 ;
        /*0160*/                   LDL R2, [R1] ;
        /*0170*/                   SYNCS.PHASECHECK.TRANS64.TRYWAIT P0, [UR4], R3 ;
        /*0180*/              @!P0 BRA 0x170 ;
"""


@pytest.mark.skipif(_nvidia_toolchain() is not None, reason=str(_nvidia_toolchain()))
def test_loop_spill_check_sees_only_the_wgmma_loop():
    """Spills before and after the K loop, or in a loop without a wgmma, do not count; one inside
    the innermost loop around a wgmma does (here the loop 0x110-0x150: 0x130-0x140 holds no wgmma)."""
    cases = [_LOOP_SASS % "NOP ;", _LOOP_SASS % "STL [R1+0x4], R5 ;",
             _LOOP_SASS.replace("/*0110*/                   WARPGROUP.ARRIVE ;", "/*0110*/ LDL R6, [R1] ;")
             % "STL [R1+0x4], R5 ;"]
    assert _tool_output("mma_loop_spills", f"[f(s) for s in {cases!r}]") == "[0, 1, 2]"


def test_gluon_kernels_are_refused_on_an_unchecked_triton_release(monkeypatch):
    """On a Triton release the Gluon kernels were not compiled on, every Gluon kernel says so
    through available(), so the TRITON backends leave them out of their candidates instead of
    failing inside the compiler at call time."""
    pytest.importorskip("triton.experimental.gluon")
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GB

    monkeypatch.delenv("PRIMUS_TURBO_GLUON_KERNELS", raising=False)
    monkeypatch.setattr(GB, "_triton_release", lambda: "3.7")
    why = GB.available()
    assert why is not None and "checked on triton 3.6" in why and "this is triton 3.7" in why
