"""TRITON adapters for grouped_gemm and grouped_gemm_fp8 (kernels in grouped_kernels.py).

Both adapters take exactly the TORCH adapters' ``run(problem, a, b, group_lens, group_offs,
config=None)`` arguments and read the group boundaries (``group_offs``, int32 or int64 ``[G + 1]``) only
on the device: no host sync, so every call can be captured in a CUDA graph and replayed with
other routings. ``group_lens`` itself is not read (the offsets carry the same facts); when
``group_offs`` is None it is computed on the device from ``group_lens``.

fp8 recipes and their semantics (identical to TORCH's ``quantize`` calls, so both backends compute
the same math):

* forward/dgrad: ``a[M, K]`` per tensor, per row, or in 1 x block runs along K; the weight per
  tensor (one scale for all groups), per (group, output column), or in block x block tiles per
  group (``b_2d``; 1 x block runs along K otherwise). The weight is written K-major ``[G, N, K]``
  by the quantiser whatever ``trans_b`` is.
* wgrad (variable K): both operands per tensor, per column over all tokens, or in 1 x block runs
  along the tokens aligned to the global token index (a run may straddle two groups; its one
  scale serves both). They are written transposed, token-contiguous.
* BLOCKWISE operands may arrive pre-quantised (QuantizedTensor, the training step's reuse:
  ``turbo_dispatch.low_precision.dual_quantize.quantize_runs_both``/``quantize_tiles_both``); they are read
  as they are, a weight not stored K-major for this GEMM copied once.

Configs are ``(BM, BN, BK, GROUP_M, num_stages, num_warps, tma[, occupancy])`` tuples; ``tma=1``
loads the operands (fixed-K and variable-K alike) through host-built TMA descriptors where the
layout allows (else the same kernel with pointer loads). ``occupancy`` (default 1) is the number of
persistent fixed-K programs per SM: co-resident programs of a small blockwise tile overlap one's
per-K-block promotion with another's wgmma (see configs.py). The variable-K kernel launches one
program per tile, so the hardware already co-schedules as many as fit and it ignores the field.
A caller's ``num_cu`` (``turbo_dispatch.ops.grouped_gemm_compute_units``) caps the persistent
Triton kernel's programs; the one-program-per-tile variable-K grid and the warp-specialised
Gluon kernels do not read it.
The candidate list depends only on the problem key (G, M_total, N, K, dtypes, layout, recipe),
never on group_lens values.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence

import torch

from turbo_dispatch.adapter import Adapter
from turbo_dispatch.low_precision import QuantizedTensor, ScalingGranularity

from . import gemm as _gemm
from .configs import KERNEL_GLUON_WS, MAX_OCCUPANCY
from .gemm import rocm_fitted
from .grouped_launch import _interpreting, _offsets, _triton_reason, _upcast
from .grouped_launch import _vk_descriptor, launch_fixed_k, launch_variable_k, zero_padded_tail  # noqa: F401  (re-exported)

log = logging.getLogger("turbo_dispatch.backends.triton.grouped_gemm")

Config = tuple  # (BM, BN, BK, GROUP_M, num_stages, num_warps, tma[, occupancy])

_HALF = (torch.bfloat16, torch.float16)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.bfloat16, torch.float16, torch.float32)
_IN = _OUT + _FP8  # an fp8 input dtype: the operand arrives pre-quantised (a QuantizedTensor)


def _fit(cfgs: Sequence[Config], m: int, n: int) -> list[Config]:
    """Drop configs whose tiles dwarf the problem (keeping at least one), dedupe, keep order."""
    out: list[Config] = []
    for c in cfgs:
        if c not in out and (c[0] <= max(64, 2 * m) and c[1] <= max(64, 2 * n)):
            out.append(c)
    return out or [cfgs[-1]]


def _half_configs(p) -> list[Config]:
    if p.variable_k:
        # K is the tokens per expert (hundreds to tens of thousands), M x N the weight: big output
        # tiles, TMA (interior steps unmasked), in their measured order (docs/kernels.md); the
        # smaller tiles serve small M, N and the last entry is the pointer path.
        cands = [(128, 256, 64, 8, 4, 8, 1), (128, 256, 64, 8, 3, 8, 1), (256, 128, 64, 8, 3, 8, 1),
                 (128, 128, 64, 8, 4, 8, 1), (128, 128, 64, 8, 4, 4, 1), (64, 128, 64, 8, 4, 4, 1),
                 (128, 256, 64, 8, 3, 8, 0)]
        return rocm_fitted(p, _fit(cands, p.m, p.n), 2, 2)
    per_group = p.m / max(p.g, 1)
    cands = [(128, 256, 64, 8, 3, 8, 1), (128, 128, 64, 8, 4, 4, 1), (256, 128, 64, 8, 3, 8, 1),
             (128, 256, 64, 8, 3, 8, 0), (128, 128, 64, 8, 4, 4, 0), (64, 256, 64, 8, 4, 4, 1),
             (64, 128, 64, 8, 4, 4, 1)]
    if per_group < 128:  # small groups: short row tiles waste less
        cands = cands[-2:] + cands[:-2]
    return rocm_fitted(p, _fit(cands, p.m, p.n), 2, 2)


def _fp8_bk(p) -> int:
    """K step: 128, or the largest power of two dividing a smaller scale block (never straddles one)."""
    if p.granularity is not ScalingGranularity.BLOCKWISE:
        return 128
    bs = p.block_size
    bk = 128
    while bs % bk:
        bk //= 2
    return bk


def _fp8_configs(p) -> list[Config]:
    """The fp8 candidates of ``p``, the default first. Asked on every unpinned call (for its
    default), so the list is built once per (problem, whether the warp-specialised kernel can run
    here): that second fact is asked afresh each time (``_ws_problem_refusal`` reads an env switch
    and the machine), everything else depends on ``p`` alone."""
    return list(_fp8_configs_for(p, _ws_problem_refusal(p) is None))


@functools.lru_cache(maxsize=4096)
def _fp8_configs_for(p, ws_runs: bool) -> tuple[Config, ...]:
    return tuple(rocm_fitted(p, _build_fp8_configs(p, ws_runs), 1, 1))


def _build_fp8_configs(p, ws_runs: bool) -> list[Config]:
    bk = _fp8_bk(p)
    if p.variable_k:
        # Operands are token-contiguous fp8 with 16-byte row strides: TMA on both (tma=1); the
        # last entry is the pointer path. Orders as measured at the DeepSeek-V3 wgrads
        # (docs/kernels.md).
        if p.granularity is ScalingGranularity.BLOCKWISE:
            # The per-step scale is an outer product of two per-column vectors (both operands in
            # 1 x block token runs): 128 x 256 and 4-warp 128 x 128 spill (ptxas, sm_90a). The
            # warp-specialised wgrad kernel's configs go first where it can run.
            cands = [(64, 128, bk, 8, 4, 4, 1), (128, 128, bk, 8, 3, 8, 1), (64, 256, bk, 8, 3, 8, 1),
                     (128, 128, bk, 8, 4, 8, 1), (64, 256, bk, 8, 4, 8, 1), (128, 128, bk, 8, 4, 8, 0)]
            return _ws_configs(p, bk, ws_runs) + _fit(cands, p.m, p.n)
        else:
            # 128 x 256 leads: 4 stages for rowwise, 3 for tensorwise (the faster of each).
            big = [(128, 256, bk, 8, 4, 8, 1), (128, 256, bk, 8, 3, 8, 1)]
            if p.granularity is ScalingGranularity.TENSORWISE:
                big.reverse()
            cands = big + [(256, 128, bk, 8, 3, 8, 1), (128, 128, bk, 8, 4, 4, 1), (128, 128, bk, 8, 4, 8, 1),
                           (64, 128, bk, 8, 4, 4, 1), (128, 256, bk, 8, 3, 8, 0)]
        return _fit(cands, p.m, p.n)
    per_group = p.m / max(p.g, 1)
    if p.granularity is ScalingGranularity.BLOCKWISE:
        # Per-K-block promotion keeps a second 128 x BN fp32 tile live: BN=256 spills (and runs far
        # slower than 128 x 128, 8 warps), and so does 256 x 128 (216 bytes of stack, sm_90,
        # triton 3.6: tools/compile_sm90.py). The occupancy-2 entries (4-warp 64 x 128 / 128 x 64,
        # two persistent programs per SM) overlap one program's promotion with the other's wgmma;
        # tools/compile_sm90.py checks that two fit (sm_90, bk=128). They are untimed, so the
        # measured 128 x 128 stays first.
        cands = [(128, 128, bk, 8, 4, 8, 1), (128, 128, bk, 8, 3, 8, 1), (64, 128, bk, 8, 4, 4, 1, 2),
                 (128, 64, bk, 8, 4, 4, 1, 2), (64, 128, bk, 8, 4, 4, 1), (128, 64, bk, 8, 4, 4, 1),
                 (128, 128, bk, 8, 4, 8, 0), (64, 64, bk, 8, 4, 4, 1)]
    else:
        cands = [(128, 256, bk, 8, 3, 8, 1), (128, 128, bk, 8, 4, 8, 1), (128, 128, bk, 8, 4, 4, 1),
                 (256, 128, bk, 8, 3, 8, 1), (128, 256, bk, 8, 3, 8, 0), (64, 256, bk, 8, 4, 4, 1),
                 (64, 128, bk, 8, 4, 4, 1)]
    if per_group < 128:
        cands = cands[-2:] + cands[:-2]
    return _ws_configs(p, bk, ws_runs) + _fit(cands, p.m, p.n)


#: The warp-specialised Gluon kernel's grouped configs (ninth field ``KERNEL_GLUON_WS``), the first
#: the default; BK is replaced by the problem's K step. The order is the measured one: the
#: 256-column tile at 4 stages, then 3, then the 128-column tile (docs/kernels.md).
WS_CONFIGS = ((128, 256, 128, 8, 4, 8, 1, 1, KERNEL_GLUON_WS), (128, 256, 128, 8, 3, 8, 1, 1, KERNEL_GLUON_WS),
              (128, 128, 128, 8, 4, 8, 1, 1, KERNEL_GLUON_WS))

#: The warp-specialised wgrad kernel's configs (fp8_blockwise_wgrad_ws), the first the default: the
#: 128 x 128 tile at 4 and 5 stages, about 1.3x the Triton variable-K kernel (docs/kernels.md).
#: The wider tiles spill inside the wgmma loop because both scales are vectors (sm_90, triton 3.6,
#: tools/compile_sm90.py: 128 x 256 146 LDL/STL, 256 x 128 88) and are slower: neither is offered.
WGRAD_WS_CONFIGS = ((128, 128, 128, 8, 4, 8, 1, 1, KERNEL_GLUON_WS), (128, 128, 128, 8, 5, 8, 1, 1, KERNEL_GLUON_WS))


def _ws_configs(p, bk: int, ws_runs: bool) -> list[Config]:
    """``WS_CONFIGS`` (``WGRAD_WS_CONFIGS`` for a wgrad), first, where the warp-specialised kernel
    can run (``ws_runs``: ``_ws_problem_refusal`` found nothing) and takes the config
    (``_ws_config_refusal``); the 256-column tile only where N is at least 256."""
    if not ws_runs:
        return []
    table = WGRAD_WS_CONFIGS if p.variable_k else WS_CONFIGS
    cfgs = [c[:2] + (bk,) + c[3:] for c in table if c[1] <= max(128, p.n)]
    return [c for c in cfgs if _ws_config_refusal(p, c) is None]


def _ws_refusal(p, cfg) -> str | None:
    """Why the warp-specialised kernel cannot run ``cfg`` for ``p`` here, or None."""
    return _ws_problem_refusal(p) or _ws_config_refusal(p, cfg)


def _ws_problem_refusal(p) -> str | None:
    from . import fp8_blockwise_gluon_ws as GWS

    if p.granularity is not ScalingGranularity.BLOCKWISE:
        return "it serves blockwise fp8 only"
    if not p.variable_k and not p.b_2d:
        return "its forward/dgrad form serves the weight in 2-D tiles only"
    if p.platform != "cuda":
        return f"it runs on NVIDIA sm_90 (platform is {p.platform})"
    return GWS.available()


def _ws_config_refusal(p, cfg) -> str | None:
    from . import fp8_blockwise_gluon_ws as GWS
    from . import fp8_blockwise_wgrad_ws as GWW

    if cfg[2] != p.block_size:
        return f"its BK={cfg[2]} must equal block_size={p.block_size} (one scale per K step)"
    if p.variable_k:
        return GWW.config_error(cfg[:6], p.block_size)
    return GWS.config_error(cfg[:6], p.block_size)


def _check_config(cfg) -> Config:
    if not (isinstance(cfg, (tuple, list)) and len(cfg) in (7, 8, 9)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in cfg)):
        raise ValueError(f"TRITON grouped GEMM config must be (BM, BN, BK, GROUP_M, num_stages, num_warps, tma"
                         f"[, occupancy[, kernel]]) ints; got {cfg!r}")
    if len(cfg) >= 8 and not 1 <= cfg[7] <= MAX_OCCUPANCY:
        raise ValueError(f"TRITON grouped GEMM config: occupancy={cfg[7]} must be 1 to {MAX_OCCUPANCY} programs per SM")
    if len(cfg) == 9 and cfg[8] not in (0, KERNEL_GLUON_WS):
        raise ValueError(f"TRITON grouped GEMM config: kernel={cfg[8]} must be 0 (Triton) or {KERNEL_GLUON_WS} "
                         f"(the warp-specialised Gluon blockwise kernel)")
    return tuple(cfg)


def _is_ws(cfg) -> bool:
    return len(cfg) == 9 and cfg[8] == KERNEL_GLUON_WS


class _TritonAdapter(Adapter):
    library = "triton"

    def version(self) -> str:
        try:
            import triton
        except ImportError:
            return "missing"
        return triton.__version__

    def available(self) -> str | None:
        reason = _triton_reason()
        if reason is not None:
            return reason
        if _interpreting():
            return None
        if not torch.cuda.is_available():
            return "no GPU (torch.cuda.is_available() is False)"
        return None

    def _platform_reason(self, p) -> str | None:
        if p.platform in ("cuda", "rocm") or (p.platform == "cpu" and _interpreting()):
            return None
        return f"Triton kernels run on GPUs (platform is {p.platform})"

    def identity(self, config=None) -> str:
        from .grouped_kernels import KERNEL_REVISION

        revision = KERNEL_REVISION
        if config is not None and _is_ws(config):
            from .fp8_blockwise_gluon_ws import KERNEL_REVISION as ws_revision
            from .fp8_blockwise_wgrad_ws import KERNEL_REVISION as wgrad_revision

            # A WS config names the forward/dgrad kernel or the wgrad one by the problem, which
            # the identity does not see, so it carries both revisions.
            revision = f"{revision}+{ws_revision}+{wgrad_revision}"
        suffix = "" if config is None else f"/{tuple(config)}"
        return f"{self.library}-{self.version()}:{type(self).__name__}:{revision}{suffix}"


class TritonGroupedGemm(_TritonAdapter):
    """bf16/fp16 grouped GEMM: persistent M-grouped kernel (forward/dgrad) and a variable-K wgrad
    kernel; fp32 accumulation; group offsets read on the device (capturable, no host sync)."""

    def supports(self, p) -> str | None:
        reason = self._platform_reason(p)
        if reason is not None:
            return reason
        if p.dtype not in _HALF:
            return f"TRITON grouped GEMM takes bf16/fp16 (got {p.dtype}; fp32 would run on TF32 tensor cores)"
        return None

    def configs(self, p) -> Sequence[Config]:
        return _half_configs(p)

    def describe(self, p) -> str:
        kind = "variable-K wgrad kernel" if p.variable_k else "persistent M-grouped kernel"
        return f"Triton {kind}, default config {_half_configs(p)[0]} (no host sync, capturable)"

    def run(self, p, a, b, group_lens, group_offs, config=None):
        cfg = _half_configs(p)[0] if config is None else _check_config(config)
        offs = _offsets(group_lens, group_offs)
        up = _upcast(a.dtype)
        if p.variable_k:
            out = torch.empty((p.g, p.m, p.n), dtype=a.dtype, device=a.device)
            if p.k == 0:
                return out.zero_()
            return launch_variable_k(a, b, out, offs, cfg, upcast=up)
        out = torch.empty((p.m, p.n), dtype=a.dtype, device=a.device)
        b_gnk = b if p.trans_b else b.transpose(1, 2)
        return launch_fixed_k(a, b_gnk, out, offs, cfg, upcast=up)


# -- fp8 -------------------------------------------------------------------------------------------------
_SCALE_MODE = {ScalingGranularity.TENSORWISE: 1, ScalingGranularity.ROWWISE: 2, ScalingGranularity.BLOCKWISE: 3}


def _quant_rows(x3: torch.Tensor, dtype: torch.dtype, gran: ScalingGranularity, bs: Optional[int],
                tile_2d: bool = False, scale_rows_inner: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise x3[G, R, C] with C the reduction dimension: per tensor, per (g, row), 1 x bs runs
    along C, or (tile_2d) bs x bs tiles. Returns (data [G, R, C] with rows padded to 16 bytes,
    scale [G, nR, nC] or [1]; ``scale_rows_inner``: see quantize_cells)."""
    from .grouped_quantize import quantize_cells, tensorwise_scale

    _, r, c = x3.shape
    if gran is ScalingGranularity.TENSORWISE:
        return quantize_cells(x3, dtype, 1, 1, scale=tensorwise_scale(x3, dtype))
    if gran is ScalingGranularity.ROWWISE:
        return quantize_cells(x3, dtype, 1, max(c, 1))
    return quantize_cells(x3, dtype, bs if tile_2d else 1, bs, scale_rows_inner=scale_rows_inner)


class TritonGroupedGemmFp8(_TritonAdapter):
    """fp8 grouped GEMM: fused Triton quantisation (grouped_quantize.py), then the grouped kernels
    with tensorwise/rowwise scales in the epilogue or blockwise scales promoted per K block."""

    def supports(self, p) -> str | None:
        reason = self._platform_reason(p)
        if reason is not None:
            return reason
        if p.granularity not in _SCALE_MODE:
            return f"TRITON grouped fp8 has no {p.granularity.value} recipe (tensorwise, rowwise, blockwise)"
        if p.platform == "rocm" and not _gemm._rocm_ocp_fp8():
            return "Triton fp8 grouped GEMM uses OCP e4m3fn/e5m2, which this ROCm GPU lacks (needs gfx950+)"
        if p.a_dtype not in _IN or p.b_dtype not in _IN or p.out_dtype not in _OUT:
            return f"unsupported dtypes a={p.a_dtype} b={p.b_dtype} out={p.out_dtype}"
        if p.granularity is ScalingGranularity.BLOCKWISE:
            if not isinstance(p.block_size, int) or p.block_size <= 0 or p.block_size % 32:
                return f"TRITON blockwise fp8 needs block_size a multiple of 32 (got {p.block_size})"
        elif p.a_dtype in _FP8 or p.b_dtype in _FP8:
            return f"TRITON grouped fp8 takes pre-quantised operands for BLOCKWISE only (got {p.granularity.value})"
        return None

    def configs(self, p) -> Sequence[Config]:
        return _fp8_configs(p)

    def describe(self, p) -> str:
        cfg = _fp8_configs(p)[0]
        kernel = "warp-specialised Gluon" if _is_ws(cfg) else "Triton"
        return (f"Triton fused quantise + {kernel} {'variable-K' if p.variable_k else 'persistent M-grouped'} fp8 "
                f"kernel, {p.granularity.value}, default config {cfg} (no host sync, capturable)")

    def run(self, p, x, y, group_lens, group_offs, config=None):
        return self._run(p, x, y, group_lens, group_offs, config, None)

    def prepare(self, p, x, y, group_lens, group_offs, config=None):
        """``run``, and for pre-quantised blockwise operands on the warp-specialised kernels (the
        training step's GEMMs) a function that repeats the call with everything but the outputs
        and the descriptors' base tensors resolved: launches through the kernels' pre-bound
        plans (``prepare_grouped``, ``prepare_wgrad``). It runs ``run`` itself when the launch
        environment (``launch_env``: the Gluon switch, the interpreter) has changed since."""
        prepared: list = []
        out = self._run(p, x, y, group_lens, group_offs, config, prepared)
        if prepared:
            return out, prepared[0]
        return out, lambda x, y, group_lens, group_offs: self._run(p, x, y, group_lens, group_offs, config, None)

    def _run(self, p, x, y, group_lens, group_offs, config, prepared: Optional[list]):
        """``run``; with a ``prepared`` list, a warp-specialised launch of pre-quantised operands
        appends its repeat function to it (``prepare``)."""
        cfg = _fp8_configs(p)[0] if config is None else _check_config(config)
        # A default config came from _fp8_configs, which offers the WS ones only where they run.
        if config is not None and _is_ws(cfg):
            _raise_ws_refusal(cfg, _ws_refusal(p, cfg))
        offs = _offsets(group_lens, group_offs)
        gran, bs = p.granularity, p.block_size
        mode = _SCALE_MODE[gran]
        qblock = bs if gran is ScalingGranularity.BLOCKWISE else 128
        if gran is ScalingGranularity.BLOCKWISE and qblock % cfg[2]:
            raise ValueError(f"TRITON grouped fp8: BK={cfg[2]} must divide block_size={qblock}")
        up = _upcast(p.a_fp8, p.b_fp8)
        device = (x.data if isinstance(x, QuantizedTensor) else x).device
        if p.variable_k:
            out = torch.empty((p.g, p.m, p.n), dtype=p.out_dtype, device=device)
            if p.k == 0:
                return out.zero_()
            qx, sx, sxs = _wgrad_operand(x, p.a_fp8, gran, bs, mode)
            qy, sy, sys_ = _wgrad_operand(y, p.b_fp8, gran, bs, mode)
            if _is_ws(cfg):
                from .fp8_blockwise_wgrad_ws import launch_wgrad, operands_error, prepare_wgrad

                cfg = _ws_for_operands(p, cfg, config is not None, operands_error(qx, qy))
                if _is_ws(cfg):
                    if prepared is None or not _both_quantized(x, y):
                        return launch_wgrad(qx, qy, out, offs, sx, sxs, sy, sys_, cfg[:6], qblock=bs)
                    relaunch = prepare_wgrad(qx, qy, out, offs, sx, sxs, sy, sys_, cfg[:6], qblock=bs)
                    prepared.append(self._repeat_wgrad(p, config, relaunch))
                    return out
            return launch_variable_k(qx, qy, out, offs, cfg, scale=mode, sx=sx, sx_strides=sxs, sy=sy,
                                     sy_strides=sys_, qblock=qblock, upcast=up)
        out = torch.empty((p.m, p.n), dtype=p.out_dtype, device=device)
        if p.m == 0:
            return out
        if isinstance(x, QuantizedTensor):  # [M, K] in runs along K, scale [M, nK]
            qa, sa = x.data, x.scale
            sas = (sa.stride(0), sa.stride(1))
        else:
            qa3, sa = _quant_rows(x.unsqueeze(0), p.a_fp8, gran, bs)
            qa, sas = qa3[0], ((0, 0) if mode == 1 else (sa.stride(1), sa.stride(2)))
        b_copied = False
        if isinstance(y, QuantizedTensor):  # the weight's tiles, viewed [G, N, K] with K contiguous
            qb = y.data if p.trans_b else y.data.transpose(1, 2)
            sb = y.scale if p.trans_b else y.scale.transpose(1, 2)
            if qb.stride(2) != 1:  # fp8 MMAs read K-major operands
                qb, b_copied = qb.contiguous(), True
        else:
            qb, sb = _quant_rows(y if p.trans_b else y.transpose(1, 2), p.b_fp8, gran, bs, tile_2d=p.b_2d)
        sbs = (0, 0, 0) if mode == 1 else sb.stride()
        ndiv = bs if (gran is ScalingGranularity.BLOCKWISE and p.b_2d) else 1
        if _is_ws(cfg):
            from .fp8_blockwise_gluon_ws import grouped_operands_error, launch_grouped, prepare_grouped

            cfg = _ws_for_operands(p, cfg, config is not None, grouped_operands_error(qa, qb))
            if _is_ws(cfg):
                # The warp-specialised kernel zeroes the padded tail itself.
                if prepared is None or not _both_quantized(x, y) or b_copied:
                    return launch_grouped(qa, qb, out, offs, sa, sas, sb, sbs, cfg[:6], b_group=bs)
                relaunch = prepare_grouped(qa, qb, out, offs, sa, sas, sb, sbs, cfg[:6], b_group=bs)
                prepared.append(self._repeat_fixed_k(p, config, relaunch))
                return out
        return launch_fixed_k(qa, qb, out, offs, cfg, scale=mode, sa=sa, sa_strides=sas, sb=sb, sb_strides=sbs,
                              qblock=qblock, sb_ndiv=ndiv, upcast=up)

    def _repeat_fixed_k(self, p, config, relaunch):
        """The repeat of a prepared warp-specialised forward/dgrad (``prepare``)."""
        from .fp8_blockwise_gluon import launch_env

        env, shape, dtype, empty = launch_env(), (p.m, p.n), p.out_dtype, torch.empty

        def again(x, y, group_lens, group_offs):
            if launch_env() != env:
                return self._run(p, x, y, group_lens, group_offs, config, None)
            offs = _offsets(group_lens, group_offs)
            qa = x.data
            out = empty(shape, dtype=dtype, device=qa.device)
            # The relaunch reads b's data and scale by their pointers only (the first launch fixed
            # the strides): without trans_b's [G, N, K] views of them, which share those pointers.
            relaunch(qa, y.data, out, offs, x.scale, y.scale)
            return out

        return again

    def _repeat_wgrad(self, p, config, relaunch):
        """The repeat of a prepared warp-specialised wgrad (``prepare``)."""
        from .fp8_blockwise_gluon import launch_env

        env, shape, dtype, empty = launch_env(), (p.g, p.m, p.n), p.out_dtype, torch.empty

        def again(x, y, group_lens, group_offs):
            if launch_env() != env:
                return self._run(p, x, y, group_lens, group_offs, config, None)
            offs = _offsets(group_lens, group_offs)
            qx = x.data
            out = empty(shape, dtype=dtype, device=qx.device)
            relaunch(qx, y.data, out, offs, x.scale, y.scale)
            return out

        return again


def _both_quantized(x, y) -> bool:
    return isinstance(x, QuantizedTensor) and isinstance(y, QuantizedTensor)


def _ws_for_operands(p, cfg: Config, pinned: bool, why: str | None) -> Config:
    """The config that serves operands the warp-specialised ``cfg`` refuses for ``why`` (None:
    ``cfg`` itself): a pinned or tuned config raises the reason, a default one gives way to the
    first Triton config (``_default_for_operands``). The machine and the config were checked
    before (``_fp8_configs`` for a default, ``_ws_refusal`` for a pinned one), so ``run`` launches
    the kernel without its public wrapper, which would repeat every check: host time per call."""
    if pinned:
        _raise_ws_refusal(cfg, why)
        return cfg
    return _default_for_operands(p, cfg, why)


def _raise_ws_refusal(cfg: Config, why: str | None) -> None:
    """A pinned or tuned warp-specialised config raises ``why`` (the machine, the config or the
    operands refusing it), if any."""
    if why:
        raise ValueError(f"TRITON grouped fp8: config {tuple(cfg)} selects the warp-specialised Gluon kernel, "
                         f"but {why}")


def _default_for_operands(p, cfg: Config, why: str | None) -> Config:
    """The default config when it can take these operands, else the first offered config of the
    Triton kernels (which read any layout). The warp-specialised kernel's TMA loads need
    K-contiguous, 16-byte aligned operands: the step's own quantisers always lay them out so, a
    hand-made QuantizedTensor (token-major runs from ``quantize(x, axis=0)``, say) may not. Only an
    unpinned call lands here; a pinned WS config raises the kernel's reason instead."""
    if why is None:
        return cfg
    fallback = next(c for c in _fp8_configs(p) if not _is_ws(c))
    log.debug("TRITON grouped fp8: default config %s cannot take these operands (%s); using %s",
              tuple(cfg), why, tuple(fallback))
    return fallback


def _wgrad_operand(t, dtype: torch.dtype, gran: ScalingGranularity, bs: Optional[int], mode: int):
    """A wgrad operand as the variable-K kernel reads it: ([T, cols] fp8 view, scale, its
    (token-block, column) strides). A token-major input becomes token-contiguous fp8 (K-major for
    the fp8 MMA; rows padded to 16 bytes, so TMA takes it) with scales along T, stored
    column-block-major so that one step's scales of BM rows are one contiguous load; a
    QuantizedTensor (runs along the tokens, scale [nT, cols]) is read as it is."""
    if isinstance(t, QuantizedTensor):
        return t.data, t.scale, (t.scale.stride(0), t.scale.stride(1))
    q, s = _quant_rows(t.t().unsqueeze(0), dtype, gran, bs, scale_rows_inner=True)
    strides = (0, 0) if mode == 1 else (s.stride(2), s.stride(1))  # scale [1, cols, nT]
    return q[0].t(), s, strides
