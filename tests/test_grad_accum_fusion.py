"""``fuse_bgrad_accum_pattern="megatron"`` (the weight gradient added into ``weight.main_grad`` by
the backward) and ``num_cu`` (a cap on the grouped GEMMs' persistent programs).

The accumulation must equal, bit for bit, what the unfused Megatron step computes: the op's own
weight gradient added into the fp32 buffer, micro-batch after micro-batch. A float64 reference
bounds both. Eager and ``torch.compile(fullgraph=True)`` alike, every op, the fp8 recipes, and the
blockwise grouped step that quantises each operand once.
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager
from turbo_dispatch.low_precision import Float8QuantConfig, quantize

MICRO_BATCHES = 3
BLOCKWISE = Float8QuantConfig(granularity="blockwise", block_size=32)  # a block the grouped step reuses
RECIPES = {"tensorwise": Float8QuantConfig(), "rowwise": Float8QuantConfig(granularity="rowwise"),
           "blockwise": BLOCKWISE}


@pytest.fixture(autouse=True)
def _reset():
    GlobalBackendManager.reset()
    yield
    GlobalBackendManager.reset()


def _lens():
    return torch.tensor([20, 0, 12], dtype=torch.int64)


def _call(op: str, recipe: str | None, a, w, pattern):
    """One call of ``op`` as a Linear / an expert layer makes it: ``w`` the weight, trans_b."""
    cfg = None if recipe is None else RECIPES[recipe]
    if op == "gemm":
        return turbo.ops.gemm(a, w, trans_b=True, fuse_bgrad_accum_pattern=pattern)
    if op == "gemm_fp8":
        return turbo.ops.gemm_fp8(a, w, trans_b=True, config=cfg, fuse_bgrad_accum_pattern=pattern)
    if op == "grouped_gemm":
        return turbo.ops.grouped_gemm(a, w, _lens(), trans_b=True, fuse_bgrad_accum_pattern=pattern)
    return turbo.ops.grouped_gemm_fp8(a, w, _lens(), trans_b=True, config=cfg, fuse_bgrad_accum_pattern=pattern)


def _weight(op: str, dtype):
    shape = (3, 48, 64) if op.startswith("grouped") else (48, 64)
    w = torch.nn.Parameter(torch.randn(shape).to(dtype))
    w.main_grad = torch.randn(shape, dtype=torch.float32)  # pre-existing: earlier micro-batches' sum
    w.grad_added_to_main_grad = False
    return w


def _micro_batches(dtype):
    return [(torch.randn(32, 64).to(dtype), torch.randn(32, 48).to(dtype)) for _ in range(MICRO_BATCHES)]


CASES = [("gemm", None, torch.float32), ("gemm", None, torch.bfloat16), ("gemm_fp8", "tensorwise", torch.bfloat16),
         ("gemm_fp8", "rowwise", torch.bfloat16), ("gemm_fp8", "blockwise", torch.bfloat16),
         ("grouped_gemm", None, torch.float32), ("grouped_gemm", None, torch.bfloat16),
         ("grouped_gemm_fp8", "tensorwise", torch.bfloat16), ("grouped_gemm_fp8", "rowwise", torch.bfloat16),
         ("grouped_gemm_fp8", "blockwise", torch.bfloat16)]


def _run(op, recipe, w, batches, pattern, fn=None):
    """Runs the micro-batches; returns each input's gradient and each weight gradient autograd gave."""
    fn = fn or (lambda a, weight: _call(op, recipe, a, weight, pattern))
    a_grads, w_grads = [], []
    for x, grad in batches:
        a = x.clone().requires_grad_()
        w.grad = None
        fn(a, w).backward(grad)
        a_grads.append(a.grad)
        w_grads.append(w.grad)
    return a_grads, w_grads


@pytest.mark.parametrize("op, recipe, dtype", CASES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_main_grad_is_the_unfused_sum_bit_for_bit(op, recipe, dtype, compiled):
    torch.manual_seed(0)
    batches = _micro_batches(dtype)
    w = _weight(op, dtype)
    start = w.main_grad.clone()
    a_ref, w_ref = _run(op, recipe, w, batches, None)  # unfused: Megatron adds each w.grad into main_grad
    expected = start.clone()
    for g in w_ref:
        expected.add_(g)
    assert torch.equal(w.main_grad, start)  # the unfused run left the buffer alone

    fn = None
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(lambda a, weight: _call(op, recipe, a, weight, "megatron"), fullgraph=True)
    a_got, w_got = _run(op, recipe, w, batches, "megatron", fn)
    assert w.grad_added_to_main_grad is True
    assert torch.equal(w.main_grad, expected), (w.main_grad - expected).abs().max()
    for got, ref in zip(a_got, a_ref):
        assert torch.equal(got, ref)  # the input's gradient does not change
    for g in w_got:
        assert g.shape == w.shape and g.dtype == w.dtype and not g.any()  # the stand-in: zeros

    # Both bounded by float64: main_grad0 + sum of x^T g per group (per weight for gemm).
    want = start.double()
    for x, grad in batches:
        x64, g64 = x.double(), grad.double()
        if op.startswith("grouped"):
            s = 0
            for i, n in enumerate(_lens().tolist()):
                want[i] += g64[s:s + n].t() @ x64[s:s + n]
                s += n
        else:
            want += g64.t() @ x64
    rel = ((w.main_grad.double() - want).norm() / (want - start.double()).norm()).item()
    assert rel < (1e-5 if recipe is None and dtype == torch.float32 else 0.1), rel


def test_accumulates_only_when_the_weight_gets_a_gradient():
    w = _weight("gemm", torch.float32)
    start = w.main_grad.clone()
    with torch.no_grad():
        turbo.ops.gemm(torch.randn(4, 64), w, trans_b=True, fuse_bgrad_accum_pattern="megatron")
    assert w.grad_added_to_main_grad is False and torch.equal(w.main_grad, start)
    a = torch.randn(4, 64, requires_grad=True)
    frozen = w.detach()
    frozen.main_grad = w.main_grad
    turbo.ops.gemm(a, frozen, trans_b=True, fuse_bgrad_accum_pattern="megatron").sum().backward()
    assert torch.equal(w.main_grad, start) and a.grad is not None


@pytest.mark.parametrize("setup, message", [
    (lambda w: setattr(w, "main_grad", None), "needs weight.main_grad"),
    (lambda w: setattr(w, "main_grad", torch.zeros(3, 3)), "main_grad must be a floating tensor of the weight's shape"),
    (lambda w: setattr(w, "main_grad", torch.zeros(48, 64, dtype=torch.int32)), "floating tensor"),
])
def test_bad_main_grad_is_named(setup, message):
    w = _weight("gemm", torch.float32)
    setup(w)
    with pytest.raises(ValueError, match=message):
        turbo.ops.gemm(torch.randn(4, 64), w, trans_b=True, fuse_bgrad_accum_pattern="megatron")


def test_unknown_pattern_and_prequantised_weight_are_refused():
    w = _weight("gemm", torch.float32)
    with pytest.raises(ValueError, match="fuse_bgrad_accum_pattern must be None or one of \\('megatron',\\)"):
        turbo.ops.gemm(torch.randn(4, 64), w, trans_b=True, fuse_bgrad_accum_pattern="deepspeed")
    qw = quantize(w.detach(), torch.float8_e4m3fn, "tensorwise")
    with pytest.raises(ValueError, match="pre-quantised QuantizedTensor has no gradient"):
        turbo.ops.gemm_fp8(torch.randn(4, 64), qw, trans_b=True, fuse_bgrad_accum_pattern="megatron")


# -- num_cu -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_num_cu_must_be_a_positive_int(bad):
    a, w = torch.randn(32, 64), torch.randn(3, 48, 64)
    with pytest.raises(ValueError, match="num_cu must be None or a positive int"):
        turbo.ops.grouped_gemm(a, w, _lens(), trans_b=True, num_cu=bad)
    with pytest.raises(ValueError, match="num_cu must be None or a positive int"):
        turbo.ops.grouped_gemm_fp8(a, w, _lens(), num_cu=bad)


def test_num_cu_is_ignored_where_a_backend_has_no_knob():
    a, w = torch.randn(32, 64, requires_grad=True), torch.randn(3, 48, 64, requires_grad=True)
    grad = torch.randn(32, 48)
    results = []
    for num_cu in (None, 2):
        a.grad = w.grad = None
        out = turbo.ops.grouped_gemm(a, w, _lens(), trans_b=True, num_cu=num_cu)
        out.backward(grad)
        results.append((out, a.grad, w.grad))
    assert all(torch.equal(x, y) for x, y in zip(*results))


def test_compute_unit_limit_nests_and_restores_after_an_exception():
    from turbo_dispatch.ops.grouped_gemm_compute_units import compute_unit_limit, current_compute_unit_limit

    with compute_unit_limit(8):
        with compute_unit_limit(None):
            assert current_compute_unit_limit() is None
        assert current_compute_unit_limit() == 8
        with pytest.raises(RuntimeError), compute_unit_limit(2):
            assert current_compute_unit_limit() == 2
            raise RuntimeError("inside")
        assert current_compute_unit_limit() == 8
    assert current_compute_unit_limit() is None


def test_schedule_is_static_only():
    a, w = torch.randn(32, 64), torch.randn(3, 48, 64)
    assert turbo.ops.grouped_gemm(a, w, _lens(), None, True, None, "static").shape == (32, 48)
    with pytest.raises(ValueError, match="schedule must be one of \\('static',\\)"):
        turbo.ops.grouped_gemm(a, w, _lens(), trans_b=True, schedule="work_steal")


@pytest.fixture
def triton_grids(monkeypatch):
    """Every GEMM the grouped ops resolve goes to the TRITON adapters (registered for GPUs only),
    whose persistent fixed-K kernel is replaced by a recorder of its launch grid: the program
    count is the fact under test, and nothing runs."""
    pytest.importorskip("triton")
    from turbo_dispatch.backends.triton import grouped_gemm as GG
    from turbo_dispatch.backends.triton import grouped_kernels as GKK

    spec = importlib.import_module("turbo_dispatch.ops.grouped_gemm_spec")
    adapters = {spec.GROUPED_GEMM: GG.TritonGroupedGemm(), spec.GROUPED_GEMM_FP8: GG.TritonGroupedGemmFp8()}
    monkeypatch.setattr(spec, "resolve", lambda op, p: SimpleNamespace(entry=SimpleNamespace(adapter=adapters[op]),
                                                                      config=(16, 16, 16, 2, 1, 4, 0)))
    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(GKK, "grouped_fixed_k_kernel", Recorder())
    monkeypatch.setattr(GG, "launch_variable_k", lambda x, y, out, *args, **kwargs: out)
    return grids


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_num_cu_caps_the_persistent_programs(triton_grids, compiled):
    a = torch.randn(512, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(3, 64, 64, dtype=torch.bfloat16, requires_grad=True)
    lens = torch.tensor([200, 0, 312])

    def step(x, y, num_cu):
        return turbo.ops.grouped_gemm(x, y, lens, trans_b=True, num_cu=num_cu)

    fn = torch.compile(step, fullgraph=True) if compiled else step
    fn(a, w, 3).backward(torch.ones(512, 64, dtype=torch.bfloat16))
    assert triton_grids == [(3,), (3,)]  # forward and dgrad; the interpreter's default is 4 programs
    triton_grids.clear()
    with torch.no_grad():
        step(a, w, None)
        step(a, w, 1)
    assert triton_grids == [(4,), (1,)]


def test_explain_takes_the_calls_new_arguments():
    """The new arguments change no problem key: explain accepts them and gives the same decision."""
    a, w = torch.randn(32, 64), _weight("grouped_gemm", torch.float32)
    lens = _lens()
    plain = turbo.explain("grouped_gemm", a, w, lens, None, True)
    assert turbo.explain("grouped_gemm", a, w, lens, None, True, 4, "static", "megatron").problem == plain.problem
    fp8 = turbo.explain("grouped_gemm_fp8", a, w, lens, config=BLOCKWISE)
    assert turbo.explain("grouped_gemm_fp8", a, w, lens, config=BLOCKWISE, num_cu=4,
                         fuse_bgrad_accum_pattern="megatron").problem == fp8.problem
    w2 = _weight("gemm", torch.float32)
    assert (turbo.explain("gemm", a, w2, trans_b=True, fuse_bgrad_accum_pattern="megatron").problem
            == turbo.explain("gemm", a, w2, trans_b=True).problem)
    assert (turbo.explain("gemm_fp8", a, w2, False, True, None, BLOCKWISE, "megatron").problem
            == turbo.explain("gemm_fp8", a, w2, trans_b=True, config=BLOCKWISE).problem)
