"""Float8 quantization recipe description: formats, scaling granularities, config.

Everything here is plain Python (no tensors are created), so configs are cheap
to build, validate eagerly, and can be used as dictionary keys.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = ["Format", "ScalingGranularity", "ScaleDtype", "Float8QuantConfig"]

_E = TypeVar("_E", bound=enum.Enum)


def _coerce_enum(cls: type[_E], value: object, arg: str, where: str) -> _E:
    """Return ``value`` as a member of ``cls``.

    Accepts the member itself or a case-insensitive string matching a member's
    name or value (so ``"e4m3"``, ``"E4M3"`` and ``Format.E4M3`` are all fine);
    anything else raises ``ValueError`` listing the valid choices.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for member in cls:
            if key in (member.name.lower(), str(member.value).lower()):
                return member
    valid = ", ".join(member.name for member in cls)
    raise ValueError(f"{where}: {arg} must be a {cls.__name__} (one of {valid}, or its name as a string); got {value!r}")


class Format(enum.Enum):
    """Which OCP float8 encodings to use.

    ``HYBRID`` is the common training recipe: E4M3 (more mantissa) for forward
    activations/weights and E5M2 (more range) for gradients, whose magnitudes
    vary much more.  Only the OCP dtypes are returned, never the ``*fnuz`` ones.

    >>> Format("hybrid").fwd_dtype(), Format.HYBRID.bwd_dtype()
    (torch.float8_e4m3fn, torch.float8_e5m2)
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"

    def fwd_dtype(self) -> torch.dtype:
        """Dtype for forward-pass operands (activations and weights)."""
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    def bwd_dtype(self) -> torch.dtype:
        """Dtype for gradients."""
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


class ScalingGranularity(enum.Enum):
    """How many elements share one scale.

    * ``TENSORWISE``: one scale for the whole tensor.
    * ``ROWWISE``: one scale per row (per slice along the reduction axis).
    * ``BLOCKWISE``: one scale per ``block_size`` run along the reduction axis
      (or per ``block_size x block_size`` tile for weights).
    * ``MX_BLOCKWISE``: OCP Microscaling, 32-element blocks with power-of-two
      (E8M0) scales.

    >>> ScalingGranularity("rowwise") is ScalingGranularity.ROWWISE
    True
    """

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"
    MX_BLOCKWISE = "mx_blockwise"


class ScaleDtype(enum.Enum):
    """Storage dtype of the scales: float32, or E8M0 (pure power-of-two exponent, MX only).

    >>> ScaleDtype.E8M0.value
    'e8m0'
    """

    FP32 = "fp32"
    E8M0 = "e8m0"


# MX (OCP Microscaling v1.0) fixes the block size at 32 elements.
MX_BLOCK_SIZE = 32


@dataclass(frozen=True)
class Float8QuantConfig:
    """A validated, hashable float8 quantization recipe.

    Enum fields also accept their case-insensitive string name/value. Rules:

    * ``BLOCKWISE`` needs a positive ``block_size`` (128 is the usual choice,
      matching DeepSeek-style 1x128 activation / 128x128 weight blocks).
    * ``MX_BLOCKWISE`` needs ``block_size == 32`` (``None`` defaults to 32) and
      ``scale_dtype=E8M0``; E8M0 scales are only valid for MX.
    * ``TENSORWISE`` / ``ROWWISE`` must leave ``block_size`` as ``None``.

    >>> cfg = Float8QuantConfig(format="hybrid", granularity="blockwise", block_size=128)
    >>> cfg.tag(), cfg.format.bwd_dtype()
    ('hybrid/blockwise128/fp32', torch.float8_e5m2)
    >>> Float8QuantConfig(granularity="mx_blockwise", scale_dtype="e8m0").block_size
    32
    >>> {cfg: "usable as a dict key"}[cfg]
    'usable as a dict key'
    """

    format: Format = Format.E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    scale_dtype: ScaleDtype = ScaleDtype.FP32
    block_size: int | None = None

    def __post_init__(self) -> None:
        where = type(self).__name__
        # Frozen dataclass: normalisation has to go through object.__setattr__.
        object.__setattr__(self, "format", _coerce_enum(Format, self.format, "format", where))
        gran = _coerce_enum(ScalingGranularity, self.granularity, "granularity", where)
        object.__setattr__(self, "granularity", gran)
        sdt = _coerce_enum(ScaleDtype, self.scale_dtype, "scale_dtype", where)
        object.__setattr__(self, "scale_dtype", sdt)

        bs = self.block_size
        if gran is ScalingGranularity.MX_BLOCKWISE and bs is None:
            bs = MX_BLOCK_SIZE
            object.__setattr__(self, "block_size", bs)
        if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int)):
            raise ValueError(f"{where}: block_size must be an int or None; got {bs!r}")

        if gran is ScalingGranularity.BLOCKWISE:
            if bs is None or bs <= 0:
                raise ValueError(
                    f"{where}: granularity=BLOCKWISE needs block_size (a positive int, e.g. 128); got {bs!r}"
                )
        elif gran is ScalingGranularity.MX_BLOCKWISE:
            if bs != MX_BLOCK_SIZE:
                raise ValueError(
                    f"{where}: granularity=MX_BLOCKWISE needs block_size={MX_BLOCK_SIZE} (fixed by the MX spec); got {bs!r}"
                )
            if sdt is not ScaleDtype.E8M0:
                raise ValueError(f"{where}: granularity=MX_BLOCKWISE needs scale_dtype=E8M0; got {sdt.name}")
        else:
            if bs is not None:
                raise ValueError(f"{where}: granularity={gran.name} takes no block_size (expected None); got {bs!r}")
        if sdt is ScaleDtype.E8M0 and gran is not ScalingGranularity.MX_BLOCKWISE:
            raise ValueError(f"{where}: scale_dtype=E8M0 is only valid with granularity=MX_BLOCKWISE; got {gran.name}")

    def tag(self) -> str:
        """Short human-readable key, e.g. ``"e4m3/blockwise128/fp32"``."""
        gran = self.granularity.value + (str(self.block_size) if self.block_size is not None else "")
        return f"{self.format.value}/{gran}/{self.scale_dtype.value}"
