"""TRITON adapters for gemm and gemm_fp8: our own persistent Triton kernels.

* ``TritonGemm``: gemm_kernels.gemm, every layout without copies (transposed operands are read in
  their stored orientation through TMA or strided pointers).
* ``TritonGemmFp8``: quantize.quantize_kmajor (fused amax/scale/cast, and transpose where the
  operand is not K-major) on both operands, then fp8_gemm_kernels.fp8_gemm. Covers TENSORWISE,
  ROWWISE and BLOCKWISE (1 x bs and bs x bs on either operand, so forward, dgrad and wgrad). An
  operand that arrives pre-quantised (the wgrad's saved activation) skips the quantiser.

Configs are ``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps[, occupancy[, kernel]])``
tuples from configs.py (``kernel`` 1: the blockwise fp8 Gluon kernel, fp8_blockwise_gluon.py);
``config=None`` takes the first (the heuristic pick for the problem's size class).
Importing this module never needs triton; ``available()`` says when it is missing.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch

from turbo_dispatch.adapter import Adapter
from turbo_dispatch.low_precision import QuantizedTensor, ScalingGranularity

from . import configs as _cfg
from .prebound import MAX_PLANS, BoundedCache
from .quantize import available as _available

_HP = (torch.bfloat16, torch.float16, torch.float32)
#: BLOCKWISE block sizes the fp8 kernel runs: BLOCK_K equals the block, and an fp8 dot needs K >= 32.
FP8_BLOCK_SIZES = (32, 64, 128)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "absent"
    return triton.__version__


def _interpreting() -> bool:
    from .gemm_kernels import interpreting

    return interpreting()


def _platform_reason(p) -> str | None:
    if p.platform in ("cuda", "rocm"):
        return None
    if p.platform == "cpu" and _interpreting():
        return None  # the Triton interpreter (tests)
    return f"Triton kernels run on cuda/rocm GPUs (platform is {p.platform}; TRITON_INTERPRET=1 runs them on cpu)"


def rocm_fitted(p, candidates: list, a_bytes: int, b_bytes: int) -> list:
    """``candidates`` as offered for ``p``: on ROCm, fitted to the GPU's LDS (``configs.rocm_fit``;
    the first that fits stays the default), elsewhere unchanged."""
    if getattr(p, "platform", None) != "rocm":  # tools/compile_sm90.py passes keys without a platform
        return candidates
    from ..blaslt import rocm

    return _cfg.rocm_fit(candidates, a_bytes, b_bytes, rocm.gfx_arch())


def _pick(config, candidates: list, what: str):
    if config is None:
        return candidates[0]
    return _cfg.from_tuple(config)


#: The tile config of each (problem, config) a TritonGemm call met: the candidate list and the
#: config's validation are pure functions of the two, and a call should not redo them.
_TILES = BoundedCache(MAX_PLANS)


class _Fp8Plan(NamedTuple):
    """A TritonGemmFp8 call's choices for one (problem, config): the tile config, the Gluon
    kernel's entry point (None: the Triton kernel), the scale mode, whether the row scales are
    flattened (ROWWISE), the block size passed to the quantiser, and each operand's scale group."""

    cfg: _cfg.TileConfig
    gluon_gemm: Optional[Callable]
    mode: int
    rowwise: bool
    block_size: Optional[int]
    a_group: int
    b_group: int


#: The ``_Fp8Plan`` of each (problem, config[, Gluon switch]) a TritonGemmFp8 call met.
_FP8_PLANS = BoundedCache(MAX_PLANS)


def _fp8_plan_key(p, config) -> tuple:
    """The ``_FP8_PLANS`` key of a call: the problem and config, and where a Gluon kernel could
    serve the problem (BLOCKWISE on cuda), the Gluon switch's value (read per call, as the
    kernels' own ``available()`` reads it)."""
    if config is not None and not isinstance(config, tuple):
        config = tuple(config)  # a JSON list from a tuning DB
    if p.granularity is ScalingGranularity.BLOCKWISE and p.platform == "cuda":
        return p, config, _gluon_switch()
    return p, config


def _gluon_switch() -> "str | None":
    """The Gluon kernels' switch as their ``available()`` reads it (``fp8_blockwise_gluon.read_switch``)."""
    return _gluon_module().read_switch()


@functools.lru_cache(maxsize=None)
def _gluon_module():
    """fp8_blockwise_gluon, imported on first use (importing this module must not need triton)."""
    return gluon_kernel(_cfg.KERNEL_GLUON)


@functools.lru_cache(maxsize=None)
def _fp8_modules():
    """(quantize, fp8_gemm_kernels), imported on first use (importing this module must not need triton)."""
    from . import fp8_gemm_kernels, quantize

    return quantize, fp8_gemm_kernels


@functools.lru_cache(maxsize=None)
def _kernels():
    """The gemm_kernels module, imported on first use (importing this module must not need triton)."""
    from . import gemm_kernels

    return gemm_kernels


class _TritonAdapter(Adapter):
    library = "triton"
    revision = ""

    def available(self) -> str | None:
        return _available()

    def version(self) -> str:
        return _triton_version()

    def identity(self, config=None) -> str:
        suffix = "" if config is None else f"/{tuple(config)}"
        return f"triton-{self.version()}:{type(self).__name__}/{self.revision}{suffix}"


def _gemm_revision() -> str:
    try:
        from .gemm_kernels import KERNEL_REVISION
    except ImportError:  # pragma: no cover
        return "unknown"
    return KERNEL_REVISION


def _fp8_revision() -> str:
    try:
        from .fp8_gemm_kernels import KERNEL_REVISION
        from .gemm_kernels import KERNEL_REVISION as base
    except ImportError:  # pragma: no cover
        return "unknown"
    return f"{KERNEL_REVISION}+quant-r1+{base}"


def _scale_groups(p) -> tuple[int, int]:
    """Rows sharing one scale in a and b: the block size for 2-D blockwise tiles, else 1."""
    bs = p.block_size if p.granularity is ScalingGranularity.BLOCKWISE else 1
    return (bs if p.a_2d else 1), (bs if p.b_2d else 1)


def gluon_kernel(kind: int):
    """The module of Gluon kernel ``kind`` (``configs.GLUON_KERNELS``). Each has ``available()``,
    ``config_error(cfg, b_group)``, ``fp8_blockwise_gemm(...)`` and ``KERNEL_REVISION``."""
    if kind == _cfg.KERNEL_GLUON:
        from . import fp8_blockwise_gluon as module
    elif kind == _cfg.KERNEL_GLUON_WS:
        from . import fp8_blockwise_gluon_ws as module
    else:
        raise ValueError(f"kernel={kind} is not a Gluon kernel (one of {_cfg.GLUON_KERNELS})")
    return module


def _gluon_problem_refusal(p) -> str | None:
    """Why no Gluon blockwise kernel can serve ``p`` at all, or None (the recipe and platform)."""
    if p.granularity is not ScalingGranularity.BLOCKWISE:
        return f"it serves BLOCKWISE only (got {p.granularity.value})"
    if p.platform != "cuda":
        return f"it runs on NVIDIA sm_90 (platform is {p.platform})"
    return None


def _gluon_refusal(p, cfg: _cfg.TileConfig) -> str | None:
    """Why the Gluon blockwise kernel ``cfg.kernel`` cannot run ``cfg`` for ``p`` here, or None."""
    kernel = gluon_kernel(cfg.kernel)
    return _gluon_problem_refusal(p) or kernel.available() or kernel.config_error(cfg, _scale_groups(p)[1])


class TritonGemm(_TritonAdapter):
    """Persistent Triton GEMM (TMA on sm_90+, pointer loads elsewhere); fp32 inputs use TF32x3."""

    revision = _gemm_revision()

    def supports(self, p) -> str | None:
        reason = _platform_reason(p)
        if reason:
            return reason
        if p.a_dtype not in _HP or p.b_dtype != p.a_dtype:
            return f"Triton gemm takes bf16/fp16/fp32 operands of one dtype (got {p.a_dtype}, {p.b_dtype})"
        if p.out_dtype not in _HP:
            return f"Triton gemm writes bf16/fp16/fp32 (got {p.out_dtype})"
        if p.platform == "rocm" and p.a_dtype == torch.float32:
            return ("fp32 Triton gemm uses tf32x3 dots, which Triton's AMD backend does not offer "
                    "(ieee, tf32, bf16x3, bf16x6); fp32 GEMMs stay on TORCH there")
        return None

    def _candidates(self, p) -> list:
        es = torch.empty((), dtype=p.a_dtype).element_size()
        return rocm_fitted(p, _cfg.gemm_candidates(p.m, p.n, p.k, es), es, es)

    def configs(self, p):
        return [_cfg.as_tuple(c) for c in self._candidates(p)]

    def describe(self, p) -> str:
        return f"triton persistent gemm, default tile {self.configs(p)[0]}"

    def run(self, p, a, b, config=None):
        tile = _TILES.get((p, config))
        if tile is None:
            tile = _TILES.put((p, config), _pick(config, self._candidates(p), "gemm"))
        return _kernels().gemm(a, b, p.trans_a, p.trans_b, p.out_dtype, tile)


@functools.lru_cache(maxsize=None)
def _rocm_ocp_fp8() -> bool:
    """ROCm GPUs with OCP fp8 (e4m3fn/e5m2) matrix instructions: gfx950 (MI350) and newer."""
    try:
        name = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName
    except Exception:  # noqa: BLE001 - no device / not ROCm
        return False
    return name.startswith("gfx95") or name.startswith("gfx12")


def _kmajor_prequantized(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-quantised logical operand [R, K] as ``quantize_kmajor`` would have returned it: data
    K-major with 16-byte rows (TMA), 1-D block scales stored R-major (one coalesced load per K
    block). Copies only what is not already laid out so; the op's saved activation already is,
    except for the row padding when M is not a multiple of 16 (then the kernel's pointer-load
    path would also do; the copy buys the TMA path for an fp8-sized tensor)."""
    data, scale = q.data, q.scale
    if not (data.stride(1) == 1 and data.stride(0) % 16 == 0 and data.data_ptr() % 16 == 0):
        rows, cols = data.shape
        ld = -(-cols // 16) * 16
        data = torch.empty((rows, ld), dtype=data.dtype, device=data.device)[:, :cols].copy_(data)
    if q.granularity is ScalingGranularity.BLOCKWISE and not q.block_2d and scale.stride(0) != 1:
        scale = scale.t().contiguous().t()
    return data, scale


class TritonGemmFp8(_TritonAdapter):
    """Fused Triton quantisation + persistent fp8 GEMM (tensorwise / rowwise / blockwise)."""

    revision = _fp8_revision()

    def supports(self, p) -> str | None:
        reason = _platform_reason(p)
        if reason:
            return reason
        if p.platform == "rocm" and not _rocm_ocp_fp8():
            return "Triton fp8 GEMM uses OCP e4m3fn/e5m2, which this ROCm GPU lacks (needs gfx950+)"
        g = p.granularity
        if g is ScalingGranularity.MX_BLOCKWISE:
            return "MX_BLOCKWISE (power-of-two block scales) is not implemented in the Triton fp8 GEMM"
        if g is ScalingGranularity.BLOCKWISE and p.block_size not in FP8_BLOCK_SIZES:
            return f"Triton blockwise fp8 GEMM needs block_size in {FP8_BLOCK_SIZES} (got {p.block_size})"
        # An fp8 operand dtype means the operand arrives pre-quantised (as its fp8 dtype).
        if p.a_dtype not in _HP + (p.a_fp8,) or p.b_dtype not in _HP + (p.b_fp8,) or p.out_dtype not in _HP:
            return (f"Triton fp8 GEMM takes bf16/fp16/fp32 or pre-quantised inputs and bf16/fp16/fp32 output "
                    f"(got {p.a_dtype}, {p.b_dtype} -> {p.out_dtype})")
        return None

    def _candidates(self, p):
        """The configs that can run ``p`` here. The problem- and machine-level Gluon checks (an
        env parse and a device query among them) run once per call and kernel kind, not once per
        config: an untuned call lists its candidates every time."""
        bk = p.block_size if p.granularity is ScalingGranularity.BLOCKWISE else None
        cands = rocm_fitted(p, _cfg.fp8_candidates(p.m, p.n, p.k, bk), 1, 1)
        if _gluon_problem_refusal(p):
            return [c for c in cands if c.kernel == _cfg.KERNEL_TRITON]
        kinds = {c.kernel for c in cands if c.kernel in _cfg.GLUON_KERNELS}
        runnable = {kind for kind in kinds if gluon_kernel(kind).available() is None}
        b_group = _scale_groups(p)[1]
        return [c for c in cands if c.kernel == _cfg.KERNEL_TRITON
                or (c.kernel in runnable and gluon_kernel(c.kernel).config_error(c, b_group) is None)]

    def configs(self, p):
        return [_cfg.as_tuple(c) for c in self._candidates(p)]

    def identity(self, config=None) -> str:
        # Only Gluon configs carry the Gluon kernel's revision, so changing that kernel does not
        # invalidate tuned results of the Triton kernel's configs (and vice versa is handled by
        # the shared revision).
        ident = super().identity(config)
        kind = _cfg.from_tuple(config).kernel if config is not None else _cfg.KERNEL_TRITON
        if kind in _cfg.GLUON_KERNELS:
            revision = gluon_kernel(kind).KERNEL_REVISION
            ident = ident.replace(f"/{self.revision}/", f"/{self.revision}+{revision}/", 1)
        return ident

    def describe(self, p) -> str:
        return f"triton quantise (fused, K-major) + persistent fp8 gemm, {p.granularity.value}, default tile {self.configs(p)[0]}"

    def _plan(self, p, config) -> "_Fp8Plan":
        """What ``run`` needs of ``(p, config)`` besides the tensors: the tile config (checked
        against ``p``) and the kernel, scale mode and scale groups it runs with."""
        from . import fp8_gemm_kernels as fk

        cfg = _pick(config, self._candidates(p), "gemm_fp8")
        g = p.granularity
        blockwise = g is ScalingGranularity.BLOCKWISE
        if blockwise and cfg.block_k != p.block_size:
            raise ValueError(f"TritonGemmFp8: config BLOCK_K={cfg.block_k} must equal block_size={p.block_size}")
        gluon = cfg.kernel in _cfg.GLUON_KERNELS
        # A default config came from _candidates, which already checked it.
        why = _gluon_refusal(p, cfg) if gluon and config is not None else None
        if why:
            raise ValueError(f"TritonGemmFp8: config {_cfg.as_tuple(cfg)} selects the Gluon kernel, but {why}")
        mode = {ScalingGranularity.TENSORWISE: fk.SCALE_TENSOR, ScalingGranularity.ROWWISE: fk.SCALE_ROW}.get(
            g, fk.SCALE_BLOCK)
        return _Fp8Plan(cfg, gluon_kernel(cfg.kernel).fp8_blockwise_gemm if gluon else None, mode,
                        g is ScalingGranularity.ROWWISE, p.block_size if blockwise else None, *_scale_groups(p))

    def run(self, p, a, b, config=None):
        key = _fp8_plan_key(p, config)
        plan = _FP8_PLANS.get(key)
        if plan is None:
            plan = _FP8_PLANS.put(key, self._plan(p, config))
        g = p.granularity
        # Both operands K-major ([M, K] and [N, K]); a transposed view is quantised into a
        # contiguous K-major copy by the same pass (cast + scale + transpose).
        lhs = a.t() if p.trans_a else a
        rhs = b if p.trans_b else b.t()
        quantize_kmajor = _fp8_modules()[0].quantize_kmajor
        qa, sa = _kmajor_prequantized(lhs) if isinstance(lhs, QuantizedTensor) else quantize_kmajor(
            lhs, p.a_fp8, g, plan.block_size, p.a_2d)
        qb, sb = _kmajor_prequantized(rhs) if isinstance(rhs, QuantizedTensor) else quantize_kmajor(
            rhs, p.b_fp8, g, plan.block_size, p.b_2d)
        if plan.rowwise:
            sa, sb = sa.reshape(-1), sb.reshape(-1)
        if plan.gluon_gemm is not None:
            return plan.gluon_gemm(qa, qb, sa, sb, p.out_dtype, plan.cfg, a_group=plan.a_group, b_group=plan.b_group)
        return _fp8_modules()[1].fp8_gemm(qa, qb, sa, sb, plan.mode, p.out_dtype, plan.cfg, a_group=plan.a_group,
                                          b_group=plan.b_group)
