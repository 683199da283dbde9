"""ROCm facts shared by the ROCm adapters (HIPBLASLT, CK, AITER), and hipBLASLt's own fp8 limits.

* ``rocm_unavailable()``: why this process cannot run a ROCm GPU backend (a CPU or CUDA build of
  torch, or no GPU visible), None when it can.
* ``gfx_arch()``: the current GPU's architecture (``gcnArchName`` without its feature suffix, so
  ``"gfx942:sramecc+:xnack-"`` reads ``"gfx942"``).
* ``MI300_ARCHS``: the Instinct MI300 / MI350 families (CDNA3 gfx942, CDNA4 gfx950), the
  architectures the AITER and CK adapters target.
* ``rowwise_scaled_mm_reason()``: torch runs rowwise-scaled ``torch._scaled_mm`` on ROCm through
  hipBLASLt's per-row scale mode, which hipBLASLt implements for MI300 and newer only.

Every function reads the device through ``torch.cuda`` (a ROCm build reports its GPUs as
``cuda`` devices), and the adapters call them through this module's namespace, so a test can
stand in for a ROCm machine by replacing them here.

None of this has run on AMD hardware yet (docs/rocm.md).
"""
from __future__ import annotations

import functools

import torch

#: CDNA3 (MI300X/MI300A/MI325X) and CDNA4 (MI350X/MI355X).
MI300_ARCHS = ("gfx942", "gfx950")
#: Architectures whose fp8 matrix instructions take the OCP encodings (float8_e4m3fn / e5m2); gfx942
#: takes the FNUZ ones (float8_e4m3fnuz / e5m2fnuz).
OCP_FP8_ARCHS = ("gfx950",)


def is_rocm_build() -> bool:
    """Whether this torch was built for ROCm (HIP)."""
    return bool(getattr(torch.version, "hip", None))


def rocm_unavailable() -> str | None:
    """None on a ROCm build of torch with a GPU visible, else why a ROCm backend cannot run."""
    if not is_rocm_build():
        kind = f"a CUDA build (CUDA {torch.version.cuda})" if torch.version.cuda else "a CPU-only build"
        return f"needs a ROCm build of torch; this is {kind} of torch {torch.__version__}"
    if not torch.cuda.is_available():
        return "no AMD GPU is visible to torch (torch.cuda.is_available() is False)"
    return None


@functools.lru_cache(maxsize=None)
def _arch_of(device_index: int) -> str:
    name = getattr(torch.cuda.get_device_properties(device_index), "gcnArchName", "") or "unknown"
    return name.split(":")[0]


def gfx_arch() -> str:
    """The current GPU's gfx architecture, e.g. ``"gfx942"`` (call only where rocm_unavailable()
    is None)."""
    return _arch_of(torch.cuda.current_device())


def arch_reason(what: str, archs: tuple[str, ...] = MI300_ARCHS) -> str | None:
    """None when the current GPU is one of ``archs``, else why ``what`` does not run on it."""
    arch = gfx_arch()
    if arch in archs:
        return None
    return f"{what} targets {'/'.join(archs)} (MI300 / MI350); this GPU is {arch}"


def rowwise_scaled_mm_reason() -> str | None:
    """Why torch._scaled_mm cannot take per-row scales on this ROCm GPU (None: it can)."""
    return arch_reason("rowwise torch._scaled_mm (hipBLASLt's per-row scale mode)")
