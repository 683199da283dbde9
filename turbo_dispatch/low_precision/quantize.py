"""Float8 quantize / dequantize in plain torch ops.

All functions are free of host syncs (no ``.item()``, no data-dependent Python
control flow), so they trace under ``torch.compile(fullgraph=True)`` and can be
captured in CUDA graphs. Shapes only depend on the input shape and block size.

Scales follow the *dequant* convention: ``x ≈ data.float() * scale`` with the
scale broadcast over its block. Zero blocks get scale 1 (never 0/NaN/inf).

Non-finite inputs: a NaN or ±inf anywhere in a scaling group (tensor, row or
block) makes that group's scale non-finite, and the whole group dequantizes to
NaN. This is deliberate: silently clamping would hide overflow upstream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import MX_BLOCK_SIZE, Float8QuantConfig, ScalingGranularity, ScalingRecipe, _coerce_enum, recipe_block_2d

__all__ = ["FP8_MAX", "QuantizedTensor", "quantize", "dequantize", "quantize_with_config", "quantize_fp8",
           "dequantize_fp8", "float8_e4m3", "float8_e5m2"]

FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: The float8 dtypes by their format names: always the OCP encodings, the only ones quantised here.
float8_e4m3 = torch.float8_e4m3fn
float8_e5m2 = torch.float8_e5m2


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """An fp8 tensor plus the float32 dequant scale(s) needed to recover it.

    ``eq=False`` keeps identity equality/hash: field-wise ``==`` on tensors is
    elementwise and would make ``==``/``hash`` ambiguous.

    Scale shapes (input ``x`` of shape ``S``, reduction axis ``a``):

    * TENSORWISE: ``[]``
    * ROWWISE: ``S`` with ``S[a] = 1``
    * BLOCKWISE / MX_BLOCKWISE (1-D blocks): ``S`` with ``S[a] = ceil(S[a] / block_size)``
    * BLOCKWISE with ``block_2d``: ``(*S[:-2], ceil(S[-2]/bs), ceil(S[-1]/bs))``

    ``orig_dtype`` is the dtype the data was quantised from (``quantize`` records it; float32
    where a maker does not know it): ``dequantize()``'s default and what ``dtype`` reports.
    ``qdata``/``scale_inv``/``quantized_axis``/``real_dtype``/``scaling_recipe`` name the same
    facts the way code written against Primus-Turbo reads them (``scale_inv`` is the dequant
    scale, i.e. ``scale`` here).

    >>> q = quantize(torch.randn(4, 100), torch.float8_e4m3fn, "blockwise", block_size=64)
    >>> q.data.dtype, tuple(q.scale.shape), dequantize(q).shape
    (torch.float8_e4m3fn, (4, 2), torch.Size([4, 100]))
    >>> q = QuantizedTensor.quantize(torch.randn(4, 64, dtype=torch.bfloat16), float8_e4m3, "rowwise")
    >>> q.dtype, q.real_dtype, tuple(q.scale_inv.shape), q.dequantize().dtype
    (torch.bfloat16, torch.float8_e4m3fn, (4, 1), torch.bfloat16)
    """

    data: torch.Tensor
    scale: torch.Tensor
    granularity: ScalingGranularity
    axis: int
    block_size: int | None
    block_2d: bool
    orig_dtype: torch.dtype = torch.float32

    @classmethod
    def quantize(cls, hp_tensor: torch.Tensor, dest_dtype: torch.dtype, granularity: ScalingGranularity | str, *,
                 axis: int | None = None, group_lens: torch.Tensor | None = None, block_size: int | None = None,
                 scaling_recipe: ScalingRecipe | None = None) -> "QuantizedTensor":
        """Quantise ``hp_tensor`` (the constructor a caller uses; ``quantize`` does the work).

        ``axis`` is the reduction axis (None: the last); ``scaling_recipe.use_2d_block`` asks for
        2-D tiles (BLOCKWISE). ``group_lens`` (int [G], for a 2-D token-major tensor split into
        groups) is checked but changes nothing: no scaling group here depends on group
        boundaries (a 1-D run along the tokens may straddle two groups and its one scale serves
        both, the layout the grouped GEMMs read), so the result equals the ungrouped one.
        """
        if group_lens is not None:
            if not isinstance(group_lens, torch.Tensor) or group_lens.dim() != 1 or group_lens.is_floating_point():
                raise ValueError("QuantizedTensor.quantize: group_lens must be a 1-D integer tensor [G]; got "
                                 f"{getattr(group_lens, 'shape', type(group_lens).__name__)}")
            if not isinstance(hp_tensor, torch.Tensor) or hp_tensor.dim() != 2:
                raise ValueError("QuantizedTensor.quantize: group_lens needs a 2-D token-major tensor [M_total, K]; "
                                 f"got shape {tuple(getattr(hp_tensor, 'shape', ()))}")
        return quantize(hp_tensor, dest_dtype, granularity, axis=-1 if axis is None else axis, block_size=block_size,
                        scaling_recipe=scaling_recipe)

    @property
    def qdata(self) -> torch.Tensor:
        """The fp8 data (``data``)."""
        return self.data

    @property
    def scale_inv(self) -> torch.Tensor:
        """The float32 dequant scale(s) (``scale``): ``x ≈ data * scale_inv``."""
        return self.scale

    @property
    def quantized_axis(self) -> int:
        """The reduction axis the scales run along (``axis``, non-negative)."""
        return self.axis

    @property
    def scaling_recipe(self) -> ScalingRecipe:
        return ScalingRecipe(use_2d_block=self.block_2d)

    @property
    def dtype(self) -> torch.dtype:
        """The high-precision dtype this stands for (``orig_dtype``); the fp8 one is ``real_dtype``."""
        return self.orig_dtype

    @property
    def real_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``dequantize(self, out_dtype)``; ``out_dtype`` defaults to ``orig_dtype``."""
        return dequantize(self, self.orig_dtype if out_dtype is None else out_dtype)

    def t(self) -> "QuantizedTensor":
        """The transposed view of a 2-D quantized tensor (no copy): data and scale transposed,
        the reduction axis flipped. Like ``Tensor.t()``, so GEMM code can write
        ``x.t() if trans else x`` for a high-precision or a quantized operand alike.

        >>> q = quantize(torch.randn(4, 64), torch.float8_e4m3fn, "blockwise", axis=1, block_size=32)
        >>> tuple(q.t().data.shape), tuple(q.t().scale.shape), q.t().axis
        ((64, 4), (2, 4), 0)
        """
        if self.data.dim() != 2:
            raise ValueError(f"QuantizedTensor.t: needs 2-D data; got shape {tuple(self.data.shape)}")
        scale = self.scale.t() if self.scale.dim() == 2 else self.scale
        return QuantizedTensor(data=self.data.t(), scale=scale, granularity=self.granularity, axis=1 - self.axis,
                               block_size=self.block_size, block_2d=self.block_2d, orig_dtype=self.orig_dtype)

    def scale_e8m0(self) -> torch.Tensor:
        """MX scales as ``torch.float8_e8m0fnu`` (exact: MX scales are powers of two)."""
        if self.granularity is not ScalingGranularity.MX_BLOCKWISE:
            raise ValueError(
                f"scale_e8m0: only MX_BLOCKWISE scales are powers of two; granularity is {self.granularity.name}"
            )
        e8m0 = getattr(torch, "float8_e8m0fnu", None)
        if e8m0 is None:
            raise RuntimeError(f"scale_e8m0: this torch ({torch.__version__}) has no float8_e8m0fnu dtype")
        return self.scale.to(e8m0)


def _fp_scale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Tight float32 scale ``amax / fp8_max``; 1 where ``amax == 0``.

    The clamp to the smallest normal float32 stops tiny-but-nonzero blocks from
    getting a 0 scale, which would turn their zeros into 0/0 = NaN.
    """
    scale = (amax / fp8_max).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _mx_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Power-of-two MX scale ``2 ** ceil(log2(amax / FP8_MAX))`` as float32.

    The OCP MX spec's example rule, ``2 ** (floor(log2(amax)) - emax_elem)``, maps a block's amax
    into ``[2**emax, 2**(emax+1))``, so for e4m3 every value in (448, 512) saturates; on random
    data that clipping cost ~2 dB of SNR in our tests. Rounding the exponent up instead (the
    choice NVIDIA's MXFP8 recipe makes) never clips and keeps the same E8M0 format: the block max
    lands in (FP8_MAX/2, FP8_MAX]. ``ceil(log2)`` is read from the float32 bits (exponent, plus one
    if any mantissa bit is set), so the scale is an exact power of two on every backend. The
    exponent is clamped to the E8M0 range [-127, 127].
    """
    ratio = (amax / FP8_MAX[dtype]).clamp_min(torch.finfo(torch.float32).tiny)
    bits = ratio.view(torch.int32)
    ceil_log2 = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    exp = ceil_log2.clamp(-127, 127)
    # Normal float32 powers of two for exp >= -126; 2**-127 is the subnormal 1 << 22.
    scale_bits = torch.where(exp >= -126, (exp + 127) << 23, torch.full_like(exp, 1 << 22))
    scale = scale_bits.view(torch.float32)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    # Keep inf/NaN so a non-finite block dequantizes to NaN (see module docstring).
    return torch.where(torch.isfinite(amax), scale, amax)


def _check_block_size(block_size: object, granularity: ScalingGranularity) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(
            f"quantize: granularity={granularity.name} needs block_size (a positive int, e.g. 128); got {block_size!r}"
        )
    return block_size


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: ScalingGranularity | str,
    *,
    axis: int = -1,
    block_size: int | None = None,
    block_2d: bool = False,
    scaling_recipe: ScalingRecipe | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` to float8 ``dtype`` with scales at the given granularity.

    ``axis`` is the reduction (K) axis: rows and 1-D blocks run along it.
    ``block_2d`` (BLOCKWISE only) uses square ``block_size x block_size`` tiles
    over the last two dims instead, the usual layout for weights; a
    ``scaling_recipe`` with ``use_2d_block`` asks for the same. Partial edge
    blocks are fine (handled by zero-padding, which cannot change an amax).
    All math is in float32; values are saturated to ``±FP8_MAX[dtype]`` before
    the cast.

    MX_BLOCKWISE (block_size must be 32 or None) uses power-of-two (E8M0)
    scales, rounded up so that ``amax / scale`` lies in ``(FP8_MAX/2, FP8_MAX]``
    and nothing clips (see ``_mx_scale``).

    >>> x = torch.randn(8, 130)
    >>> q = quantize(x, torch.float8_e4m3fn, ScalingGranularity.ROWWISE, axis=1)
    >>> tuple(q.scale.shape), q.axis
    ((8, 1), 1)
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"quantize: x must be a floating-point tensor; got {got}")
    if x.dim() < 1:
        raise ValueError("quantize: x must have at least 1 dimension; got a 0-d tensor")
    if dtype not in FP8_MAX:
        raise ValueError(
            f"quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2 (OCP float8); got {dtype}"
        )
    gran = _coerce_enum(ScalingGranularity, granularity, "granularity", "quantize")
    block_2d = recipe_block_2d(scaling_recipe, block_2d, "quantize")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"quantize: axis must be in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-D x; got {axis}")
    axis = axis % x.dim()

    if gran is ScalingGranularity.BLOCKWISE:
        block_size = _check_block_size(block_size, gran)
    elif gran is ScalingGranularity.MX_BLOCKWISE:
        if block_size is None:
            block_size = MX_BLOCK_SIZE
        if block_size != MX_BLOCK_SIZE:
            raise ValueError(f"quantize: granularity=MX_BLOCKWISE needs block_size={MX_BLOCK_SIZE}; got {block_size!r}")
    elif block_size is not None:
        raise ValueError(f"quantize: granularity={gran.name} takes no block_size (expected None); got {block_size!r}")
    if block_2d:
        if gran is not ScalingGranularity.BLOCKWISE:
            raise ValueError(f"quantize: block_2d=True is only supported with BLOCKWISE; got granularity={gran.name}")
        if x.dim() < 2:
            raise ValueError(f"quantize: block_2d=True needs x with at least 2 dims; got {x.dim()}-D")

    fp8_max = FP8_MAX[dtype]
    orig_dtype = x.dtype
    # Memory: no float32 copy of x is kept. amax is exact in x's own dtype, and dividing x by a
    # float32 scale of at least one dimension computes in float32 (type promotion), so each step
    # holds one float32 temporary at most; this quantizer runs inside training steps (the TORCH
    # backends), where a few full-size float32 copies would lift the step's peak memory.

    if x.dtype == torch.float64:
        x = x.float()  # the quotient below computes in float32, as documented, not in float64

    def amax(v: torch.Tensor, dim=None) -> torch.Tensor:
        a = v.abs()
        return (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()

    def cast(q: torch.Tensor) -> torch.Tensor:
        return q.clamp_(-fp8_max, fp8_max).to(dtype)  # q is a fresh quotient: clamping in place is safe

    if gran is ScalingGranularity.TENSORWISE:
        scale = _fp_scale(amax(x), fp8_max)
        data = cast(x / scale.reshape([1] * x.dim()))  # a 0-d scale would not promote bf16 to float32
    elif gran is ScalingGranularity.ROWWISE:
        scale = _fp_scale(amax(x, axis), fp8_max)
        data = cast(x / scale)
    elif block_2d:
        assert block_size is not None
        *lead, rows, cols = x.shape
        nr, nc = math.ceil(rows / block_size), math.ceil(cols / block_size)
        padded = F.pad(x, (0, nc * block_size - cols, 0, nr * block_size - rows))
        tiles = padded.reshape(*lead, nr, block_size, nc, block_size)
        scale = _fp_scale(amax(tiles, (-3, -1)), fp8_max)
        data = cast(tiles / scale).reshape(*lead, nr * block_size, nc * block_size)[..., :rows, :cols]
        scale = scale.reshape(*lead, nr, nc)
    else:
        assert block_size is not None
        moved = x.movedim(axis, -1)
        k = moved.shape[-1]
        nb = math.ceil(k / block_size)
        blocks = F.pad(moved, (0, nb * block_size - k)).reshape(*moved.shape[:-1], nb, block_size)
        block_amax = amax(blocks, -1)
        if gran is ScalingGranularity.MX_BLOCKWISE:
            scale = _mx_scale(block_amax, dtype)
        else:
            scale = _fp_scale(block_amax, fp8_max)
        data = cast(blocks / scale).reshape(*moved.shape[:-1], nb * block_size)[..., :k].movedim(-1, axis)
        scale = scale.squeeze(-1).movedim(-1, axis)

    return QuantizedTensor(
        data=data.contiguous(),
        scale=scale.contiguous(),
        granularity=gran,
        axis=axis,
        block_size=block_size,
        block_2d=block_2d,
        orig_dtype=orig_dtype,
    )


def _expand_scale(q: QuantizedTensor) -> torch.Tensor:
    """Scale broadcastable to ``q.data.shape`` (blocks repeated, edge blocks sliced)."""
    shape = q.data.shape
    if q.granularity in (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE):
        return q.scale  # already broadcastable (0-d or keepdim)
    bs = q.block_size
    assert bs is not None
    if q.block_2d:
        *lead, nr, nc = q.scale.shape
        full = q.scale[..., :, None, :, None].expand(*lead, nr, bs, nc, bs).reshape(*lead, nr * bs, nc * bs)
        return full[..., : shape[-2], : shape[-1]]
    moved = q.scale.movedim(q.axis, -1)
    nb = moved.shape[-1]
    full = moved.unsqueeze(-1).expand(*moved.shape, bs).reshape(*moved.shape[:-1], nb * bs)
    return full[..., : shape[q.axis]].movedim(-1, q.axis)


def dequantize(q: QuantizedTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Recover ``x ≈ q.data.float() * scale`` (computed in float32), cast to ``out_dtype``.

    >>> x = torch.randn(3, 65, 130)
    >>> q = quantize(x, torch.float8_e4m3fn, "blockwise", block_size=32, block_2d=True)
    >>> dequantize(q, torch.bfloat16).shape
    torch.Size([3, 65, 130])
    """
    if not out_dtype.is_floating_point or out_dtype in FP8_MAX:
        raise ValueError(f"dequantize: out_dtype must be a non-fp8 floating dtype; got {out_dtype}")
    return (q.data.float() * _expand_scale(q)).to(out_dtype)


def quantize_with_config(
    x: torch.Tensor,
    config: Float8QuantConfig,
    *,
    axis: int = -1,
    block_2d: bool = False,
    grad: bool = False,
    scaling_recipe: ScalingRecipe | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` per ``config``; ``grad=True`` selects the gradient dtype (``config.format.bwd_dtype()``).

    >>> cfg = Float8QuantConfig("hybrid", "rowwise")
    >>> quantize_with_config(torch.randn(4, 8), cfg, grad=True).data.dtype
    torch.float8_e5m2
    """
    if not isinstance(config, Float8QuantConfig):
        raise ValueError(f"quantize_with_config: config must be a Float8QuantConfig; got {type(config).__name__}")
    dtype = config.format.bwd_dtype() if grad else config.format.fwd_dtype()
    return quantize(x, dtype, config.granularity, axis=axis, block_size=config.block_size, block_2d=block_2d,
                    scaling_recipe=scaling_recipe)


def quantize_fp8(x: torch.Tensor, out_dtype: torch.dtype, granularity: ScalingGranularity | str, *,
                 block_size: int | None = None, axis: int | None = None,
                 scaling_recipe: ScalingRecipe | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize`` returning ``(data, scale_inv)`` instead of a QuantizedTensor (``axis`` None:
    the last), for code that keeps the two tensors apart.

    >>> data, scale_inv = quantize_fp8(torch.randn(4, 64), float8_e4m3, "rowwise", axis=-1)
    >>> data.dtype, tuple(scale_inv.shape)
    (torch.float8_e4m3fn, (4, 1))
    """
    q = quantize(x, out_dtype, granularity, axis=-1 if axis is None else axis, block_size=block_size,
                 scaling_recipe=scaling_recipe)
    return q.data, q.scale


def dequantize_fp8(x: torch.Tensor, out_dtype: torch.dtype, granularity: ScalingGranularity | str, *,
                   block_size: int | None = None, axis: int | None = None, scale_inv: torch.Tensor,
                   scaling_recipe: ScalingRecipe | None = None) -> torch.Tensor:
    """The inverse of ``quantize_fp8``: ``x * scale_inv`` broadcast over the scaling groups that
    ``granularity``, ``block_size``, ``axis`` (None: the last) and ``scaling_recipe`` describe."""
    gran = _coerce_enum(ScalingGranularity, granularity, "granularity", "dequantize_fp8")
    if not isinstance(x, torch.Tensor) or x.dtype not in FP8_MAX:
        raise ValueError(f"dequantize_fp8: x must be a float8 tensor; got {getattr(x, 'dtype', type(x).__name__)}")
    axis = -1 if axis is None else axis
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"dequantize_fp8: axis must be in [{-x.dim()}, {x.dim() - 1}] for a {x.dim()}-D x; got {axis}")
    if gran is ScalingGranularity.MX_BLOCKWISE and block_size is None:
        block_size = MX_BLOCK_SIZE
    q = QuantizedTensor(data=x, scale=scale_inv, granularity=gran, axis=axis % x.dim(), block_size=block_size,
                        block_2d=recipe_block_2d(scaling_recipe, False, "dequantize_fp8"))
    return dequantize(q, out_dtype)
