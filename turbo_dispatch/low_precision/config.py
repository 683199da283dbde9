"""Float8 quantization recipe description: formats, scaling granularities, config.

Everything here is plain Python (no tensors are created), so configs are cheap
to build, validate eagerly, and can be used as dictionary keys.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

__all__ = ["Format", "ScalingGranularity", "ScaleDtype", "ScalingRecipe", "Float8QuantConfig"]

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


class ScalingRecipe(NamedTuple):
    """How a quantiser lays out its scaling groups, beyond the granularity.

    ``use_2d_block`` asks for square ``block_size x block_size`` tiles over the last two dims
    (BLOCKWISE weights), the same as ``quantize(..., block_2d=True)``. The other flags name
    MXFP4 techniques (stochastic rounding, a random Hadamard transform, shuffled layouts) that
    this library does not implement, since it has no FP4 path; ``check`` refuses them by name
    rather than quantising without them. A NamedTuple, so it is hashable and compares by value.

    >>> ScalingRecipe(use_2d_block=True).check("quantize")
    >>> ScalingRecipe(use_sr=True).check("quantize")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: quantize: ScalingRecipe(use_sr=True) is not supported: stochastic rounding, ...
    """

    use_2d_block: bool = False
    use_sr: bool = False
    use_rht: bool = False
    shuffle_scale: bool = False
    shuffle_out: bool = False

    def check(self, where: str) -> None:
        """Raise ``ValueError`` naming the first flag set that this library does not implement."""
        for flag in ("use_sr", "use_rht", "shuffle_scale", "shuffle_out"):
            if getattr(self, flag):
                raise ValueError(f"{where}: ScalingRecipe({flag}=True) is not supported: {_FP4_ONLY[flag]}")


_FP4_ONLY = {
    "use_sr": "stochastic rounding, an MXFP4 technique, and turbo_dispatch has no FP4 path",
    "use_rht": "the random Hadamard transform, an MXFP4 technique, and turbo_dispatch has no FP4 path",
    "shuffle_scale": "shuffled scale layouts feed AMD MXFP4 kernels only",
    "shuffle_out": "shuffled data layouts feed AMD MXFP4 kernels only",
}


def recipe_block_2d(recipe: "ScalingRecipe | None", block_2d: bool, where: str) -> bool:
    """``block_2d`` merged with a recipe's ``use_2d_block`` (either asks for 2-D tiles), after
    refusing the recipe flags this library does not implement."""
    if recipe is None:
        return block_2d
    if not isinstance(recipe, ScalingRecipe):
        raise TypeError(f"{where}: scaling_recipe must be a ScalingRecipe or None; got {type(recipe).__name__}")
    recipe.check(where)
    return block_2d or recipe.use_2d_block


# MX (OCP Microscaling v1.0) fixes the block size at 32 elements.
MX_BLOCK_SIZE = 32
#: BLOCKWISE block sizes a config may name: powers of two, so a block is a whole number of kernel
#: tiles, and bounded so that a typo cannot ask for a block larger than any real reduction axis's
#: useful scale granularity (the fused GPU kernels serve 32, 64 and 128; TORCH serves them all).
BLOCKWISE_BLOCK_SIZES = tuple(2 ** i for i in range(4, 10))


@dataclass(frozen=True)
class Float8QuantConfig:
    """A validated, hashable float8 quantization recipe.

    Enum fields also accept their case-insensitive string name/value. Rules:

    * ``BLOCKWISE`` needs a ``block_size`` that is a power of two from 16 to 512
      (``BLOCKWISE_BLOCK_SIZES``; 128 is the usual choice, matching DeepSeek-style
      1x128 activation / 128x128 weight blocks).
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
            if bs not in BLOCKWISE_BLOCK_SIZES:
                valid = ", ".join(map(str, BLOCKWISE_BLOCK_SIZES))
                raise ValueError(
                    f"{where}: granularity=BLOCKWISE needs block_size, a power of two (one of {valid}, "
                    f"e.g. 128); got {bs!r}"
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

    def replace(self, **changes: object) -> "Float8QuantConfig":
        """A validated copy with ``changes`` applied (``dataclasses.replace``): the way to derive a
        changed config, since a config is frozen.

        >>> Float8QuantConfig().replace(granularity="rowwise").tag()
        'e4m3/rowwise/fp32'
        """
        return dataclasses.replace(self, **changes)


def _refuse_assignment(self: Float8QuantConfig, name: str, value: object = None) -> None:
    """Frozen: a config is hashed into decision and kernel caches, so changing one in place would
    leave them keyed by a recipe it no longer has. The error names the way to a changed copy."""
    raise dataclasses.FrozenInstanceError(
        f"cannot change {name!r}: Float8QuantConfig is frozen (hashable, it keys caches); derive a changed "
        f"copy with cfg.replace({name}=...) or dataclasses.replace(cfg, {name}=...)"
    )


# Set after @dataclass(frozen=True), which refuses a class that defines its own __setattr__; the
# class stays a frozen dataclass to every tool that checks (torch.compile treats those as constants).
Float8QuantConfig.__setattr__ = _refuse_assignment  # type: ignore[method-assign,assignment]
Float8QuantConfig.__delattr__ = _refuse_assignment  # type: ignore[method-assign,assignment]
