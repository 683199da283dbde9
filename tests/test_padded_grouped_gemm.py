"""Padded grouped inputs: ``M_total > sum(group_lens)`` (a padded MoE receive buffer).

The contract, on every backend: rows past the last group belong to no group, so the forward (and
the dgrad, itself a fixed-K grouped GEMM) writes zeros there, the padding rows of ``a`` get exactly
zero gradients, and the weight gradient sums the groups' tokens only. The padding holds finite
garbage here (not zeros), so a backend that reads it into a result, or leaves the output rows
unwritten, fails.

The TORCH backends run here on the CPU; the TRITON kernels and adapters run under the Triton
interpreter in a subprocess (this file as a script, ``TRITON_INTERPRET=1`` set before triton is
imported), as tests/test_triton_grouped_gemm.py runs them.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager
from turbo_dispatch.low_precision import Float8QuantConfig

_HERE = os.path.abspath(__file__)
_ROUTINGS = ([3, 0, 4], [0, 5, 0, 2], [1])
_RECIPES = (("tensorwise", None), ("rowwise", None), ("blockwise", 16))


def _lens(lens_l, device="cpu"):
    lens = torch.tensor(lens_l, dtype=torch.int64, device=device)
    return lens, torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0))


def _reference(a, b, lens_l, trans_b):
    """float64 per-group forward of the groups' rows only, and the zero tail appended."""
    a64, b64 = a.double(), b.double()
    outs, start = [], 0
    for i, n in enumerate(lens_l):
        outs.append(a64[start:start + n] @ (b64[i].t() if trans_b else b64[i]))
        start += n
    width = b.shape[1] if trans_b else b.shape[2]
    return torch.cat(outs + [a64.new_zeros((a.shape[0] - start, width))])


def _reference_grads(a, b, grad, lens_l, trans_b):
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    _reference(a64, b64, lens_l, trans_b).backward(grad.double())
    return a64.grad, b64.grad


def _snr(out, ref) -> float:
    ref = ref.double()
    err = (out.double() - ref).norm() ** 2
    return (10 * torch.log10(ref.norm() ** 2 / err.clamp_min(1e-300))).item()


def _rel(out, ref) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _operands(lens_l, pad, k, n, trans_b, dtype, device="cpu"):
    m = sum(lens_l) + pad
    a = (torch.randn(m, k, device=device) * 2).to(dtype).requires_grad_()
    b = torch.randn((len(lens_l), n, k) if trans_b else (len(lens_l), k, n), device=device).to(dtype).requires_grad_()
    return a, b


def _check_padded(out, ref, a_grad, ref_a_grad, b_grad, ref_b_grad, real, gate):
    """Tail rows exactly zero (output and a's gradient); the rest within ``gate`` (rel or SNR)."""
    assert torch.equal(out[real:], torch.zeros_like(out[real:])), "output rows past the groups must be zeros"
    assert torch.equal(a_grad[real:], torch.zeros_like(a_grad[real:])), "padding rows must get zero gradients"
    if real:
        gate(out[:real], ref[:real])
        gate(a_grad[:real], ref_a_grad[:real])
    gate(b_grad, ref_b_grad)


def _rel_gate(tol):
    def gate(x, ref):
        assert _rel(x, ref) < tol, _rel(x, ref)
    return gate


def _snr_gate(db):
    def gate(x, ref):
        if ref.abs().max() > 0:
            assert _snr(x, ref) > db, _snr(x, ref)
        else:
            assert torch.equal(x.double(), ref)
    return gate


@pytest.fixture(autouse=True)
def _reset():
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


@pytest.mark.parametrize("lens_l", _ROUTINGS)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_padded_torch(lens_l, trans_b, dtype):
    a, b = _operands(lens_l, 5, 24, 16, trans_b, dtype)
    lens, offs = _lens(lens_l)
    for group_offs in (None, offs):
        a.grad = b.grad = None
        out = turbo.ops.grouped_gemm(a, b, lens, group_offs, trans_b)
        grad = torch.randn_like(out)  # the upstream gradient of the padding rows is not zero either
        out.backward(grad)
        ref = _reference(a, b, lens_l, trans_b)
        ref_a, ref_b = _reference_grads(a, b, grad, lens_l, trans_b)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        _check_padded(out, ref, a.grad, ref_a, b.grad, ref_b, sum(lens_l), _rel_gate(tol))


@pytest.mark.parametrize("gran, block", _RECIPES)
@pytest.mark.parametrize("trans_b", [True, False])
def test_grouped_gemm_fp8_padded_torch(gran, block, trans_b):
    lens_l = [20, 0, 13]
    a, b = _operands(lens_l, 7, 32, 48, trans_b, torch.bfloat16)
    lens, _ = _lens(lens_l)
    cfg = Float8QuantConfig(granularity=gran, block_size=block)
    out = turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=trans_b, config=cfg)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref = _reference(a, b, lens_l, trans_b)
    ref_a, ref_b = _reference_grads(a, b, grad, lens_l, trans_b)
    _check_padded(out, ref, a.grad, ref_a, b.grad, ref_b, sum(lens_l), _snr_gate(20))


def test_padded_blockwise_training_step_and_compile():
    """The BLOCKWISE step (each operand quantised once for both GEMMs that read it) and the
    compiled custom ops keep the contract too."""
    lens_l = [9, 0, 16]
    lens, offs = _lens(lens_l)
    cfg = Float8QuantConfig(granularity="blockwise", block_size=16)
    a, b = _operands(lens_l, 6, 32, 32, True, torch.bfloat16)
    step = torch.compile(lambda x, y: turbo.ops.grouped_gemm_fp8(x, y, lens, offs, config=cfg), fullgraph=True)
    plain = torch.compile(lambda x, y: turbo.ops.grouped_gemm(x, y, lens, offs, True), fullgraph=True)
    for fn, gate in ((lambda x, y: turbo.ops.grouped_gemm_fp8(x, y, lens, offs, config=cfg), _snr_gate(20)),
                     (step, _snr_gate(20)), (plain, _rel_gate(2e-2))):
        a.grad = b.grad = None
        out = fn(a, b)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref = _reference(a, b, lens_l, True)
        ref_a, ref_b = _reference_grads(a, b, grad, lens_l, True)
        _check_padded(out, ref, a.grad, ref_a, b.grad, ref_b, sum(lens_l), gate)


def test_more_tokens_than_rows_still_raises():
    a, b = _operands([3, 4], 0, 8, 8, False, torch.float32)
    with pytest.raises(ValueError, match="sum to at most M_total"):
        turbo.ops.grouped_gemm(a.detach()[:6], b, _lens([3, 4])[0])


# -- interpreter cases (run as a script under TRITON_INTERPRET=1) --------------------------------------------
def _case_kernels():
    """The persistent fixed-K kernel writes zeros past the last group (output poisoned with NaN
    first, so an unwritten row shows), for several program counts; so does the stand-alone
    tail kernel other kernels rely on; the variable-K kernel ignores the padding tokens."""
    from turbo_dispatch.backends.triton.grouped_gemm import launch_fixed_k, launch_variable_k, zero_padded_tail

    for lens_l in _ROUTINGS + ([0, 0],):
        lens, offs = _lens(lens_l)
        m = sum(lens_l) + 37
        a, b = torch.randn(m, 40), torch.randn(len(lens_l), 24, 40)
        ref = _reference(a, b, lens_l, True)
        for cfg in ((16, 16, 16, 2, 1, 4, 0), (32, 16, 16, 1, 1, 4, 0, 3)):
            out = torch.full((m, 24), float("nan"))
            launch_fixed_k(a, b, out, offs, cfg, upcast=1)
            assert _rel(out, ref) < 1e-5 and torch.equal(out[sum(lens_l):], torch.zeros_like(out[sum(lens_l):]))
        out = torch.full((m, 24), float("nan"))
        out[: sum(lens_l)] = 1.0
        zero_padded_tail(out, offs)
        assert torch.equal(out[: sum(lens_l)], torch.ones_like(out[: sum(lens_l)]))
        assert torch.equal(out[sum(lens_l):], torch.zeros_like(out[sum(lens_l):]))
        x, y = torch.randn(m, 20), torch.randn(m, 24)
        wgrad = launch_variable_k(x, y, torch.full((len(lens_l), 20, 24), float("nan")), offs,
                                  (16, 16, 16, 2, 1, 4, 0), upcast=1)
        start = 0
        for i, n in enumerate(lens_l):
            want = x[start:start + n].double().t() @ y[start:start + n].double()
            assert (wgrad[i].double() - want).abs().max() < 1e-4
            start += n


def _case_ops():
    """The full ops on the TRITON adapters, forward and backward, against float64. TRITON is
    registered for GPUs only, so every GEMM the ops resolve goes to its adapter directly."""
    import importlib
    from types import SimpleNamespace

    from turbo_dispatch.backends.triton.grouped_gemm import TritonGroupedGemm, TritonGroupedGemmFp8

    spec = importlib.import_module("turbo_dispatch.ops.grouped_gemm_spec")
    adapters = {spec.GROUPED_GEMM: TritonGroupedGemm(), spec.GROUPED_GEMM_FP8: TritonGroupedGemmFp8()}
    used = []

    def resolve(op, p):
        used.append(op.name)
        return SimpleNamespace(entry=SimpleNamespace(adapter=adapters[op]), config=None, provisional=False)

    spec.resolve = resolve
    lens_l = [11, 0, 20]
    lens, offs = _lens(lens_l)
    for trans_b in (False, True):
        a, b = _operands(lens_l, 9, 32, 32, trans_b, torch.bfloat16)
        out = turbo.ops.grouped_gemm(a, b, lens, offs, trans_b)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref_a, ref_b = _reference_grads(a, b, grad, lens_l, trans_b)
        _check_padded(out, _reference(a, b, lens_l, trans_b), a.grad, ref_a, b.grad, ref_b, sum(lens_l),
                      _rel_gate(2e-2))
        for gran, block in _RECIPES[:1] + (("blockwise", 32),):
            a.grad = b.grad = None
            cfg = Float8QuantConfig(granularity=gran, block_size=block)
            out = turbo.ops.grouped_gemm_fp8(a, b, lens, offs, trans_b, config=cfg)
            out.backward(grad)
            ref_a, ref_b = _reference_grads(a, b, grad, lens_l, trans_b)
            _check_padded(out, _reference(a, b, lens_l, trans_b), a.grad, ref_a, b.grad, ref_b, sum(lens_l),
                          _snr_gate(20))
    assert used.count("grouped_gemm") == 6 and used.count("grouped_gemm_fp8") == 12, used


_CASES = {"kernels": _case_kernels, "ops": _case_ops}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_interpreter(case, interpreter_refusal):
    """One case under the Triton interpreter, in a fresh process (see the module docstring)."""
    if interpreter_refusal:
        pytest.skip(interpreter_refusal)
    proc = subprocess.run([sys.executable, _HERE, case], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    tail = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0 and proc.stdout.strip().endswith(f"OK {case}"), tail


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_gpu_padded_every_backend(backend):
    """On the GPU: torch._grouped_mm / torch._scaled_grouped_mm (whose kernels leave the tail
    unwritten, so the adapter zeroes it on the device) and the Triton kernels, bf16 and fp8."""
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    lens_l = [200, 0, 136, 64]
    lens, offs = _lens(lens_l, "cuda")
    offs = offs.to(torch.int32)
    for trans_b in (False, True):
        a, b = _operands(lens_l, 96, 256, 128, trans_b, torch.bfloat16, "cuda")
        with torch.no_grad():
            for _ in range(2):  # the second call reuses an allocation that holds the first's values
                out = turbo.ops.grouped_gemm(a, b, lens, offs, trans_b)
        out = turbo.ops.grouped_gemm(a, b, lens, offs, trans_b)
        grad = torch.randn_like(out)
        out.backward(grad)
        ref_a, ref_b = _reference_grads(a.cpu(), b.cpu(), grad.cpu(), lens_l, trans_b)
        _check_padded(out.cpu(), _reference(a.cpu(), b.cpu(), lens_l, trans_b), a.grad.cpu(), ref_a, b.grad.cpu(),
                      ref_b, sum(lens_l), _rel_gate(2e-2))
        for gran, block in _RECIPES[:2] + (("blockwise", 128),):
            a.grad = b.grad = None
            cfg = Float8QuantConfig(granularity=gran, block_size=block)
            out = turbo.ops.grouped_gemm_fp8(a, b, lens, offs, trans_b, config=cfg)
            out.backward(grad)
            ref_a, ref_b = _reference_grads(a.cpu(), b.cpu(), grad.cpu(), lens_l, trans_b)
            _check_padded(out.cpu(), _reference(a.cpu(), b.cpu(), lens_l, trans_b), a.grad.cpu(), ref_a,
                          b.grad.cpu(), ref_b, sum(lens_l), _snr_gate(20))


if __name__ == "__main__":
    _CASES[sys.argv[1]]()
    print(f"OK {sys.argv[1]}")
