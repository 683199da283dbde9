"""The storage-level copies behind SYMM_MEM's replayed graphs (CPU tensors; the graphs themselves
run in the GPU checks: benchmarks/probes/moe_gpu_check.py --backend SYMM_MEM)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from turbo_dispatch.backends.symm_mem import graphs
from turbo_dispatch.backends.symm_mem.graphs import GraphedCalls, copy_storages, fresh_copies


def test_fresh_copies_keep_views_of_one_buffer_together_in_new_memory():
    base = torch.randn(40)
    a, b = base[3:13].view(2, 5), base[20:31]
    other = torch.arange(7)
    ca, cb, cnone, cother = fresh_copies([a, b, None, other])
    assert cnone is None
    assert torch.equal(ca, a) and torch.equal(cb, b) and torch.equal(cother, other)
    assert ca.untyped_storage().data_ptr() == cb.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert (ca.storage_offset(), ca.stride(), cb.storage_offset()) == (3, (5, 1), 20)
    base.add_(1)  # the copies do not follow the original
    assert not torch.equal(ca, a)


def test_copy_storages_refills_static_copies_and_refuses_another_size():
    base = torch.randn(16)
    static = fresh_copies([base[:4], base[8:]])
    new = torch.randn(16)
    copy_storages(static, [new[:4], new[8:]])
    assert torch.equal(static[0], new[:4]) and torch.equal(static[1], new[8:])
    with pytest.raises(ValueError, match="captured"):
        copy_storages(static, [torch.randn(17)[:4], torch.randn(17)[8:]])


class _Recorder(GraphedCalls):
    """GraphedCalls whose capture records the key and whose graph's replay does nothing (its
    outputs are the captured call's), so the policy runs on a CPU."""

    def __init__(self, **limits):
        super().__init__(SimpleNamespace(device=torch.device("cpu"), half_bytes=1))
        for name, value in limits.items():
            setattr(self, name, value)
        self.captured: list = []
        self.eager: list = []

    def _capture(self, key, call, inputs, layout_inputs, flatten):
        self.captured.append(key)
        result = call(*inputs, *layout_inputs)
        self.eager.pop()  # capturing records, it does not run the call
        return graphs._Captured(SimpleNamespace(replay=lambda: None), [t.clone() for t in inputs], [],
                                (result, flatten(result)))


def _run(calls: _Recorder, key, x):
    def call(t):
        calls.eager.append(key)
        return t * 2

    return calls.run(key, call, (x,), (), lambda out: [out], lambda _, tensors: tensors[0])


def test_a_shape_is_captured_on_its_third_call_then_replayed():
    calls = _Recorder()
    x = torch.arange(4.0)
    outs = [_run(calls, "a", x) for _ in range(5)]
    assert calls.eager == ["a", "a"] and calls.captured == ["a"]
    assert all(torch.equal(o, x * 2) for o in outs)
    assert outs[3].data_ptr() != outs[4].data_ptr()  # every replay hands out its own copy


def test_evicted_shapes_and_shapes_past_the_capture_budget_run_eagerly():
    calls = _Recorder(limit=1)
    x = torch.ones(2)
    for key in ("a", "b"):
        for _ in range(3):
            _run(calls, key, x)
    assert calls.captured == ["a", "b"]  # b's graph pushed a's out
    calls.eager.clear()
    for _ in range(4):
        _run(calls, "a", x)
    assert calls.eager == ["a"] * 4 and calls.captured == ["a", "b"]
    budget = _Recorder(max_captures=1)
    for key in ("a", "b"):
        for _ in range(4):
            _run(budget, key, x)
    assert budget.captured == ["a"] and budget.eager.count("b") == 4


def test_an_arena_that_moved_drops_its_graphs():
    calls = _Recorder()
    x = torch.ones(3)
    for _ in range(3):
        _run(calls, "a", x)
    calls.arena.half_bytes = 2
    calls.eager.clear()
    for _ in range(3):
        _run(calls, "a", x)
    assert calls.eager == ["a", "a"] and calls.captured == ["a", "a"]
