"""What every AITER adapter shares: availability, the platform/arch check, version and identity."""
from __future__ import annotations

from typing import Hashable

import torch

from turbo_dispatch.adapter import Adapter

from ..blaslt import rocm
from . import library

#: Bumped whenever what an AITER adapter runs for a given config changes (invalidates tuning results).
KERNEL_REVISION = "1"
_HALF = (torch.bfloat16, torch.float16)


class AiterAdapter(Adapter):
    """Base of the AITER adapters; subclasses list the entry points they call in ``entry_points``
    as (module inside the aiter package, attribute) pairs."""

    library = "aiter"
    entry_points: tuple[tuple[str, str], ...] = ()

    def available(self) -> str | None:
        return rocm.rocm_unavailable() or library.missing(self.entry_points)

    def version(self) -> str:
        return library.version()

    def identity(self, config: Hashable = None) -> str:
        suffix = "" if config is None else f"/{config}"
        return (f"aiter-{self.version()}:torch-{torch.__version__}:{type(self).__name__}"
                f":rev{KERNEL_REVISION}{suffix}")

    @staticmethod
    def platform_reason(p) -> str | None:
        """Why ``p`` is not on a GPU AITER targets (None: it is)."""
        if p.platform != "rocm":
            return f"AITER runs on AMD GPUs under ROCm (platform is {p.platform})"
        return rocm.arch_reason("AITER")

    @staticmethod
    def half_reason(dtype: torch.dtype, what: str) -> str | None:
        if dtype not in _HALF:
            return f"{what} takes bf16/fp16 (got {dtype})"
        return None
