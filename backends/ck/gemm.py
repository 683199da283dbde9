"""CK adapter for gemm (bf16/fp16): AMD's Composable Kernel, reached through torch on ROCm builds.

Two configs:

* ``"blas"`` (the default): ``torch.matmul`` with torch's preferred BLAS library set to CK
  (``torch.backends.cuda.preferred_blas_library("ck")``, ROCm builds only) for the duration of
  the call, restored afterwards under the lock every preference switch here shares
  (``blaslt.gemm.run_switched``). The preference is process-global, so another thread's GEMM
  launched inside that window also gets CK. torch documents it as a preference: an operation CK
  does not implement may run on another library. ``available()`` sets it once and reads it back,
  so a build or GPU where torch keeps another library is refused with that reason.
* ``"inductor"`` (only where ``ck4inductor``, CK's Python package for Inductor, is importable):
  the matmul compiled by Inductor with ``max_autotune`` and ``max_autotune_gemm_backends="CK"``,
  which generates, compiles and times CK GEMM instances for the shape; one compiled function per
  problem key. The first call of a key compiles (minutes); Inductor falls back to its ATen GEMM
  where no CK instance serves the shape. Each key gets a code object of its own, because Dynamo
  keeps compiled variants per code object and stops recompiling one after
  ``torch._dynamo.config.recompile_limit`` shapes (it would then run the GEMM uncompiled).

Refused: other platforms, GPUs other than gfx942/gfx950, fp32, an output dtype other than the
input's. Not run on AMD hardware (docs/rocm.md).
"""
from __future__ import annotations

import functools
import importlib.util
import types
from typing import Callable, Hashable

import torch

from turbo_dispatch.adapter import Adapter

from ..blaslt import rocm
from ..blaslt.gemm import _blas_switch, run_with_preferred_blas

KERNEL_REVISION = "1"
_HALF = (torch.bfloat16, torch.float16)
_INDUCTOR_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "CK"}


def ck4inductor_reason() -> str | None:
    """Why Inductor's CK GEMM template cannot be used here (None: ck4inductor is importable)."""
    try:
        found = importlib.util.find_spec("ck4inductor") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "ck4inductor (Composable Kernel's package for Inductor) is not installed"


def _blas_ck_reason() -> str | None:
    """Why torch does not keep CK as its preferred BLAS library here (None: it does)."""
    switch = _blas_switch()
    if switch is None or not hasattr(switch[2], "Ck"):
        return f"this torch ({torch.__version__}) has no CK member in its preferred-BLAS-library switch"
    got = run_with_preferred_blas("ck", switch[0])
    if got != switch[2].Ck:
        return f"torch kept {got} when CK was asked for as the preferred BLAS library (no CK GEMMs in this build or GPU)"
    return None


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@functools.lru_cache(maxsize=None)
def _inductor_mm(key: Hashable) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The matmul compiled for one problem key, through a code object of its own (module docstring)."""
    code = _matmul.__code__.replace(co_name=f"ck_matmul_{abs(hash(key)):x}")
    fn = types.FunctionType(code, _matmul.__globals__, code.co_name)
    return torch.compile(fn, dynamic=False, fullgraph=True, options=dict(_INDUCTOR_OPTIONS))


class CkGemm(Adapter):
    """bf16/fp16 GEMM on Composable Kernel: torch's CK BLAS path, or Inductor's CK template."""

    library = "ck"

    def available(self) -> str | None:
        return rocm.rocm_unavailable() or _blas_ck_reason()

    def version(self) -> str:
        return f"hip-{torch.version.hip or 'none'}"

    def identity(self, config: Hashable = None) -> str:
        suffix = "" if config is None else f"/{config}"
        return f"ck-{self.version()}:torch-{torch.__version__}:{type(self).__name__}:rev{KERNEL_REVISION}{suffix}"

    def supports(self, p) -> str | None:
        if p.platform != "rocm":
            return f"CK runs on AMD GPUs under ROCm (platform is {p.platform})"
        reason = rocm.arch_reason("torch's CK GEMMs")
        if reason is not None:
            return reason
        if p.a_dtype not in _HALF or p.b_dtype != p.a_dtype:
            return f"CK GEMM adapter serves bf16/fp16 operands of one dtype (got {p.a_dtype}, {p.b_dtype})"
        if p.out_dtype != p.a_dtype:
            return f"CK GEMM adapter writes the input dtype (got {p.out_dtype})"
        return None

    def configs(self, p) -> list[str]:
        return ["blas"] + ([] if ck4inductor_reason() else ["inductor"])

    def describe(self, p) -> str:
        extra = "" if ck4inductor_reason() else "; config 'inductor': Inductor's CK GEMM template (max_autotune)"
        return f"torch.matmul with torch's preferred BLAS library set to CK for the call{extra}"

    def run(self, p, a, b, config=None):
        lhs = a.t() if p.trans_a else a
        rhs = b.t() if p.trans_b else b
        if config in (None, "blas"):
            return run_with_preferred_blas("ck", lambda: torch.matmul(lhs, rhs))
        if config == "inductor":
            reason = ck4inductor_reason()
            if reason is not None:
                raise RuntimeError(f"{type(self).__name__}: config 'inductor': {reason}")
            return _inductor_mm(p)(lhs, rhs)
        raise ValueError(f"{type(self).__name__}: unknown config {config!r}; valid: blas, inductor")
