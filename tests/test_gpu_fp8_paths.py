"""On a GPU: the torch scaled_mm fast paths (not the emulation) are exercised and correct."""
import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch.low_precision import Float8QuantConfig, Format, ScalingGranularity as G
from turbo_dispatch.ops._common import snr_db

pytestmark = pytest.mark.gpu

RECIPES = {
    "tensorwise": dict(granularity=G.TENSORWISE),
    "rowwise": dict(granularity=G.ROWWISE),
    "blockwise": dict(granularity=G.BLOCKWISE, block_size=128),
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("m, n, k", [(1, 256, 384), (200, 384, 512), (256, 256, 256)])
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_fast_path_is_taken_and_correct(recipe, m, n, k, trans_a, trans_b, fmt):
    # The TORCH backend's paths: gemm_fp8's NVIDIA default is CUBLASLT since the fused quantisers
    # (the conftest resets the pin after each test).
    turbo.GlobalBackendManager.set_gemm_backend("TORCH", precision="fp8")
    cfg = Float8QuantConfig(format=fmt, **RECIPES[recipe])
    a = torch.randn((k, m) if trans_a else (m, k), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn((n, k) if trans_b else (k, n), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    decision = turbo.explain("gemm_fp8", a, b, trans_a=trans_a, trans_b=trans_b, config=cfg)
    fast = not (recipe == "blockwise" and m % 8)  # cuBLASLt has no blockwise kernel for M=1 here
    assert any(("torch scaled_mm" if fast else "emulation") in note for note in decision.notes), decision
    out = turbo.ops.gemm_fp8(a, b, trans_a=trans_a, trans_b=trans_b, config=cfg)
    grad = torch.randn_like(out)
    out.backward(grad)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = (a64.t() if trans_a else a64) @ (b64.t() if trans_b else b64)
    ref.backward(grad.double())
    gate_out = 25.0
    gate_grad = 25.0 if fmt is Format.E4M3 else 20.0
    assert snr_db(out, ref) >= gate_out
    assert snr_db(a.grad, a64.grad) >= gate_grad
    assert snr_db(b.grad, b64.grad) >= gate_grad
