"""Backend and precision names, and parsing of user-supplied names."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union


class _TextEnum(str, enum.Enum):
    """A str enum that prints as its value (``str(BackendType.TORCH) == "TORCH"``)."""

    def __str__(self) -> str:
        return self.value


class BackendType(_TextEnum):
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
    #: MoE dispatch/combine through torch's symmetric memory and our Triton kernels.
    SYMM_MEM = "SYMM_MEM"
    #: "this platform's vendor BLAS-Lt": CUBLASLT on CUDA, HIPBLASLT on ROCm.
    BLASLT = "BLASLT"
    #: Not a backend: asks the resolver to autotune this op (or precision).
    AUTOTUNE = "AUTOTUNE"

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


class PrecisionType(_TextEnum):
    """Precision classes a per-precision backend setting can target.

    ``BF16_FP16_FP32`` names the three high precisions at once: a setting for it is a setting
    for each of them. ``FP4`` exists so that code naming it fails with the reason, not an
    unknown name: there are no FP4 ops here, so an FP4 setting could never apply, and every
    setter, getter and the env grammar refuse it (``setting_keys``).

    Example:
        >>> from turbo_dispatch import PrecisionType
        >>> PrecisionType.parse("BF16") is PrecisionType.BF16
        True
        >>> PrecisionType.BF16_FP16_FP32.setting_keys()
        ('bf16', 'fp16', 'fp32')
    """

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8 = "fp8"
    BF16_FP16_FP32 = "bf16_fp16_fp32"
    FP4 = "fp4"

    def setting_keys(self) -> tuple[str, ...]:
        """The precision classes a setting for this precision stands for (ValueError for FP4)."""
        if self is PrecisionType.FP4:
            raise ValueError(FP4_REFUSED)
        if self is PrecisionType.BF16_FP16_FP32:
            return (PrecisionType.BF16.value, PrecisionType.FP16.value, PrecisionType.FP32.value)
        return (self.value,)

    @classmethod
    def parse(cls, value: "PrecisionType | str") -> "PrecisionType":
        if isinstance(value, PrecisionType):
            return value
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            valid = ", ".join(settable_precisions())
            raise ValueError(f"unknown precision {value!r}; valid precisions: {valid}") from None


FP4_REFUSED = ("precision FP4 cannot be set: turbo_dispatch has no FP4 ops (no FP4 GEMM or grouped GEMM), "
               "so an FP4 backend setting would never apply")


def settable_precisions() -> list[str]:
    """The precision names a backend setting accepts (FP4 is named but refused)."""
    return [p.value for p in PrecisionType if p is not PrecisionType.FP4]


@dataclass(frozen=True)
class BackendChoice:
    """A backend setting as ``GlobalBackendManager.get_*_backend`` reports it: a pinned
    ``backend``, or ``auto_tune=True`` (backend None). ``source`` says which layer set it
    ("code" or "env"); it takes no part in equality, so a choice compares by what it selects.

    Example:
        >>> from turbo_dispatch import BackendType
        >>> BackendChoice(BackendType.TORCH) == BackendChoice(BackendType.TORCH, source="env")
        True
        >>> BackendChoice(auto_tune=True)
        BackendChoice(backend=None, auto_tune=True)
    """

    backend: "BackendType | str | None" = None
    auto_tune: bool = False
    source: str = field(default="", compare=False, repr=False)

    @classmethod
    def from_setting(cls, value: "BackendType | str | None", source: str) -> "BackendChoice | None":
        """The choice a stored setting stands for: None when unset, AUTOTUNE as ``auto_tune=True``."""
        if value is None:
            return None
        if value == BackendType.AUTOTUNE:
            return cls(None, True, source)
        return cls(value, False, source)
