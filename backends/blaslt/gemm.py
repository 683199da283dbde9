"""CUBLASLT / HIPBLASLT adapters for gemm and gemm_fp8.

The same two classes are registered as CUBLASLT (platform cuda) and HIPBLASLT (platform rocm):
PyTorch names the vendor BLAS-Lt of both platforms the same way, so only ``library`` differs.

* ``BlasLtGemm`` (bf16/fp16 in, same dtype or fp32 out): ``torch.matmul`` / ``torch.mm`` with
  PyTorch's preferred BLAS library switched to cuBLASLt (hipBLASLt) for the duration of the call.
  That switch is *process-global* (``torch.backends.cuda.preferred_blas_library``): we set it, run,
  and restore the previous value in a ``finally``, so an exception never leaves it changed. Another
  thread that launches a GEMM in that window would also get cuBLASLt; training loops issue GEMMs
  from one thread, so we accept that. PyTorch documents the switch as a preference: an operation
  cuBLASLt does not implement may still run on another library.
  Configs: ``"cublaslt"`` (the default) and ``"cublas"`` (the classic cuBLAS API, PyTorch's usual
  pick), so the autotuner can compare the two libraries per shape.
* ``BlasLtGemmFp8``: quantise both operands (``turbo_dispatch.low_precision.fast_quantize``: the Triton
  quantizer when it is available, else the reference ``turbo_dispatch.low_precision.quantize``;
  ``describe`` says which), then
  ``torch._scaled_mm`` (tensorwise, rowwise) or ``torch.nn.functional.scaled_mm`` (blockwise
  1x128 x 128x128 and 1x128 x 1x128). Unlike the TORCH adapter it never emulates: a recipe the
  library cannot run is refused by ``supports`` with the reason. Note that PyTorch runs
  *tensorwise* and *blockwise* on cuBLASLt but *rowwise* on its own CUTLASS kernel on sm_89+
  (``f8f8bf16_rowwise``); ``describe`` says so. Configs for tensorwise/rowwise: ``"fp32_accum"``
  (the default; partial sums promoted to fp32) and ``"fast_accum"`` (``use_fast_accum=True``: the
  tensor core's reduced-precision accumulator); the autotuner's correctness gate decides whether
  fast accumulation is accurate enough for a key.

The support and stride helpers are imported from ``turbo_dispatch.backends.torch.gemm`` (one
definition of what torch's scaled-mm accepts), not copied.
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, Hashable

import torch

from turbo_dispatch.adapter import Adapter
from turbo_dispatch.low_precision import QuantizedTensor, ScalingGranularity

from turbo_dispatch.low_precision.fast_quantize import quantize_operand, quantizer_name
from ..torch.gemm import _capability, _row_major, _scaled, _scaled_mm_unsupported
from . import rocm

log = logging.getLogger("turbo_dispatch.backends.blaslt.gemm")

#: Bumped whenever what an adapter runs for a given config changes (invalidates tuning results).
KERNEL_REVISION = "1"

_GPU_PLATFORMS = ("cuda", "rocm")
_HALF = (torch.bfloat16, torch.float16)


# -- library facts ---------------------------------------------------------------------------------
def _is_rocm() -> bool:
    return bool(getattr(torch.version, "hip", None))


def _library_name() -> str:
    return "hipblaslt" if _is_rocm() else "cublaslt"


@functools.lru_cache(maxsize=None)
def _runtime_version() -> str:
    """The GPU runtime torch was built with: ``cuda-13.0`` or ``hip-6.4...``; ``none`` on CPU builds."""
    if _is_rocm():
        return f"hip-{torch.version.hip}"
    if torch.version.cuda:
        return f"cuda-{torch.version.cuda}"
    return "none"


def _blas_switch() -> tuple[Callable[[], Any], Callable[[Any], None], Any] | None:
    """(get, set, _BlasBackend enum) of torch's preferred-BLAS-library switch, or None if this
    torch has none. The private getters cost well under a microsecond; the public
    ``preferred_blas_library`` wrapper adds Python argument handling on top."""
    get = getattr(torch._C, "_get_blas_preferred_backend", None)
    put = getattr(torch._C, "_set_blas_preferred_backend", None)
    kind = getattr(torch._C, "_BlasBackend", None)
    if get is None or put is None or kind is None or not hasattr(kind, "Cublaslt"):
        return None
    return get, put, kind


def _gpu_unavailable() -> str | None:
    if torch.version.cuda is None and not _is_rocm():
        return "this torch build has no CUDA or ROCm support (CPU-only build)"
    if not torch.cuda.is_available():
        return "no GPU is visible to torch (torch.cuda.is_available() is False)"
    return None


def _platform_reason(platform: str) -> str | None:
    if platform not in _GPU_PLATFORMS:
        return f"{_library_name()} runs on GPUs only (platform is {platform})"
    if platform == "rocm" and not _is_rocm():
        return "platform rocm, but this torch is a CUDA build"
    if platform == "cuda" and _is_rocm():
        return "platform cuda, but this torch is a ROCm build"
    return None


class _BlasLtAdapter(Adapter):
    """Shared library/version/identity/availability of the BLAS-Lt adapters."""

    @property
    def library(self) -> str:  # type: ignore[override]
        return _library_name()

    def version(self) -> str:
        return _runtime_version()

    def identity(self, config: Hashable = None) -> str:
        # torch's version is part of it: torch picks the cuBLASLt algorithm and sets up the call.
        suffix = "" if config is None else f"/{config}"
        return (f"{self.library}-{self.version()}:torch-{torch.__version__}:{type(self).__name__}"
                f":rev{KERNEL_REVISION}{suffix}")

    def available(self) -> str | None:
        reason = _gpu_unavailable()
        if reason is not None:
            return reason
        if _blas_switch() is None:
            return f"this torch ({torch.__version__}) has no preferred-BLAS-library switch"
        return None


# -- bf16 / fp16 -----------------------------------------------------------------------------------
#: config -> name in torch's _BlasBackend enum. "hipblas*" are ROCm spellings of the same members.
_LIBRARY_CONFIGS = {"cublaslt": "Cublaslt", "hipblaslt": "Cublaslt", "cublas": "Cublas", "hipblas": "Cublas"}
#: Every library ``run_with_preferred_blas`` switches to: the configs above and CK (the CK adapter's).
_BLAS_MEMBERS = {**_LIBRARY_CONFIGS, "ck": "Ck"}
#: Held from setting a preference until it is restored (``run_switched``): two threads switching
#: at once would otherwise restore each other's choice and leave the process-global value changed.
_SWITCH_LOCK = threading.RLock()


def run_with_preferred_blas(library: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Runs ``fn`` with torch's preferred BLAS library set to ``library`` (a key of
    ``_LIBRARY_CONFIGS``, or ``"ck"``) and restores the previous preference afterwards, also on an
    exception. When the preference already is ``library``, nothing is switched."""
    switch = _blas_switch()
    if switch is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no preferred-BLAS-library switch")
    get, put, kind = switch
    return run_switched(get, put, getattr(kind, _BLAS_MEMBERS[library]), fn)


def run_switched(get: Callable[[], Any], put: Callable[[Any], None], target: Any, fn: Callable[[], Any]) -> Any:
    """Runs ``fn`` with a process-global torch preference (read by ``get``, written by ``put``) set
    to ``target``, and restores the previous value afterwards, also on an exception; nothing is
    switched when it already is ``target``. Every switch made through here holds ``_SWITCH_LOCK``
    until it is restored."""
    with _SWITCH_LOCK:
        previous = get()
        if previous == target:
            return fn()
        put(target)
        try:
            return fn()
        finally:
            put(previous)


class BlasLtGemm(_BlasLtAdapter):
    """bf16/fp16 GEMM on the vendor BLAS-Lt via torch.matmul with cuBLASLt (hipBLASLt) preferred.

    Not ``differentiable``: the preference is only in force inside ``run``, so the backward GEMMs
    must be dispatched (and switched) on their own, which the op's autograd.Function does.
    """

    def supports(self, p) -> str | None:
        reason = _platform_reason(p.platform)
        if reason is not None:
            return reason
        if p.a_dtype not in _HALF or p.b_dtype != p.a_dtype:
            return f"{self.library} adapter serves bf16/fp16 inputs (got {p.a_dtype}); fp32 GEMMs stay on TORCH"
        if p.out_dtype not in (p.a_dtype, torch.float32):
            return f"output must be the input dtype or fp32 (got {p.out_dtype})"
        return None

    def configs(self, p) -> list[str]:
        return ["hipblaslt", "hipblas"] if p.platform == "rocm" else ["cublaslt", "cublas"]

    def describe(self, p) -> str:
        return (f"torch.matmul with torch's preferred BLAS library set to {self.library} for the call "
                "(a preference: torch may still use another library for a case it does not implement)")

    def run(self, p, a, b, config=None):
        library = self.library if config is None else config
        if library not in _LIBRARY_CONFIGS:
            raise ValueError(f"{type(self).__name__}: unknown config {config!r}; valid: {', '.join(_LIBRARY_CONFIGS)}")
        lhs = a.t() if p.trans_a else a
        rhs = b.t() if p.trans_b else b
        if p.out_dtype == a.dtype:
            return run_with_preferred_blas(library, lambda: torch.matmul(lhs, rhs))
        # fp32 out: the GEMM writes its fp32 accumulator directly (no bf16 rounding in between).
        return run_with_preferred_blas(library, lambda: torch.mm(lhs, rhs, out_dtype=torch.float32))


# -- fp8 -------------------------------------------------------------------------------------------
_ACCUM_CONFIGS = ("fp32_accum", "fast_accum")
_PER_TENSOR_OR_ROW = (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE)


def _swapped(p):
    """C^T = op(b)^T op(a)^T: the problem with the operands exchanged. cuBLASLt takes 128x128
    tiles on its second operand only, so a problem whose *first* operand is tiled runs swapped."""
    return p._replace(m=p.n, n=p.m, trans_a=not p.trans_b, trans_b=not p.trans_a, a_dtype=p.b_dtype,
                      b_dtype=p.a_dtype, a_fp8=p.b_fp8, b_fp8=p.a_fp8, a_2d=p.b_2d, b_2d=p.a_2d)


def _rocm_fp8_reason() -> str | None:
    arch = rocm.gfx_arch()
    if arch == "gfx950" or arch.startswith("gfx12"):
        return None
    return (f"hipBLASLt runs the OCP fp8 encodings (e4m3fn/e5m2) on gfx950/gfx12; {arch} uses the fnuz "
            "encodings, which this op's recipes do not produce")


class BlasLtGemmFp8(_BlasLtAdapter):
    """FP8 GEMM through torch._scaled_mm / F.scaled_mm (cuBLASLt; rowwise is torch's CUTLASS kernel),
    quantising with the Triton quantizer when available. Refuses (never emulates) what it cannot run."""

    def supports(self, p) -> str | None:
        reason = _platform_reason(p.platform)
        if reason is not None:
            return reason
        g = p.granularity
        if g is ScalingGranularity.MX_BLOCKWISE:
            if p.platform == "cuda":
                major, minor = _capability(torch.cuda.current_device())
                if major < 10:
                    return f"MX_BLOCKWISE needs block-scaled fp8 tensor cores (sm_100+); this GPU is sm_{major}{minor}"
            return ("MX_BLOCKWISE is not wired up in this adapter (cuBLASLt wants swizzled E8M0 scales; "
                    "not verified on sm_100 hardware yet)")
        if p.platform == "rocm":
            reason = _rocm_fp8_reason()
            if reason is not None:
                return reason
            if g is ScalingGranularity.BLOCKWISE:
                return "blockwise fp8 through hipBLASLt is not verified; use TORCH or TRITON"
            if g is ScalingGranularity.ROWWISE:
                reason = rocm.rowwise_scaled_mm_reason()
                if reason is not None:
                    return reason
        if p.a_2d and p.b_2d:
            return "both operands in 2-D tiles: cuBLASLt takes 128x128 tiles on one operand only"
        q = _swapped(p) if p.a_2d else p
        # The checks of what torch's scaled-mm accepts live in the TORCH adapter (one definition).
        return _scaled_mm_unsupported(q if q.platform == "cuda" else q._replace(platform="cuda"))

    def configs(self, p) -> list:
        if p.granularity in _PER_TENSOR_OR_ROW:
            return list(_ACCUM_CONFIGS)
        return [None]

    def describe(self, p) -> str:
        g = p.granularity
        if g is ScalingGranularity.ROWWISE and p.platform == "cuda":
            kernel = "torch._scaled_mm rowwise (torch's CUTLASS f8f8bf16_rowwise kernel, not cuBLASLt)"
        elif g in _PER_TENSOR_OR_ROW:
            kernel = f"torch._scaled_mm {g.value} ({self.library})"
        else:
            kernel = f"torch.nn.functional.scaled_mm {g.value} ({self.library})"
        swap = "; operands swapped (first operand tiled)" if p.a_2d and not p.b_2d else ""
        quant = {quantizer_name(g, p.a_2d, p.block_size), quantizer_name(g, p.b_2d, p.block_size)}
        return f"{kernel}{swap}; quantizer: {' / '.join(sorted(quant))}"

    def _fast_accum(self, p, config) -> bool:
        if config is None or config == "fp32_accum":
            return False
        if config == "fast_accum" and p.granularity in _PER_TENSOR_OR_ROW:
            return True
        raise ValueError(f"{type(self).__name__}: config {config!r} is not valid for {p.granularity.value}; "
                         f"valid: {self.configs(p)}")

    def run(self, p, a, b, config=None):
        fast = self._fast_accum(p, config)
        if p.a_2d and not p.b_2d:
            return self.run(_swapped(p), b, a, config).t().contiguous()
        g = p.granularity
        # Quantise the operands as the views cuBLASLt reads, A [M, K] and B^T [N, K], both along K:
        # both quantizers write the fp8 data contiguous in the view's shape, so a trans flag costs
        # no extra copy (the Triton one fuses the transpose into its single pass).
        # A pre-quantised operand (QuantizedTensor) is taken as is; .t() is then a view of its data
        # and scale, which _row_major / _scaled copy only where the stored layout is not the one read.
        lhs = a.t() if p.trans_a else a
        rhs = b if p.trans_b else b.t()
        qa = lhs if isinstance(lhs, QuantizedTensor) else quantize_operand(lhs, p.a_fp8, g, 1, p.block_size, p.a_2d)
        qb = rhs if isinstance(rhs, QuantizedTensor) else quantize_operand(rhs, p.b_fp8, g, 1, p.block_size, p.b_2d)
        if g not in _PER_TENSOR_OR_ROW:
            # blockwise: the TORCH adapter's stride-exact F.scaled_mm call, told the layouts we made
            return _scaled(p._replace(trans_a=False, trans_b=True), qa, qb)
        mat_a = _row_major(qa.data)  # [M, K] row-major
        mat_b = _row_major(qb.data).t()  # [K, N] column-major
        if g is ScalingGranularity.TENSORWISE:
            scale_a, scale_b = qa.scale, qb.scale
        else:
            scale_a, scale_b = qa.scale.reshape(p.m, 1), qb.scale.reshape(1, p.n)
        return torch._scaled_mm(mat_a, mat_b, scale_a, scale_b, out_dtype=p.out_dtype, use_fast_accum=fast)
