"""Attention sinks (GPT-OSS): the ``sink`` argument's checks and its gradient.

A sink is one learnable logit per query head, in the units of the scaled scores. It joins every
query row's softmax denominator and contributes no value:
``out_i = sum_j exp(s_ij - lse_i) v_j`` with ``lse_i = log(exp(sink[h]) + sum_j exp(s_ij))``.
So the returned lse includes the sink, a row that may attend no key outputs 0 with lse
``sink[h]``, and the gradients of q, k and v follow from that lse exactly as without a sink.
"""
from __future__ import annotations

from typing import Optional

import torch

#: The dtypes a sink may have; kernels read it in float32 and its gradient comes back in its dtype.
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_sink(op: str, sink: Optional[torch.Tensor], heads_q: int, device: torch.device) -> bool:
    """Whether the call has a sink: False for None, True for a valid one; raises naming the
    problem otherwise (a 1-D float tensor of ``heads_q`` logits on q's device)."""
    if sink is None:
        return False
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"{op}: sink must be a torch.Tensor of {heads_q} float logits (one per query head) or None; "
                        f"got {type(sink).__name__}")
    if sink.dim() != 1 or sink.shape[0] != heads_q:
        raise ValueError(f"{op}: sink must have shape [heads_q] = [{heads_q}] (one logit per query head); "
                         f"got {list(sink.shape)}")
    if sink.dtype not in SINK_DTYPES:
        raise TypeError(f"{op}: sink.dtype must be one of float32, bfloat16, float16; got {sink.dtype}")
    if sink.device != device:
        raise ValueError(f"{op}: sink must be on q's device {device}; got {sink.device}")
    return True


def sink_grad(sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The loss's gradient with respect to ``sink`` ``[Hq]``, in the sink's dtype.

    ``lse`` is the forward's (sink included) and ``delta = rowsum(dO * O)`` the backward's, both
    float32 in the lse's layout (``[B, Hq, Sq]`` dense or ``[Hq, Tq]`` varlen). Each row's sink
    probability is ``exp(sink - lse)`` and moving the sink scales that row's output by
    ``-exp(sink - lse)``, so ``dsink[h] = -sum_rows exp(sink[h] - lse) * delta``. Rows with an
    lse of -inf (packed tokens outside every sequence) contribute nothing.
    """
    heads = sink.shape[0]
    lse = lse.reshape(-1, heads, lse.shape[-1])
    delta = delta.reshape(lse.shape)
    share = torch.exp(sink.float()[:, None] - lse)
    terms = torch.where(torch.isneginf(lse), 0.0, share * delta)
    return (-terms.sum((0, 2))).to(sink.dtype)
