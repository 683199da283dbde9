"""A grouped GEMM's routing arguments: group_lens (tokens per group) and group_offs (their
exclusive prefix sums).

Group lengths are data: problem keys never read them, so the host-side checks live with the
problem builders. What needs their values is here: ``check_group_lens_values`` (it reads device
memory), the offsets computed on the device, and the splits the autotuner times on.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..env import env_text_reader, parse_bool

_I64 = torch.int64
#: The dtypes group_offs may have.
OFFS_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1

#: Opt-in on GPUs: checking group_lens values there costs a device->host sync per call.
VALIDATE_ENV = "PRIMUS_TURBO_VALIDATE_GROUP_LENS"
#: Read on every GPU call of the grouped ops, so through the cheap reader.
_read_validate = env_text_reader(VALIDATE_ENV)


def value_check_skipped(x: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():
        return True
    if x.is_cpu:
        return False  # free on the CPU
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    return not parse_bool(_read_validate(), VALIDATE_ENV)


def check_group_lens_values(op: str, group_lens: torch.Tensor, group_offs: Optional[torch.Tensor],
                            total: int) -> None:
    """The validation slow path that reads tensor data: group_lens non-negative and summing to at
    most ``total`` (M_total, a.shape[0]; rows past the last group are padding); a given group_offs
    equal to ``[0, cumsum(group_lens)]``.

    It reads device memory: free on the CPU, one device->host read (a sync) on a GPU, so on a GPU
    it runs only when PRIMUS_TURBO_VALIDATE_GROUP_LENS=1 (a debugging aid; the fast path must not
    sync). It is skipped -- returns without reading anything -- while torch.compile traces (the
    values do not exist yet) and while a CUDA graph is being captured (a read would break the
    capture); there wrong lengths are the caller's responsibility (the per-group loop path still
    checks them for free from its own host copy; torch._grouped_mm cannot). Never part of the
    problem key.
    """
    if value_check_skipped(group_lens):
        return
    g = group_lens.shape[0]
    if g == 0:
        if total:
            raise ValueError(f"{op}: group_lens is empty (G=0) but a has M_total={total} rows")
        return
    parts = [group_lens.sum(), group_lens.min()]
    if group_offs is not None:
        bad = (group_offs[0] != 0) | (group_offs[1:] - group_offs[:-1] != group_lens).any()
        parts.append(bad.to(_I64))
    got, smallest, *bad_offs = torch.stack(parts).tolist()
    if smallest < 0:
        raise ValueError(f"{op}: group_lens must be non-negative; got a minimum of {smallest}")
    if got > total:
        raise ValueError(f"{op}: group_lens must sum to at most M_total = a.shape[0] = {total} (rows past the "
                         f"last group are padding); got sum {got}")
    if bad_offs and bad_offs[0]:
        raise ValueError(f"{op}: group_offs must be the exclusive prefix sums of group_lens, [0, cumsum(group_lens)]")


def offsets(group_lens: torch.Tensor, total: int) -> torch.Tensor:
    """group_offs from group_lens on the device: [0, cumsum(group_lens)], G + 1 entries.

    int32 whenever the ``total`` tokens fit: that is the dtype torch._grouped_mm takes, so the
    TORCH backend uses the offsets as they are instead of launching a conversion per GEMM (three
    per training step)."""
    dtype = torch.int32 if total <= _INT32_MAX else _I64
    return torch.nn.functional.pad(torch.cumsum(group_lens, 0, dtype=dtype), (1, 0))


def offsets_or(group_offs: Optional[torch.Tensor], group_lens: torch.Tensor, total: int) -> torch.Tensor:
    """``group_offs`` when given, else ``offsets(group_lens, total)``."""
    return offsets(group_lens, total) if group_offs is None else group_offs


def random_lens(total: int, g: int) -> torch.Tensor:
    """A random split of ``total`` tokens into ``g`` groups (some may be empty)."""
    if g == 0:
        return torch.zeros(0, dtype=_I64)
    cuts = torch.randint(0, total + 1, (g - 1,), dtype=_I64).sort().values
    return torch.diff(torch.cat([cuts.new_zeros(1), cuts, cuts.new_full((1,), total)]))


#: How far a group of ``near_balanced_lens`` may stray from an even share, either way.
TIMING_JITTER = 0.25


def near_balanced_lens(total: int, g: int) -> torch.Tensor:
    """``total`` tokens over ``g`` groups, each within ``TIMING_JITTER`` of an even share (before
    rounding): the routing a load-balanced MoE layer meets, which the tuner times on."""
    if g == 0:
        return torch.zeros(0, dtype=_I64)
    weights = 1.0 + TIMING_JITTER * (2.0 * torch.rand(g, dtype=torch.float64) - 1.0)
    lens = torch.floor(weights / weights.sum() * total).to(_I64)
    lens[: total - int(lens.sum())] += 1  # the rounding remainder, at most g - 1 tokens
    return lens
