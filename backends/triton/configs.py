"""Tile configurations for the Triton GEMM kernels, and the pruning that keeps tuning short.

A config is a plain tuple ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps)`` so it is
hashable and JSON-representable (the tuning database stores it as a list), with an optional
seventh field ``occupancy``: programs per SM in the persistent grid, and an optional eighth field
``kernel``: which implementation runs the config (``KERNEL_TRITON`` = 0, the plain Triton kernel;
``KERNEL_GLUON`` = 1, the blockwise fp8 Gluon kernel of fp8_blockwise_gluon.py; ``KERNEL_GLUON_WS``
= 2, the warp-specialised one of fp8_blockwise_gluon_ws.py). Trailing fields
at their defaults (occupancy 1, kernel 0) are omitted from the tuple, so configs stored before a
field existed keep their meaning and identity. ``TileConfig`` names the fields;
``as_tuple``/``from_tuple`` convert.

Why occupancy: the blockwise fp8 kernel must wait for each K block's wgmma before promoting the
partial product on the CUDA cores (its PTX has one ``wgmma.wait_group 0`` per K step), so with one
program per SM the tensor cores idle during every promotion. Two or three co-resident programs
of a small tile (64 x 128, 4 warps) run out of phase: one promotes while another's wgmma runs,
the arrangement DeepGEMM gets from two math warpgroups. Whether a config's programs really fit
together is a property of the compiled kernel (registers, shared memory);
``tools/compile_sm90.py`` compiles every such config for sm_90 without a GPU and checks it.

The candidate lists are short on purpose: an autotuner profiles every config of every backend
for a key, so each list holds a handful of shapes per size class, not a sweep. They are the usual
Hopper choices (128x256x64 bf16 / 128x256x128 fp8 with 8 warps for large problems, smaller tiles
for few-tile problems), checked for correctness on an H100; the autotuner ranks them per key, and
where a list was measured its order says so (docs/kernels.md). The grouped-GEMM kernels can reuse
``prune``/``smem_bytes``/``size_class`` with their own candidate lists.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

#: Shared memory a Hopper block may use (227 KB), minus a margin for the epilogue's layout
#: conversion and the pipeline's barriers.
SMEM_LIMIT = 220 * 1024


class TileConfig(NamedTuple):
    """One kernel launch shape."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_stages: int
    num_warps: int
    occupancy: int = 1
    kernel: int = 0


#: ``TileConfig.kernel`` values: the plain Triton kernel, the Gluon blockwise fp8 kernel, or its
#: warp-specialised sibling.
KERNEL_TRITON, KERNEL_GLUON, KERNEL_GLUON_WS = 0, 1, 2
#: The Gluon kernel kinds (blockwise fp8 on sm_90 only).
GLUON_KERNELS = (KERNEL_GLUON, KERNEL_GLUON_WS)

#: Most programs per SM a config may ask for (Hopper holds at most 64 warps per SM; more than a
#: few co-resident GEMM programs only thrash shared memory).
MAX_OCCUPANCY = 4


def as_tuple(cfg: TileConfig) -> tuple[int, ...]:
    """The JSON-friendly form stored in tuning results: trailing fields at their defaults
    (kernel 0, then occupancy 1) are dropped, so most configs are six ints."""
    vals = tuple(int(v) for v in cfg)
    if vals[7:] == (KERNEL_TRITON,):
        vals = vals[:7]
    return vals[:6] if vals[6:] == (1,) else vals


def from_tuple(cfg: Sequence[int]) -> TileConfig:
    """Validates a stored config (a tuple or JSON list) and returns it as a TileConfig."""
    if (len(cfg) not in (6, 7, 8) or not all(isinstance(v, int) and not isinstance(v, bool) for v in cfg)
            or not all(v > 0 for v in cfg[:7])):
        raise ValueError(f"triton tile config must be 6 to 8 ints (BM, BN, BK, GROUP_M, stages, warps"
                         f"[, occupancy[, kernel]]), all positive but kernel; got {cfg!r}")
    c = TileConfig(*cfg)
    if c.kernel not in (KERNEL_TRITON, *GLUON_KERNELS):
        raise ValueError(f"triton tile config: kernel={c.kernel} must be {KERNEL_TRITON} (Triton), "
                         f"{KERNEL_GLUON} (Gluon blockwise fp8) or {KERNEL_GLUON_WS} (its warp-specialised form)")
    if c.occupancy > MAX_OCCUPANCY:
        raise ValueError(f"triton tile config: occupancy={c.occupancy} must be at most {MAX_OCCUPANCY} programs per SM")
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(c, name)
        if v & (v - 1) or v < 16:
            raise ValueError(f"triton tile config: {name}={v} must be a power of two >= 16")
    if c.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"triton tile config: num_warps={c.num_warps} must be 1, 2, 4, 8 or 16")
    return c


def smem_bytes(cfg: TileConfig, a_bytes: int, b_bytes: int) -> int:
    """Shared memory of the operand pipeline: one A and one B tile per stage."""
    return cfg.num_stages * cfg.block_k * (cfg.block_m * a_bytes + cfg.block_n * b_bytes)


def size_class(m: int, n: int, k: int) -> str:
    """'small' (few tiles: launch-bound), 'medium', or 'large' (fills the GPU many times)."""
    tiles_128 = -(-m // 128) * -(-n // 128)
    if tiles_128 <= 16 or k <= 64:
        return "small"
    if tiles_128 <= 264:  # up to two waves of 128x128 tiles on 132 SMs
        return "medium"
    return "large"


def prune(candidates: Iterable[TileConfig], m: int, n: int, k: int, a_bytes: int, b_bytes: int,
          limit: int = 8) -> list[TileConfig]:
    """Drops configs that do not fit shared memory or whose tiles are far larger than the
    problem (a 256-row tile for M=16 wastes 15/16 of its MMAs), keeps order, dedups, caps the list."""
    out: list[TileConfig] = []
    for cfg in candidates:
        if smem_bytes(cfg, a_bytes, b_bytes) > SMEM_LIMIT:
            continue
        if cfg.block_m > 64 and cfg.block_m >= 2 * _pow2_at_least(m, 16):
            continue
        if cfg.block_n > 64 and cfg.block_n >= 2 * _pow2_at_least(n, 16):
            continue
        if cfg not in out:
            out.append(cfg)
        if len(out) >= limit:
            break
    return out


def _pow2_at_least(x: int, floor: int) -> int:
    p = floor
    while p < x:
        p *= 2
    return p


# -- bf16 / fp16 / fp32 GEMM ------------------------------------------------------------------------
_GEMM_16BIT = {
    "small": [TileConfig(64, 64, 64, 8, 3, 4), TileConfig(64, 128, 64, 8, 3, 4), TileConfig(128, 64, 64, 8, 3, 4),
              TileConfig(32, 64, 128, 8, 3, 4), TileConfig(128, 128, 64, 8, 3, 8)],
    "medium": [TileConfig(128, 128, 64, 8, 4, 8), TileConfig(128, 128, 64, 8, 3, 4), TileConfig(128, 64, 64, 8, 4, 4),
               TileConfig(64, 128, 64, 8, 4, 4), TileConfig(128, 256, 64, 8, 3, 8)],
    "large": [TileConfig(128, 256, 64, 8, 3, 8), TileConfig(256, 128, 64, 8, 3, 8), TileConfig(128, 128, 64, 8, 4, 8),
              TileConfig(128, 256, 64, 8, 4, 8), TileConfig(128, 128, 64, 8, 4, 4), TileConfig(128, 64, 64, 8, 4, 4)],
}
# fp32 operands: half the K depth per stage for the same shared memory.
_GEMM_32BIT = {
    cls: [c._replace(block_k=32) for c in cfgs] for cls, cfgs in _GEMM_16BIT.items()
}


def gemm_candidates(m: int, n: int, k: int, elem_bytes: int) -> list[TileConfig]:
    """Pruned configs for a bf16/fp16 (elem_bytes=2) or fp32 (4) GEMM; the first is the default."""
    table = _GEMM_16BIT if elem_bytes <= 2 else _GEMM_32BIT
    cls = size_class(m, n, k)
    found = prune(table[cls], m, n, k, elem_bytes, elem_bytes)
    return found or prune(table["small"], m, n, k, elem_bytes, elem_bytes) or [table["small"][0]]


# -- fp8 GEMM -------------------------------------------------------------------------------------
_FP8 = {
    "small": [TileConfig(64, 64, 128, 8, 3, 4), TileConfig(64, 128, 128, 8, 3, 4), TileConfig(128, 64, 128, 8, 3, 4),
              TileConfig(128, 128, 128, 8, 3, 8)],
    "medium": [TileConfig(128, 128, 128, 8, 4, 8), TileConfig(128, 128, 128, 8, 3, 4), TileConfig(64, 128, 128, 8, 4, 4),
               TileConfig(128, 256, 128, 8, 3, 8)],
    "large": [TileConfig(128, 256, 128, 8, 3, 8), TileConfig(128, 128, 128, 8, 4, 8), TileConfig(256, 128, 128, 8, 3, 8),
              TileConfig(128, 256, 64, 8, 4, 8), TileConfig(128, 128, 128, 8, 4, 4), TileConfig(64, 256, 128, 8, 4, 4)],
}


# Blockwise: the promotion keeps a second fp32 tile live, so 128 x 256 spills (sm_90, triton 3.6:
# 255 registers + 160 bytes of stack) and runs slower than 128 x 128, the default. The occupancy > 1
# entries overlap one program's promotion with another's wgmma; their fit (64x128x128/4 warps: 3
# programs at 3 stages, 2 at 4; 128x64: 2 at 4) is checked by tools/compile_sm90.py. They are
# untimed, so they follow the measured 128 x 128.
_FP8_BLOCKWISE = {
    "small": [TileConfig(64, 64, 128, 8, 3, 4), TileConfig(64, 128, 128, 8, 3, 4), TileConfig(128, 64, 128, 8, 3, 4),
              TileConfig(128, 128, 128, 8, 3, 8)],
    "medium": [TileConfig(128, 128, 128, 8, 4, 8), TileConfig(64, 128, 128, 8, 4, 4, 2),
               TileConfig(64, 128, 128, 8, 3, 4, 3), TileConfig(128, 64, 128, 8, 4, 4, 2)],
    "large": [TileConfig(128, 128, 128, 8, 4, 8), TileConfig(64, 128, 128, 8, 3, 4, 3),
              TileConfig(64, 128, 128, 8, 4, 4, 2), TileConfig(128, 64, 128, 8, 4, 4, 2),
              TileConfig(128, 128, 128, 8, 3, 8)],
}

# The Gluon blockwise kernels come first wherever they can run (an sm_90 GPU; the adapter drops
# them elsewhere), so one of them is the default before tuning. KERNEL_GLUON overlaps each K
# block's promotion with the next block's wgmma inside one program (fp8_blockwise_gluon.py):
# BLOCK_M = 16 x warps rows, at most 128 columns; 225 registers per thread at 128 x 128 / 8 warps,
# 190 at 128 x 64 (sm_90, triton 3.6, no spills). KERNEL_GLUON_WS splits a 128-row tile between
# two math warpgroups and a TMA warp (fp8_blockwise_gluon_ws.py): 168 registers cap, 232 per math
# thread. Its 256-column tile (two 128-column accumulators per warpgroup) loads a quarter fewer
# bytes per FLOP (each ``a`` tile serves twice the columns) and is the fastest blockwise kernel
# measured, so it leads: 3 stages below ``WS_DEEP_K``, 4 from it (``fp8_candidates``). The
# 128-column tile takes 5 stages, the most that leave room for its TMA-store staging buffers; the
# 128 x 64 tile is not offered (slower). Measurements: docs/kernels.md.
_FP8_BLOCKWISE_GLUON = {
    "small": [],
    "medium": [TileConfig(128, 256, 128, 8, 3, 8, 1, KERNEL_GLUON_WS),
               TileConfig(128, 256, 128, 8, 4, 8, 1, KERNEL_GLUON_WS),
               TileConfig(128, 128, 128, 8, 5, 8, 1, KERNEL_GLUON_WS),
               TileConfig(128, 128, 128, 8, 5, 8, 1, KERNEL_GLUON), TileConfig(64, 128, 128, 8, 4, 4, 2, KERNEL_GLUON)],
    "large": [TileConfig(128, 256, 128, 8, 3, 8, 1, KERNEL_GLUON_WS),
              TileConfig(128, 256, 128, 8, 4, 8, 1, KERNEL_GLUON_WS),
              TileConfig(128, 128, 128, 8, 5, 8, 1, KERNEL_GLUON_WS),
              TileConfig(128, 128, 128, 8, 5, 8, 1, KERNEL_GLUON), TileConfig(128, 64, 128, 8, 6, 8, 1, KERNEL_GLUON),
              TileConfig(64, 128, 128, 8, 4, 4, 2, KERNEL_GLUON)],
}


#: From this K on, the warp-specialised 256-column tile's 4-stage config leads the blockwise list
#: instead of the 3-stage one: on an H100 4 stages won at K >= 8192 and 3 won or tied at K = 4096
#: (docs/kernels.md).
WS_DEEP_K = 8192


def fp8_candidates(m: int, n: int, k: int, block_k: int | None = None) -> list[TileConfig]:
    """Pruned configs for an fp8 GEMM; ``block_k`` marks a blockwise GEMM and pins BLOCK_K
    (BLOCK_K == the quantisation block so each K step sees one scale)."""
    cls = size_class(m, n, k)
    if block_k is None:
        cands = _FP8[cls] + _FP8["small"]
    else:
        cands = [c._replace(block_k=block_k) for c in _FP8_BLOCKWISE[cls] + _FP8_BLOCKWISE["small"]]
    found = prune(cands, m, n, k, 1, 1) or [cands[0]]
    if block_k is not None:
        # Gluon first: the adapter drops them where they cannot run, leaving the Triton default.
        gluon = prune([c._replace(block_k=block_k) for c in _FP8_BLOCKWISE_GLUON[cls]], m, n, k, 1, 1)
        if k >= WS_DEEP_K:
            deep = [c for c in gluon if c.kernel == KERNEL_GLUON_WS and c.block_n == 256 and c.num_stages == 4]
            gluon = deep + [c for c in gluon if c not in deep]
        found = gluon + found
    return found


# -- AMD Instinct -------------------------------------------------------------------------------------
#: LDS one workgroup may allocate: 64 KiB on CDNA3 (MI300, gfx942), 160 KiB on CDNA4 (MI350, gfx950).
ROCM_LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024}


def rocm_lds_bytes(cfg: Sequence[int], a_bytes: int, b_bytes: int, arch: str) -> int:
    """LDS of a config's operand pipeline as Triton's AMD backend lays it out, read off kernels
    compiled by tools/compile_rocm.py: ``num_stages - 1`` buffers on gfx942; on gfx950
    ``num_stages`` buffers plus up to 2.5 KiB for the epilogue (4 KiB counted). ``cfg`` is a
    TileConfig or a grouped kernel's tuple (num_stages is field 4 of both)."""
    if arch == "gfx950":
        return cfg[4] * cfg[2] * (cfg[0] * a_bytes + cfg[1] * b_bytes) + 4096
    return max(1, cfg[4] - 1) * cfg[2] * (cfg[0] * a_bytes + cfg[1] * b_bytes)


def rocm_fit(cfgs: Iterable[Sequence[int]], a_bytes: int, b_bytes: int, arch: str) -> list:
    """``cfgs`` as offered on an AMD GPU of ``arch``: the Hopper-sized pipelines lose stages (down
    to 2) until they fit its LDS, and a config that does not fit even then is dropped; order kept,
    duplicates dropped. The tables are Hopper's (228 KiB of shared memory); gfx942 has 64 KiB."""
    limit = ROCM_LDS_LIMIT.get(arch, ROCM_LDS_LIMIT["gfx942"])
    out: list = []
    for cfg in cfgs:
        fields = list(cfg)
        while fields[4] > 2 and rocm_lds_bytes(fields, a_bytes, b_bytes, arch) > limit:
            fields[4] -= 1
        fitted = type(cfg)(*fields) if isinstance(cfg, TileConfig) else tuple(fields)
        if rocm_lds_bytes(fitted, a_bytes, b_bytes, arch) <= limit and fitted not in out:
            out.append(fitted)
    return out
