"""Which platform (cuda, rocm, cpu) a tensor's device belongs to."""
from __future__ import annotations

import functools

import torch

PLATFORMS = ("cuda", "rocm", "cpu")


@functools.lru_cache(maxsize=None)
def platform_of(device_type: str) -> str:
    """Maps a torch device type to a registry platform name.

    ROCm builds of torch report their GPUs as device type "cuda"; ``torch.version.hip`` tells them
    apart, which is why this is not a plain identity.
    """
    if device_type == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if device_type == "cpu":
        return "cpu"
    return device_type


def vendor_blaslt(platform: str) -> str | None:
    """The vendor BLAS-Lt backend of a platform (what the BLASLT alias stands for)."""
    return {"cuda": "CUBLASLT", "rocm": "HIPBLASLT"}.get(platform)


def default_platform() -> str:
    """The platform new tensors land on by default: the GPU when one is present."""
    return platform_of("cuda") if torch.cuda.is_available() else "cpu"
