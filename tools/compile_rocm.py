"""Compile every non-Gluon Triton kernel config for AMD Instinct (gfx942 by default) on a machine
without a GPU, and check its fit.

Triton's AMD backend compiles to AMDGCN and links the code object with the linker built into
libtriton (``amd.link_hsaco``), using the ROCm device libraries shipped in the wheel
(``triton/backends/amd/lib/ocml.bc``, ``ockl.bc``); only loading needs a GPU. A stand-in driver
that names the target makes every launch a compile: the adapters' own ``run`` (and the
quantisers' launchers) are called with CPU tensors of a representative large problem while
``JITFunction.run`` is switched to its warm-up mode, which compiles with exactly the launch's
arguments and constexprs and returns before launching. Every kernel a launch compiles is
reported, so a GEMM config that quantises first reports the quantiser too.

From each compiled kernel (the AMDGCN's resource notes and its metadata): VGPRs, AGPRs, SGPRs,
scratch (spill) bytes, VGPR spills, LDS bytes, the waves per SIMD LLVM can keep resident
(``Occupancy``), and from that the programs one CU holds (4 SIMDs). A config FAILs when it does
not compile, needs more LDS than a workgroup may have (64 KiB on gfx942, 160 KiB on gfx950),
spills to scratch, or asks for more persistent programs per CU (its ``occupancy`` field) than fit.

Families: the bf16 and fp32 GEMM, the fp8 GEMM per granularity, the grouped GEMM (forward and
wgrad, bf16 and fp8 per granularity), the quantisers, and the attention kernels (forward tiles and
backward tile pairs of every head-dim class). Configs are every entry of the adapters' candidate
tables for the family as the adapters offer them on the target (fitted to its LDS by
``configs.rocm_fit``), the default first. A family the adapter does not offer on this target
(``supports()`` under a pretend GPU of the target's arch refuses it) is listed NOT-OFFERED with the
reason and not compiled. The Gluon kernels are NVIDIA-only by design and never compiled here.

Usage: ``python tools/compile_rocm.py [--arch gfx942] [--only dense_bf16,...] [--defaults-only]
[--json FILE]``. Exit status 1 when a compiled config FAILs, 0 otherwise; ``--list`` prints the
families. TRITON_INTERPRET is ignored (unset before triton is imported). When this triton cannot
compile for AMD here, ``hip_toolchain_reason()`` says why and the tool exits 77 with that reason.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for offline_driver

from offline_driver import OfflineDriver  # noqa: E402

#: Exit status when this machine cannot compile for AMD at all (automake's "skipped").
EXIT_SKIP = 77
#: MI300X / MI355X compute units (persistent grids size themselves by it).
CU_COUNT = {"gfx942": 304, "gfx950": 256}
SIMDS_PER_CU = 4
BF16, FP32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


def hip_toolchain_reason() -> Optional[str]:
    """Why this triton cannot compile for AMD GPUs on this machine (None: it can)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    try:
        import triton.backends.amd.compiler  # noqa: F401
        from triton._C.libtriton import amd
    except ImportError as exc:
        return f"triton {triton.__version__} has no AMD backend ({exc})"
    if not hasattr(amd, "link_hsaco"):
        return (f"triton {triton.__version__}'s AMD backend has no built-in linker (amd.link_hsaco): "
                "it would need ROCm's ld.lld")
    lib = os.path.join(os.path.dirname(triton.__file__), "backends", "amd", "lib")
    missing = [name for name in ("ocml.bc", "ockl.bc") if not os.path.isfile(os.path.join(lib, name))]
    if missing:
        return f"triton {triton.__version__} ships no ROCm device libraries {missing} in {lib}"
    return None


@contextlib.contextmanager
def _patched(*triples) -> Iterator[None]:
    """Sets ``(obj, name, value)`` attributes for the duration of the block, then restores them."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in triples]
    try:
        for obj, name, value in triples:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


@contextlib.contextmanager
def compile_only(arch: str, compiled: list) -> Iterator[None]:
    """Every Triton launch inside the block compiles for ``arch`` and appends the compiled kernel
    to ``compiled`` instead of running. Device queries the launchers make (CU count, TMA support,
    the Triton quantiser's GPU check) answer for a pretend GPU of ``arch``."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from turbo_dispatch.backends.triton import attention as TA
    from turbo_dispatch.backends.triton import fp8_gemm_kernels as FK
    from turbo_dispatch.backends.triton import gemm_kernels as GK
    from turbo_dispatch.backends.triton import quantize as Q
    from turbo_dispatch.low_precision import ScalingGranularity

    real_run = JITFunction.run

    def warmup_run(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    def checked(x, dtype, granularity, axis, block_size, block_2d):  # the tool passes valid arguments
        return ScalingGranularity(granularity), axis % 2

    cus = CU_COUNT.get(arch, 304)
    previous = getattr(driver, "_active", None)
    driver.set_active(OfflineDriver(GPUTarget("hip", arch, 64)))  # restored as found: reset_active() would look for a real GPU
    try:
        with _patched((JITFunction, "run", warmup_run), (GK, "num_programs", lambda dev: cus),
                      (FK, "num_programs", lambda dev: cus), (GK, "tma_supported", lambda dev: False),
                      (FK, "tma_supported", lambda dev: False), (Q, "_check", checked),
                      (TA, "_programs_target", lambda device: 2 * cus)):
            yield
    finally:
        driver._active = previous


def resources(kernel) -> dict:
    """Registers, scratch, spills, LDS and occupancy of one compiled AMD kernel."""
    gcn = kernel.asm["amdgcn"]

    def note(pattern: str) -> int:
        found = re.search(pattern, gcn)
        return int(found.group(1)) if found else -1

    warps = int(kernel.metadata.num_warps)
    occupancy = note(r"; Occupancy: (\d+)")
    return {"kernel": kernel.metadata.name, "num_warps": warps, "vgpr": note(r"; NumVgprs: (\d+)"),
            "agpr": note(r"; NumAgprs: (\d+)"), "sgpr": note(r"; TotalNumSgprs: (\d+)"),
            "scratch": note(r"; ScratchSize: (\d+)"), "vgpr_spills": note(r"\.vgpr_spill_count:\s+(\d+)"),
            "lds": int(kernel.metadata.shared), "waves_per_simd": occupancy,
            "programs_per_cu": max(0, occupancy) * SIMDS_PER_CU // max(1, warps)}


# -- families -----------------------------------------------------------------------------------------
@dataclass
class Family:
    """One kernel family: the configs to compile and how one config is launched."""

    name: str
    configs: list
    launch: Callable[[object], object]
    #: (adapter, problem) whose supports() says whether the family is offered on the target.
    offered: Optional[tuple] = None
    #: Index of the persistent-occupancy field in a config (None: the family has none).
    occupancy_at: Optional[int] = None


M_DENSE, N_DENSE, K_DENSE = 4096, 7168, 4096
G_MOE, M_MOE, N_MOE, K_MOE = 8, 8 * 4096, 4096, 7168


def _unique(configs) -> list:
    out = []
    for c in configs:
        if tuple(c) not in out:
            out.append(tuple(c))
    return out


def _dense_families(arch: str) -> list[Family]:
    from turbo_dispatch.backends.triton import configs as C
    from turbo_dispatch.backends.triton.gemm import TritonGemm, TritonGemmFp8
    from turbo_dispatch.low_precision import ScalingGranularity as S
    from turbo_dispatch.ops.gemm_problem import GemmFp8Problem, GemmProblem

    fams = []
    for name, dtype, table in (("dense_bf16", BF16, C._GEMM_16BIT), ("dense_fp32", FP32, C._GEMM_32BIT)):
        p = GemmProblem(M_DENSE, N_DENSE, K_DENSE, False, True, dtype, dtype, dtype, "rocm")
        es = torch.empty((), dtype=dtype).element_size()
        every = C.rocm_fit([c for cls in ("large", "medium", "small") for c in table[cls]], es, es, arch)
        cfgs = _unique(TritonGemm().configs(p) + [C.as_tuple(c) for c in every])
        a, b = torch.empty((M_DENSE, K_DENSE), dtype=dtype), torch.empty((N_DENSE, K_DENSE), dtype=dtype)
        fams.append(Family(name, cfgs, lambda cfg, p=p, a=a, b=b: TritonGemm().run(p, a, b, config=cfg),
                           (TritonGemm(), p)))
    for gran, block, table in ((S.TENSORWISE, None, C._FP8), (S.ROWWISE, None, C._FP8),
                               (S.BLOCKWISE, 128, C._FP8_BLOCKWISE)):
        p = GemmFp8Problem(M_DENSE, N_DENSE, K_DENSE, False, True, BF16, BF16, BF16, E4M3, E4M3, gran, block, False,
                           gran is S.BLOCKWISE, "rocm")
        ad = TritonGemmFp8()
        every = C.rocm_fit([c._replace(block_k=block) if block else c for cls in ("large", "medium", "small")
                            for c in table[cls]], 1, 1, arch)
        cfgs = _unique(ad.configs(p) + [C.as_tuple(c) for c in every])
        a, b = torch.empty((M_DENSE, K_DENSE), dtype=BF16), torch.empty((N_DENSE, K_DENSE), dtype=BF16)
        fams.append(Family(f"dense_fp8_{gran.value}", cfgs, lambda cfg, p=p, a=a, b=b, ad=ad: ad.run(p, a, b, config=cfg),
                           (ad, p), occupancy_at=6))
    return fams


def _grouped_families(arch: str) -> list[Family]:
    from turbo_dispatch.backends.triton import configs as C
    from turbo_dispatch.backends.triton import grouped_gemm as GG
    from turbo_dispatch.low_precision import ScalingGranularity as S
    from turbo_dispatch.ops.grouped_gemm_problem import GroupedGemmFp8Problem, GroupedGemmProblem

    lens = torch.full((G_MOE,), M_MOE // G_MOE, dtype=torch.int64)
    offs = torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))
    x_fixed = torch.empty((M_MOE, K_MOE), dtype=BF16)
    w = torch.empty((G_MOE, N_MOE, K_MOE), dtype=BF16)
    x_tok, y_tok = torch.empty((M_MOE, N_MOE), dtype=BF16), torch.empty((M_MOE, K_MOE), dtype=BF16)
    fams = []

    def family(name, ad, p, inputs, candidates):
        cfgs = _unique(c for c in candidates if not GG._is_ws(c))
        fams.append(Family(name, cfgs, lambda cfg: ad.run(p, *inputs, lens, offs, config=cfg), (ad, p),
                           occupancy_at=7))

    fixed = GroupedGemmProblem(G_MOE, M_MOE, N_MOE, K_MOE, True, False, BF16, "rocm")
    small = fixed._replace(m=64 * G_MOE)  # small groups lead with the short row tiles
    wgrad = GroupedGemmProblem(G_MOE, N_MOE, K_MOE, M_MOE, False, True, BF16, "rocm")
    family("grouped_bf16", GG.TritonGroupedGemm(), fixed, (x_fixed, w), GG._half_configs(fixed) + GG._half_configs(small))
    family("grouped_wgrad_bf16", GG.TritonGroupedGemm(), wgrad, (x_tok, y_tok), GG._half_configs(wgrad))
    for gran, block in ((S.TENSORWISE, None), (S.ROWWISE, None), (S.BLOCKWISE, 128)):
        pf = GroupedGemmFp8Problem(G_MOE, M_MOE, N_MOE, K_MOE, True, False, BF16, BF16, BF16, E4M3, E4M3, gran, block,
                                   gran is S.BLOCKWISE, "rocm")
        pw = GroupedGemmFp8Problem(G_MOE, N_MOE, K_MOE, M_MOE, False, True, BF16, BF16, BF16, E4M3, E4M3, gran, block,
                                   False, "rocm")
        ad = GG.TritonGroupedGemmFp8()
        fixed_cfgs = GG._build_fp8_configs(pf, False) + GG._build_fp8_configs(pf._replace(m=64 * G_MOE), False)
        family(f"grouped_fp8_{gran.value}", ad, pf, (x_fixed, w), C.rocm_fit(fixed_cfgs, 1, 1, arch))
        family(f"grouped_wgrad_fp8_{gran.value}", ad, pw, (x_tok, y_tok),
               C.rocm_fit(GG._build_fp8_configs(pw, False), 1, 1, arch))
    return fams


def _quantiser_families() -> list[Family]:
    """Each quantiser entry point with its one launch shape (no configs: ``None``)."""
    from turbo_dispatch.backends.triton import dual_quantize as DQ
    from turbo_dispatch.backends.triton import grouped_quantize as GQ
    from turbo_dispatch.backends.triton import quantize as Q
    from turbo_dispatch.low_precision import ScalingGranularity as S

    x = torch.empty((M_DENSE, K_DENSE), dtype=BF16)
    x3 = torch.empty((G_MOE, 512, K_MOE), dtype=BF16)
    launches = {
        "quantize_kmajor_tensorwise": lambda: Q.quantize_kmajor(x, E4M3, S.TENSORWISE, None, False),
        "quantize_kmajor_rowwise": lambda: Q.quantize_kmajor(x, E4M3, S.ROWWISE, None, False),
        "quantize_kmajor_blockwise": lambda: Q.quantize_kmajor(x, E4M3, S.BLOCKWISE, 128, False),
        "quantize_kmajor_blockwise_2d": lambda: Q.quantize_kmajor(x, E4M3, S.BLOCKWISE, 128, True),
        "quantize_with_transpose_rowwise": lambda: Q.quantize_fp8_with_transpose(x, E4M3, S.ROWWISE, axis=1),
        "quantize_both_rowwise": lambda: Q.quantize_fp8_both(x, E4M3, S.ROWWISE),
        "dual_quantize_runs": lambda: DQ.dual_quantize(x3, E4M3, 128, False, gluon=False),
        "dual_quantize_tiles": lambda: DQ.dual_quantize(x3, E4M3, 128, True, gluon=False),
        "quantize_cells_blockwise": lambda: GQ.quantize_cells(x3, E4M3, 1, 128),
    }
    return [Family(name, [None], lambda cfg, fn=fn: fn()) for name, fn in launches.items()]


def _attention_families() -> list[Family]:
    from turbo_dispatch.backends.triton import attention as TA
    from turbo_dispatch.ops.attention import attention_problem

    fams = []
    b, s, hq, hk = 2, 4096, 32, 8
    for dqk, dv in ((64, 64), (128, 128), (192, 128), (256, 256)):
        q, k = torch.empty(b, s, hq, dqk, dtype=BF16), torch.empty(b, s, hk, dqk, dtype=BF16)
        v = torch.empty(b, s, hk, dv, dtype=BF16)
        p = attention_problem(q, k, v, causal=True)._replace(platform="rocm")
        key = TA._table_key(p)
        out, lse = torch.empty(b, s, hq, dv, dtype=BF16), torch.empty(b, hq, s)
        ad = TA.TritonAttention()
        fwd = _unique([*ad.configs(p), *TA.FWD_TILES["rocm"][key]])
        fams.append(Family(f"attention_fwd_{dqk}_{dv}", fwd,
                           lambda cfg, p=p, q=q, k=k, v=v: TA.attend(p, q, k, v, None, None, cfg), (ad, p)))
        fams.append(Family(f"attention_bwd_{dqk}_{dv}", [TA.BWD_TILES["rocm"][key]],
                           lambda cfg, p=p, q=q, k=k, v=v, out=out, lse=lse: TA.attend_backward(
                               p, q, k, v, None, None, out, lse, out, cfg, splits=1), (ad, p)))
    return fams


def _rotary_families() -> list[Family]:
    """The rotary kernel at Llama-3.1-8B's attention input: q rotated forward and backward
    (rotate-half and interleaved), v copied."""
    from turbo_dispatch.backends.triton import rotary as ROT

    packed = torch.empty((2, 4096, 48, 128), dtype=BF16)
    q = torch.empty((2, 4096, 32, 128), dtype=BF16)
    table = torch.empty((1, 4096, 64))
    launches = {
        "rotary_fwd": lambda il: ROT.rotate_into(packed[:, :, :32], q, table, table, 64, il, False),
        "rotary_bwd": lambda il: ROT.rotate_into(q, packed[:, :, :32], table, table, 64, il, True),
        "rotary_copy": lambda il: ROT.rotate_into(packed[:, :, 40:], q[:, :, :8], None, None, 0, il, False),
    }
    return [Family(name, [(False,), (True,)], lambda cfg, fn=fn: fn(cfg[0])) for name, fn in launches.items()]


def families(arch: str = "gfx942") -> dict[str, Family]:
    """Every family, its configs as the adapters offer them on ``arch`` (the default first)."""
    with pretend_gpu(arch):
        table = (_dense_families(arch) + _grouped_families(arch) + _quantiser_families() + _attention_families()
                 + _rotary_families())
    return {f.name: f for f in table}


@contextlib.contextmanager
def pretend_gpu(arch: str) -> Iterator[None]:
    """The adapters' supports() answer for a ROCm GPU of ``arch``."""
    from turbo_dispatch.backends.blaslt import rocm
    from turbo_dispatch.backends.triton import gemm as TG

    with _patched((rocm, "rocm_unavailable", lambda: None), (rocm, "gfx_arch", lambda: arch),
                  (TG, "_rocm_ocp_fp8", lambda: arch in rocm.OCP_FP8_ARCHS)):
        yield


# -- checking -----------------------------------------------------------------------------------------
def lds_limit(arch: str) -> int:
    from turbo_dispatch.backends.triton.configs import ROCM_LDS_LIMIT

    return ROCM_LDS_LIMIT.get(arch, ROCM_LDS_LIMIT["gfx942"])


def check(row: dict, occupancy: int, arch: str) -> tuple[list[str], list[str]]:
    """(the reasons one compiled kernel does not fit ``arch``, notes that do not fail it). VGPRs
    spilled into AGPRs (no scratch) cost register moves, not memory traffic: a note."""
    problems, notes = [], []
    limit = lds_limit(arch)
    if row["lds"] > limit:
        problems.append(f"LDS {row['lds']} B > {limit} B")
    if row["scratch"] > 0:
        problems.append(f"spills to scratch ({row['vgpr_spills']} VGPRs, {row['scratch']} B)")
    elif row["vgpr_spills"] > 0:
        notes.append(f"{row['vgpr_spills']} VGPRs spilled into AGPRs")
    if row["programs_per_cu"] < occupancy:
        problems.append(f"asks for {occupancy} programs per CU, {row['programs_per_cu']} fit")
    return problems, notes


def _last_words(exc: Exception) -> str:
    """The message of a compile error without the source excerpt Triton puts before it."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[-2:])[:300] if lines else repr(exc)


def run(table: dict, arch: str, only: Optional[list] = None, defaults_only: bool = False) -> list[dict]:
    """Compiles the selected families for ``arch``; one row per (family, config, kernel compiled)."""
    rows = []
    for name, fam in table.items():
        if only and name not in only:
            continue
        if fam.offered is not None:
            with pretend_gpu(arch):
                why = fam.offered[0].supports(fam.offered[1])
            if why is not None:
                rows.append({"family": name, "config": None, "status": "NOT-OFFERED", "reason": why})
                continue
        for i, cfg in enumerate(fam.configs[:1] if defaults_only else fam.configs):
            base = {"family": name, "config": None if cfg is None else list(cfg), "default": i == 0}
            occupancy = cfg[fam.occupancy_at] if fam.occupancy_at is not None and len(cfg) > fam.occupancy_at else 1
            compiled: list = []
            try:
                with pretend_gpu(arch), compile_only(arch, compiled):
                    fam.launch(cfg)
            except Exception as exc:  # noqa: BLE001 - a compile failure is a result
                rows.append({**base, "status": "FAIL", "reason": f"compile: {type(exc).__name__}: {_last_words(exc)}"})
                continue
            seen = set()
            for kernel in compiled:
                res = resources(kernel)
                if (res["kernel"], kernel.hash) in seen:
                    continue
                seen.add((res["kernel"], kernel.hash))
                # A config's occupancy field speaks for its GEMM kernel, not for a quantiser it launches.
                is_main = "quant" not in res["kernel"] and "amax" not in res["kernel"] and "cast" not in res["kernel"]
                problems, notes = check(res, occupancy if is_main else 1, arch)
                rows.append({**base, **res, "status": "FAIL" if problems else "PASS",
                             "reason": "; ".join(problems + notes)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gfx942", help="gfx architecture to compile for (default gfx942)")
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--defaults-only", action="store_true", help="compile only each family's default config")
    ap.add_argument("--list", action="store_true", help="print the families and their config counts")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    args = ap.parse_args(argv)
    why = hip_toolchain_reason()
    if why is not None:
        print(f"SKIP: cannot compile for AMD GPUs here: {why}")
        return EXIT_SKIP
    import triton

    table = families(args.arch)
    if args.list:
        for name, fam in table.items():
            print(f"{name:36s} {len(fam.configs)} config(s)")
        return 0
    only = [f for f in args.only.split(",") if f]
    unknown = set(only) - set(table)
    if unknown:
        ap.error(f"--only: unknown families {sorted(unknown)}; known: {sorted(table)}")
    rows = run(table, args.arch, only, args.defaults_only)
    print(f"triton {triton.__version__}, {args.arch} (wave64), LDS limit {lds_limit(args.arch)} B")
    for r in rows:
        cfg = "-" if r.get("config") is None else str(tuple(r["config"]))
        if "vgpr" in r:
            print(f"{r['status']:4s} {r['family']:30s} {cfg:34s} {r['kernel'][:28]:28s} warps={r['num_warps']} "
                  f"vgpr={r['vgpr']} agpr={r['agpr']} sgpr={r['sgpr']} lds={r['lds']} scratch={r['scratch']} "
                  f"waves/simd={r['waves_per_simd']} progs/cu={r['programs_per_cu']} {r['reason']}")
        else:
            print(f"{r['status']} {r['family']:30s} {cfg:34s} {r['reason']}")
    failed = [r for r in rows if r["status"] == "FAIL"]
    print(f"{sum(r['status'] == 'PASS' for r in rows)} passed, {len(failed)} failed, "
          f"{sum(r['status'] == 'NOT-OFFERED' for r in rows)} families not offered on {args.arch}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": triton.__version__, "arch": args.arch, "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
