"""pytest plugin (round 96 bisect only): row scales contiguous again (no 16-float row padding)."""
import torch
import turbo_dispatch.backends.quantizer as Q
import turbo_dispatch.backends.triton.dual_quantize as DQ

_orig = Q.empty_padded_rows


def _pad_fp8_only(like, shape, dtype, pad=16):
    return _orig(like, shape, dtype, 1 if dtype == torch.float32 else pad)


DQ.empty_padded_rows = _pad_fp8_only
_orig_padded = Q.padded_rows
Q.padded_rows = lambda t: t.contiguous() if t.dtype == torch.float32 else _orig_padded(t)
