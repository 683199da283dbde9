"""Zero-size and absurd inputs: the defined result where the math has one, otherwise an error that
names the argument. CPU tensors, so every check runs here."""
from __future__ import annotations

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch.low_precision import Float8QuantConfig

RECIPES = [Float8QuantConfig(), Float8QuantConfig(granularity="rowwise"),
           Float8QuantConfig(format="hybrid", granularity="blockwise", block_size=128)]


@pytest.mark.parametrize("cfg", RECIPES, ids=lambda c: c.tag())
@pytest.mark.parametrize("m, n, k", [(0, 8, 16), (4, 0, 16), (4, 8, 0)])
def test_gemm_fp8_zero_size(cfg, m, n, k):
    a = torch.randn(m, k, requires_grad=True)
    b = torch.randn(n, k, requires_grad=True)
    c = turbo.ops.gemm_fp8(a, b, trans_b=True, config=cfg, out_dtype=torch.float32)
    assert c.shape == (m, n) and c.dtype == torch.float32 and not c.any()
    (c.sum() + 0.0).backward()
    assert a.grad.shape == a.shape and not a.grad.any()
    assert b.grad.shape == b.shape and not b.grad.any()


@pytest.mark.parametrize("cfg", RECIPES, ids=lambda c: c.tag())
@pytest.mark.parametrize("m_total, n, k", [(0, 8, 16), (5, 8, 0), (5, 0, 16)])
def test_grouped_gemm_fp8_zero_size(cfg, m_total, n, k):
    a = torch.randn(m_total, k, requires_grad=True)
    w = torch.randn(3, n, k, requires_grad=True)
    out = turbo.ops.grouped_gemm_fp8(a, w, torch.tensor([m_total, 0, 0]), config=cfg)
    assert out.shape == (m_total, n) and not out.any()
    out.sum().backward()
    assert w.grad.shape == w.shape and not w.grad.any()
    assert a.grad.shape == a.shape and not a.grad.any()


@pytest.mark.parametrize("block_size", [7, 10**6, 1024, 0, -128])
def test_absurd_block_size_is_refused_when_the_config_is_built(block_size):
    with pytest.raises(ValueError, match="block_size"):
        Float8QuantConfig(granularity="blockwise", block_size=block_size)


CU_OK = [0, 3, 8]


@pytest.mark.parametrize("cu_q, max_q, message", [
    ([0, 3, 9], 6, "cu_seqlens_q must end at the token count 8; got 9"),   # overruns the tokens
    ([0, 3, 7], 5, "cu_seqlens_q must end at the token count 8; got 7"),   # falls short of them
    ([0, 5, 3], 5, "cu_seqlens_q must not decrease"),
    ([2, 3, 8], 5, "cu_seqlens_q must start at 0"),
    ([0, 3, 8], 4, "max_seqlen_q=4 is smaller than sequence 1's length 5"),
])
def test_varlen_values_are_checked_on_cpu(cu_q, max_q, message):
    q = k = v = torch.randn(8, 2, 16)
    cu_k = torch.tensor(CU_OK, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        turbo.ops.flash_attn_varlen_func(q, k, v, torch.tensor(cu_q, dtype=torch.int32), cu_k, max_q, 5)


def test_varlen_k_side_is_checked_too():
    q = k = v = torch.randn(8, 2, 16)
    cu = torch.tensor(CU_OK, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_k=3"):
        turbo.ops.flash_attn_varlen_func(q, k, v, cu, cu, 5, 3)


def test_varlen_with_valid_values_and_an_empty_sequence_runs():
    q = k = v = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    out = turbo.ops.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    assert out.shape == (8, 2, 16) and torch.isfinite(out).all()
