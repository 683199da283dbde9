"""What this torch's CPU kernels can do, for tests that exercise torch's own CPU paths (they differ
between the torch 2.11 of the GPU image and the newer CPU build of CI)."""
from __future__ import annotations

import functools

import torch

from turbo_dispatch.low_precision import ScalingGranularity


@functools.lru_cache(maxsize=None)
def cpu_scaled_mm_takes(granularity: ScalingGranularity) -> bool:
    """Whether ``torch._scaled_mm`` runs on CPU tensors with ``granularity``'s scales (tensorwise
    or rowwise). torch 2.11's CPU path takes per-tensor scales only: rowwise ones trip an internal
    assert in its oneDNN path."""
    x = torch.ones(16, 16).to(torch.float8_e4m3fn)
    rows, cols = ((), ()) if granularity is ScalingGranularity.TENSORWISE else ((16, 1), (1, 16))
    try:
        torch._scaled_mm(x, x.t(), torch.ones(rows), torch.ones(cols), out_dtype=torch.bfloat16)
        return True
    except Exception:
        return False
