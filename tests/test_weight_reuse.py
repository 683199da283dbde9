"""``low_precision.reuse_quantized_weights``: a weight's blockwise fp8 tiles made once for several
micro-batches, with the same bits as quantising it every time, and never reused for a changed,
different or freed weight."""
from __future__ import annotations

import gc

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch.low_precision import Float8QuantConfig, reuse_quantized_weights
from turbo_dispatch.low_precision import weight_reuse

LENS = [70, 0, 130, 57]
K, N = 96, 160
CFG = Float8QuantConfig(granularity="blockwise", block_size=32)


def _weight(device, seed=1):
    torch.manual_seed(seed)
    return (torch.randn(len(LENS), N, K, device=device, dtype=torch.bfloat16) * 0.3).requires_grad_()


def _micro_batch(w, device, seed, cfg=CFG):
    """One micro-batch's step on ``w``: (output, x.grad); w.grad accumulates."""
    torch.manual_seed(100 + seed)
    x = torch.randn(sum(LENS), K, device=device, dtype=torch.bfloat16).requires_grad_()
    grad = torch.randn(sum(LENS), N, device=device, dtype=torch.bfloat16)
    lens = torch.tensor(LENS, device=device)
    out = turbo.ops.grouped_gemm_fp8(x, w, lens, trans_b=True, config=cfg)
    out.backward(grad)
    return out.detach(), x.grad


def _accumulate(device, reuse, steps=3, update_after=None):
    w = _weight(device)
    outs = []
    scope = None

    def run():
        for i in range(steps):
            outs.append(_micro_batch(w, device, i))
            if update_after == i:
                with torch.no_grad():
                    w.mul_(1.5)  # an in-place update of the weight itself bumps its version

    if reuse:
        with reuse_quantized_weights() as scope:
            run()
    else:
        run()
    return outs, w.grad, scope


def test_reused_tiles_give_the_same_bits(device):
    """Three micro-batches on one weight: the tiles are made once (one miss, two hits), and every
    output, activation gradient and the accumulated weight gradient equal quantising each time."""
    fresh, fresh_wgrad, _ = _accumulate(device, reuse=False)
    kept, kept_wgrad, scope = _accumulate(device, reuse=True)
    assert (scope.hits, scope.misses) == (2, 1)
    for (o1, g1), (o2, g2) in zip(fresh, kept, strict=True):
        assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert torch.equal(fresh_wgrad, kept_wgrad)


def test_an_updated_weight_is_quantised_again(device):
    """An in-place update inside the block (the weight's version moves) makes the next call
    quantise afresh: its results equal the no-reuse run's with the same update."""
    fresh, fresh_wgrad, _ = _accumulate(device, reuse=False, update_after=0)
    kept, kept_wgrad, scope = _accumulate(device, reuse=True, update_after=0)
    assert (scope.hits, scope.misses) == (1, 2)
    for (o1, g1), (o2, g2) in zip(fresh, kept, strict=True):
        assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert torch.equal(fresh_wgrad, kept_wgrad)


def test_each_weight_keeps_its_own_tiles_and_a_freed_one_drops_them():
    w1, w2 = _weight("cpu", 1), _weight("cpu", 2)
    with reuse_quantized_weights() as scope:
        o1 = _micro_batch(w1, "cpu", 0)[0]
        o2 = _micro_batch(w2, "cpu", 0)[0]
        assert not torch.equal(o1, o2)
        assert torch.equal(_micro_batch(w1, "cpu", 0)[0], o1)
        assert torch.equal(_micro_batch(w2, "cpu", 0)[0], o2)
        assert (scope.hits, scope.misses) == (2, 2)
        assert len(scope._entries) == 2
        del w2
        gc.collect()
        assert len(scope._entries) == 1
    assert len(scope._entries) == 0  # the block's end lets the tiles go


def test_no_reuse_outside_a_block_or_for_other_recipes():
    w = _weight("cpu")
    _micro_batch(w, "cpu", 0)
    assert weight_reuse.active_scope() is None
    with reuse_quantized_weights() as scope:
        rowwise = Float8QuantConfig(granularity="rowwise")
        _micro_batch(w, "cpu", 0, rowwise)
        _micro_batch(w, "cpu", 1, rowwise)
        assert (scope.hits, scope.misses) == (0, 0)  # rowwise quantises per GEMM, not per step
        with reuse_quantized_weights() as inner:
            _micro_batch(w, "cpu", 0)
            _micro_batch(w, "cpu", 1)
        assert (inner.hits, inner.misses) == (1, 1) and (scope.hits, scope.misses) == (0, 0)
    assert weight_reuse.active_scope() is None


def test_not_reused_while_traced():
    """Fake tensors (as torch.compile and AOT autograd trace with) are never kept."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with reuse_quantized_weights() as scope:
        with FakeTensorMode() as mode:
            w = mode.from_tensor(_weight("cpu"))
            assert weight_reuse.lookup(w, torch.float8_e4m3fn, 32) is None
            weight_reuse.keep(w, torch.float8_e4m3fn, 32, ("tiles", "tiles_t"))
    assert (scope.hits, scope.misses, len(scope._entries)) == (0, 0, 0)


def test_compiled_step_ignores_the_block():
    """Under torch.compile the step's custom ops quantise per call; the block does not change
    the compiled results."""
    w = _weight("cpu")
    x = torch.randn(sum(LENS), K, dtype=torch.bfloat16)
    lens = torch.tensor(LENS)

    def f(x, w):
        return turbo.ops.grouped_gemm_fp8(x, w, lens, trans_b=True, config=CFG)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    want = f(x, w.detach())
    with reuse_quantized_weights() as scope:
        got = [compiled(x, w) for _ in range(2)]
    assert all(torch.equal(g.detach(), want) for g in got)
    assert scope.hits == 0
