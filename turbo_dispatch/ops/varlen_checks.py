"""The value check of flash_attn_varlen_func's ``cu_seqlens`` and ``max_seqlen`` arguments.

Reading the prefix sums costs nothing on the CPU and one device-to-host read (a sync) on a GPU, so
on a GPU it runs only when PRIMUS_TURBO_VALIDATE_GROUP_LENS=1, the switch that already opts in to
the grouped GEMMs' ``group_lens`` check, and never while torch.compile traces or a CUDA graph is
captured. Kernels trust these values: a prefix sum past the token count reads out of bounds, and a
``max_seqlen`` below a real length silently drops keys.
"""
from __future__ import annotations

import torch

from .grouped_gemm_routing import value_check_skipped


def check_cu_seqlens_values(op: str, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int,
                            total_k: int, max_seqlen_q: int, max_seqlen_k: int) -> None:
    """Raises ValueError naming the argument unless each ``cu_seqlens_*`` starts at 0, never
    decreases, ends at its token count, and no sequence is longer than its ``max_seqlen_*``."""
    if value_check_skipped(cu_seqlens_q):
        return
    for name, cu, total, max_name, max_len in (("cu_seqlens_q", cu_seqlens_q, total_q, "max_seqlen_q", max_seqlen_q),
                                               ("cu_seqlens_k", cu_seqlens_k, total_k, "max_seqlen_k", max_seqlen_k)):
        values = cu.tolist()
        if values[0] != 0:
            raise ValueError(f"{op}: {name} must start at 0; got {values[0]}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        if min(lengths) < 0:
            at = min(range(len(lengths)), key=lengths.__getitem__)
            raise ValueError(f"{op}: {name} must not decrease; entry {at + 1} ({values[at + 1]}) is below entry "
                             f"{at} ({values[at]})")
        if values[-1] != total:
            raise ValueError(f"{op}: {name} must end at the token count {total}; got {values[-1]}")
        if max(lengths) > max_len:
            raise ValueError(f"{op}: {max_name}={max_len} is smaller than sequence {lengths.index(max(lengths))}'s "
                             f"length {max(lengths)}")
