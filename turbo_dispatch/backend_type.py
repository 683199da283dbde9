"""Backend and precision names, and parsing of user-supplied names."""
from __future__ import annotations

import enum
from typing import Union


class BackendType(str, enum.Enum):
    """The backend families turbo_dispatch knows by name.

    Plugin backends are addressed by their registry name (a plain string) wherever a
    ``BackendType`` is accepted.

    Example:
        >>> from turbo_dispatch import BackendType
        >>> BackendType.parse("native") is BackendType.TORCH
        True
    """

    TORCH = "TORCH"
    TRITON = "TRITON"
    CUBLASLT = "CUBLASLT"
    HIPBLASLT = "HIPBLASLT"
    CUDNN = "CUDNN"
    CK = "CK"
    AITER = "AITER"
    DEEP_EP = "DEEP_EP"
    #: "this platform's vendor BLAS-Lt": CUBLASLT on CUDA, HIPBLASLT on ROCm.
    BLASLT = "BLASLT"
    #: Not a backend: asks the resolver to autotune this op (or precision).
    AUTOTUNE = "AUTOTUNE"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: "BackendLike") -> "BackendType | str":
        """Normalises a user-given name: enum members and known names (any case) become
        members; anything else is returned upper-cased as a plugin backend name."""
        if isinstance(name, BackendType):
            return name
        if not isinstance(name, str) or not name.strip():
            raise TypeError(f"backend must be a BackendType or a non-empty str, got {name!r}")
        key = name.strip().upper().replace("-", "_")
        key = _ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            return key


_ALIASES = {"NATIVE": "TORCH", "PYTORCH": "TORCH", "DEEPEP": "DEEP_EP"}

BackendLike = Union[BackendType, str]


def backend_name(backend: "BackendType | str") -> str:
    """The registry name of a backend: the enum's value or the plugin's upper-cased name."""
    return backend.value if isinstance(backend, BackendType) else backend


class PrecisionType(str, enum.Enum):
    """Precision classes a per-precision backend setting can target.

    Example:
        >>> from turbo_dispatch import PrecisionType
        >>> PrecisionType.parse("BF16") is PrecisionType.BF16
        True
    """

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "PrecisionType | str") -> "PrecisionType":
        if isinstance(value, PrecisionType):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            valid = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown precision {value!r}; valid precisions: {valid}") from None
