"""The storage-level copies behind SYMM_MEM's replayed graphs (CPU tensors; the graphs themselves
run in the GPU checks: benchmarks/probes/moe_gpu_check.py --backend SYMM_MEM)."""
from __future__ import annotations

import pytest
import torch

from turbo_dispatch.backends.symm_mem.graphs import copy_storages, fresh_copies


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
