"""What the autotuner runs for one attention candidate: a training call, forward and backward.

Attention backends differ more in their backward than in their forward (a forward within 2% can
come with a backward 10% apart), and the library serves training steps, so a candidate is judged on
the step a training call makes. Only the forward's output is returned, for the correctness gate.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch


def run_training_call(adapter: Any, problem: Any, inputs: Sequence[Any], config: Any) -> torch.Tensor:
    """Runs ``adapter``'s forward on ``inputs`` (q, k, v, then cu_seqlens_q, cu_seqlens_k for varlen,
    then the sink for calls with one) and, where autograd can run, its backward with the output as
    the incoming gradient; returns the output.

    Inputs made under ``torch.inference_mode`` cannot carry gradients: then only the forward runs.
    """
    q, k, v, *rest = inputs
    cu_q, cu_k = rest[:2] if problem.varlen else (None, None)
    sink = {"sink": rest[-1]} if problem.sink else {}
    if q.is_inference():
        return adapter.forward(problem, q, k, v, cu_q, cu_k, config=config, **sink)[0]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        if getattr(adapter, "native_autograd", False):
            out = adapter.forward(problem, q, k, v, cu_q, cu_k, config=config, **sink)[0]
            torch.autograd.grad(out, (q, k, v), out.detach())
        else:
            out, _, saved = adapter.forward(problem, q, k, v, cu_q, cu_k, config=config, **sink)
            adapter.backward(problem, saved, out.detach(), config=config)
    return out.detach()
