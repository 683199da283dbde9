"""Per-call-key plans of the eager blockwise grouped_gemm_fp8 step (ops/grouped_gemm_plan.py).

CPU: a plan is made by the first call of a key and run by later ones (also with other routings);
it is made again when the key changes (shapes, strides, dtypes, requires_grad, out_dtype, config,
group_offs), when the backend variable's text changes, when the tuning-DB settings change or the
tuners clear the decisions; a provisional decision is never kept; a backward whose settings
changed since its forward takes the unplanned path; bad input after a plan exists is still named;
and planned steps give bit for bit what the unplanned path gives (outputs and both gradients,
every layout, padded tails, weight reuse). ``Adapter.prepare``'s default and the pre-bound
plan helpers (``CallKeyedKernel.launch_and_plan``, ``rebaser``) too.
GPU (``gpu``, TRITON pinned): planned steps on the warp-specialised kernels' prepared launchers
give the unplanned path's bits, follow the Gluon switch, and skip the per-call launch keys.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager, resolver
from turbo_dispatch.errors import ConfigError
from turbo_dispatch.low_precision import Float8QuantConfig, reuse_quantized_weights
from turbo_dispatch.ops import grouped_gemm_plan as GP

CFG = Float8QuantConfig(granularity="blockwise", block_size=128)


def _inputs(device="cpu", g=3, m=300, n=256, k=384, trans_b=True, need=(True, True), lens=(100, 0, 150), seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).bfloat16().to(device).requires_grad_(need[0])
    b = torch.randn((g, n, k) if trans_b else (g, k, n), generator=gen).bfloat16().to(device).requires_grad_(need[1])
    grad = torch.randn(m, n, generator=gen).bfloat16().to(device)
    return a, b, torch.tensor(lens, dtype=torch.int64, device=device), grad


def _step(a, b, lens, grad, config=CFG, **kw):
    out = turbo.ops.grouped_gemm_fp8(a, b, lens, config=config, **kw)
    wrt = [t for t in (a, b) if t.requires_grad]
    return (out.detach(), *torch.autograd.grad(out, wrt, grad))


def _unplanned(monkeypatch):
    monkeypatch.setattr(GP, "step_key", lambda *args: None)


def _counts() -> tuple[int, int]:
    return GP.stats["built"], GP.stats["hits"]


def _same(xs, ys) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert torch.equal(x, y)


def test_a_key_is_planned_once_and_its_plan_serves_later_calls_and_routings():
    a, b, lens, grad = _inputs()
    built, hits = _counts()
    _step(a, b, lens, grad)
    assert _counts() == (built + 1, hits)
    _step(a, b, lens, grad)
    _step(a, b, torch.tensor([0, 300, 0]), grad)  # another routing, the same key
    assert _counts() == (built + 1, hits + 2)


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)], ids=["ab", "a", "b"])
@pytest.mark.parametrize("offs", [False, True], ids=["lens", "offs"])
def test_planned_steps_give_the_unplanned_bits(trans_b, need, offs, monkeypatch):
    a, b, lens, grad = _inputs(trans_b=trans_b, need=need)
    routings = [lens, torch.tensor([300, 0, 0]), torch.tensor([1, 7, 250])]

    def steps():
        out = []
        for r in routings:
            kw = {"group_offs": torch.nn.functional.pad(torch.cumsum(r, 0), (1, 0))} if offs else {}
            out.append(_step(a, b, r, grad, trans_b=trans_b, **kw))
        return out

    built, _ = _counts()
    planned = steps()
    assert _counts()[0] == built + 1
    _unplanned(monkeypatch)
    for p, u in zip(planned, steps()):
        _same(p, u)
    assert _counts()[0] == built + 1


def test_weight_reuse_inside_a_planned_step(monkeypatch):
    a, b, lens, grad = _inputs()
    _step(a, b, lens, grad)  # plan the key
    with reuse_quantized_weights() as scope:
        planned = [_step(a, b, lens, grad) for _ in range(3)]
    assert (scope.hits, scope.misses) == (2, 1)
    _unplanned(monkeypatch)
    with reuse_quantized_weights() as scope:
        unplanned = [_step(a, b, lens, grad) for _ in range(3)]
    assert (scope.hits, scope.misses) == (2, 1)
    for p, u in zip(planned, unplanned):
        _same(p, u)


def _variants():
    a, b, lens, grad = _inputs()
    yield "shape", lambda: _step(a[:299].detach().requires_grad_(), b, lens, grad[:299])
    yield "strides", lambda: _step(a.detach().t().contiguous().t().requires_grad_(), b, lens, grad)
    yield "requires_grad", lambda: _step(a.detach(), b, lens, grad)
    yield "dtype", lambda: _step(a.detach().half().requires_grad_(), b.detach().half().requires_grad_(), lens, grad)
    yield "out_dtype", lambda: _step(a, b, lens, grad.float(), out_dtype=torch.float32)
    yield "config", lambda: _step(a, b, lens, grad, config=dataclasses.replace(CFG, block_size=64))
    yield "group_offs", lambda: _step(a, b, lens, grad, group_offs=torch.tensor([0, 100, 100, 250]))
    yield "group_offs dtype", lambda: _step(a, b, lens, grad,
                                            group_offs=torch.tensor([0, 100, 100, 250], dtype=torch.int32))
    yield "trans_b", lambda: _step(a, b.detach().transpose(1, 2).contiguous().requires_grad_(), lens, grad,
                                   trans_b=False)


@pytest.mark.parametrize("variant", [name for name, _ in _variants()])
def test_another_key_gets_another_plan(variant):
    a, b, lens, grad = _inputs()
    _step(a, b, lens, grad)
    call = dict(_variants())[variant]
    built, hits = _counts()
    call()
    assert _counts() == (built + 1, hits)
    call()
    assert _counts() == (built + 1, hits + 1)


def test_a_changed_backend_variable_plans_again_and_a_bad_one_raises(monkeypatch):
    a, b, lens, grad = _inputs()
    _step(a, b, lens, grad)
    built, _ = _counts()
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "TORCH")
    _step(a, b, lens, grad)
    _step(a, b, lens, grad)
    assert _counts()[0] == built + 1
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "fp8:TORCH")
    _step(a, b, lens, grad)
    assert _counts()[0] == built + 2
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "NO_SUCH_BACKEND")
    with pytest.raises(ConfigError, match="NO_SUCH_BACKEND"):
        _step(a, b, lens, grad)


def test_tuning_db_settings_and_cleared_decisions_plan_again(tmp_path):
    a, b, lens, grad = _inputs()
    _step(a, b, lens, grad)
    built, _ = _counts()
    GlobalBackendManager.set_tune_db(tmp_path / "other.jsonl")
    _step(a, b, lens, grad)
    assert _counts()[0] == built + 1
    resolver.clear_cache()  # what the tuners do after storing results
    _step(a, b, lens, grad)
    assert _counts()[0] == built + 2
    GlobalBackendManager.set_grouped_gemm_backend("TORCH", precision="fp8")
    _step(a, b, lens, grad)
    assert _counts()[0] == built + 3


def test_provisional_decisions_are_resolved_on_every_call(monkeypatch):
    from turbo_dispatch.ops import grouped_gemm_spec

    real = grouped_gemm_spec.resolve
    asked = []

    def provisional(spec, problem):
        asked.append(problem)
        return dataclasses.replace(real(spec, problem), provisional=True)

    monkeypatch.setattr(grouped_gemm_spec, "resolve", provisional)
    a, b, lens, grad = _inputs()
    _step(a, b, lens, grad)
    first = len(asked)
    assert first == 3  # forward, dgrad, wgrad
    _step(a, b, lens, grad)
    assert len(asked) == 2 * first


def test_a_backward_after_a_settings_change_takes_the_unplanned_path(monkeypatch):
    seen = []
    real = GP.StepPlan.backward_plan
    monkeypatch.setattr(GP.StepPlan, "backward_plan", lambda self, grad: seen.append(real(self, grad)) or seen[-1])
    a, b, lens, grad = _inputs()
    _step(a, b, lens, grad)
    out = turbo.ops.grouped_gemm_fp8(a, b, lens, config=CFG)
    GlobalBackendManager.set_grouped_gemm_backend("TORCH")
    out.backward(grad)
    assert isinstance(seen[0], GP.BackwardPlan) and seen[1] is None


def test_bad_input_is_named_after_a_plan_exists():
    a, b, lens, grad = _inputs()
    _step(a, b, lens, grad)
    with pytest.raises(TypeError, match="group_lens"):
        _step(a, b, lens.int(), grad)
    with pytest.raises(TypeError, match="trans_b"):
        turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=1, config=CFG)
    with pytest.raises(ValueError, match="inner dimensions"):
        turbo.ops.grouped_gemm_fp8(a[:, :256], b, lens, config=CFG)
    with pytest.raises(ValueError, match="group_offs"):
        turbo.ops.grouped_gemm_fp8(a, b, lens, group_offs=torch.zeros(3, dtype=torch.int64), config=CFG)


def test_group_lens_values_are_still_checked_on_a_planned_call():
    a, b, lens, grad = _inputs()
    _step(a, b, lens, grad)
    with pytest.raises(ValueError, match="sum to at most"):
        _step(a, b, torch.tensor([100, 100, 101]), grad)


def test_parameters_are_planned_and_subclasses_are_not():
    a, b, lens, grad = _inputs()
    w = torch.nn.Parameter(b.detach())
    built, _ = _counts()
    _step(a, w, lens, grad)
    assert _counts()[0] == built + 1

    class Sub(torch.Tensor):
        pass

    assert GP.step_key(a.as_subclass(Sub), b, lens, None, True, None, CFG) is None
    assert GP.step_key(a, b, lens, None, 1, None, CFG) is None


def test_the_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(GP, "MAX_PLANS", 2)
    a, b, lens, grad = _inputs()
    for m in (300, 299, 298):
        _step(a[:m].detach().requires_grad_(), b, lens, grad[:m])
    assert len(GP._plans) <= 2


def test_adapter_prepare_defaults_to_run():
    from turbo_dispatch.adapter import Adapter

    class Twice(Adapter):
        def run(self, problem, x, config=None):
            return (problem, 2 * x, config)

    out, again = Twice().prepare("p", 3, config="c")
    assert out == ("p", 6, "c") and again(5) == ("p", 10, "c")


# -- the pre-bound helpers the prepared launchers use -------------------------------------------------
def test_launch_and_plan_returns_the_plan_that_launched():
    pytest.importorskip("triton")
    from turbo_dispatch.backends.triton.prebound import CallKeyedKernel

    log = []

    class Compiled:
        function = object()

        def __getitem__(self, grid):
            return lambda *args: log.append(("direct", args))

    class Jit:
        arg_names = ["x", "n", "BLOCK"]
        pre_run_hooks = []

        def __getitem__(self, grid):
            return lambda *args, **options: log.append(("normal", args)) or Compiled()

    kernel = CallKeyedKernel(Jit(), ("x",))
    x, y = torch.zeros(4), torch.ones(4)
    plan = kernel.launch_and_plan((1,), (x, 4), dict(BLOCK=8))
    assert kernel.launch_and_plan((1,), (y, 4), dict(BLOCK=8)) is plan
    plan(x)  # the kept plan launches without the key
    assert [entry[0] for entry in log] == ["normal", "direct", "direct"]
    assert log[1][1][0] is y and log[2][1][0] is x
    assert kernel.prebound.hits == 1


def test_rebaser_copies_a_descriptor_over_another_base_without_keeping_the_first():
    pytest.importorskip("triton")
    import weakref

    from turbo_dispatch.backends.triton.prebound import rebaser

    class Desc:
        def __init__(self, base, shape, block):
            self.base, self.shape, self.block = base, shape, block

    first = torch.zeros(8)
    rebased = rebaser(Desc(first, [8], [4]))
    gone = weakref.ref(first)
    del first
    assert gone() is None
    other = torch.ones(8)
    copy = rebased(other)
    assert isinstance(copy, Desc) and copy.base is other and (copy.shape, copy.block) == ([8], [4])

    @dataclasses.dataclass(slots=True)
    class Slotted:
        base: object
        shape: list

    assert rebaser(Slotted(torch.zeros(2), [2]))(other) == Slotted(other, [2])


@pytest.mark.parametrize("tile_2d", [False, True], ids=["runs", "tiles"])
@pytest.mark.parametrize("prebound", [True, False], ids=["prebound", "pointer"])
def test_prepared_dual_quantize_hands_each_buffer_its_role(tile_2d, prebound, monkeypatch):
    """The prepared quantiser hands the Gluon launcher each output in its parameter's place, on the
    first call and on repeats (a fake launcher checks each buffer's shape and dtype against
    ``dual_quantize``'s and marks it with its role and the input)."""
    pytest.importorskip("triton")
    from turbo_dispatch.backends.triton import dual_quantize as DQ, dual_quantize_gluon as DG

    dtype = torch.float8_e4m3fn

    def fill(x, data, data_t, scale, scale_t, *rest):
        want = DQ._dual_outputs(x, dtype, 128, tile_2d)
        for role, (buf, ref) in enumerate(zip((data, scale, data_t, scale_t), want)):
            assert (buf.shape, buf.stride(), buf.dtype) == (ref.shape, ref.stride(), ref.dtype), role
            buf.copy_(torch.full(buf.shape, role + 1.0) * x[0, 0, 0].float())

    def prepare(x, data, data_t, scale, scale_t, *rest):
        fill(x, data, data_t, scale, scale_t)
        return fill if prebound else None

    def launch(x, data, data_t, scale, scale_t, *rest):
        fill(x, data, data_t, scale, scale_t)

    monkeypatch.setattr(DQ, "_interpreting", lambda: False)
    monkeypatch.setattr(DG, "available", lambda x, block: None)
    monkeypatch.setattr(DG, "prepare", prepare)
    monkeypatch.setattr(DG, "launch", launch)
    xs = [torch.full((2, 300, 260), v).bfloat16() for v in (0.5, -2.0)]
    first, again = DQ.prepare_dual_quantize(xs[0], dtype, 128, tile_2d)
    for got, x in zip((first, again(xs[1])), xs):
        want = DQ.dual_quantize(x, dtype, 128, tile_2d)  # through the fake launch: the roles by name
        for g, r in zip(got, want):
            assert g.shape == r.shape and g.stride() == r.stride()
            assert torch.equal(g.float(), r.float())


@pytest.mark.parametrize("prebound", [True, False], ids=["prebound", "pointer"])
def test_prepared_2d_runs_lay_out_what_the_3d_path_selects(prebound, monkeypatch):
    """``prepare_runs_2d`` allocates a later call's outputs 2-D: each has the shape, strides and
    storage size of the 3-D path's only group (padded rows included, which kernels write), the
    fake launcher gets them in their roles, and the results equal ``dual_quantize``'s group."""
    pytest.importorskip("triton")
    from turbo_dispatch.backends.triton import dual_quantize as DQ, dual_quantize_gluon as DG

    dtype = torch.float8_e4m3fn

    def fill(x, data, data_t, scale, scale_t, *rest):
        want = [t[0] for t in DQ._dual_outputs(x.reshape(1, *x.shape[-2:]), dtype, 128, False)]
        for role, (buf, ref) in enumerate(zip((data, scale, data_t, scale_t), want)):
            if buf.dim() == 2:
                assert (buf.shape, buf.stride(), buf.dtype) == (ref.shape, ref.stride(), ref.dtype), role
                assert buf.untyped_storage().nbytes() == ref.untyped_storage().nbytes(), role
            buf.copy_(torch.full(buf.shape, role + 1.0) * x.reshape(-1)[0].float())

    def prepare(x, data, data_t, scale, scale_t, *rest):
        fill(x, data, data_t, scale, scale_t)
        return fill if prebound else None

    monkeypatch.setattr(DQ, "_interpreting", lambda: False)
    monkeypatch.setattr(DG, "available", lambda x, block: None)
    monkeypatch.setattr(DG, "prepare", prepare)
    monkeypatch.setattr(DG, "launch", fill)
    xs = [torch.full((300, 260), v).bfloat16() for v in (0.5, -2.0)]
    first, again = DQ.prepare_runs_2d(xs[0], dtype, 128)
    for got, x in zip((first, again(xs[1])), xs):
        want = [t[0] for t in DQ.dual_quantize(x.unsqueeze(0), dtype, 128, False)]
        for g, r in zip(got, want):
            assert g.shape == r.shape and g.stride() == r.stride()
            assert torch.equal(g.float(), r.float())


# -- GPU ---------------------------------------------------------------------------------------------
def _triton_fp8():
    GlobalBackendManager.reset()
    GlobalBackendManager.set_grouped_gemm_backend("TRITON", precision="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)], ids=["ab", "a", "b"])
def test_gpu_planned_steps_give_the_unplanned_bits(trans_b, need, monkeypatch):
    """TRITON pinned: on sm_90 the step's GEMMs and quantisers run their prepared launchers; odd
    sizes, a padded tail and an empty group; three routings through one plan."""
    _triton_fp8()
    a, b, lens, grad = _inputs("cuda", g=5, m=1100, n=384, k=640, trans_b=trans_b, need=need,
                               lens=(300, 0, 1, 523, 200))
    routings = [lens, torch.tensor([1024, 0, 0, 0, 0], device="cuda"), torch.tensor([0, 100, 0, 1, 999], device="cuda")]
    planned = [_step(a, b, r, grad, trans_b=trans_b) for r in routings]
    planned = [_step(a, b, r, grad, trans_b=trans_b) for r in routings]  # all from the plan now
    _unplanned(monkeypatch)
    for r, p in zip(routings, planned):
        _same(p, _step(a, b, r, grad, trans_b=trans_b))
    assert torch.count_nonzero(planned[0][0][1024:]) == 0  # the padded tail is zero


@pytest.mark.gpu
def test_gpu_planned_steps_skip_the_launch_keys():
    """Once planned, a step launches through the kept plans: the kernels' key lookups (hits) and
    bindings stay as they were."""
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon as GL

    if GL.available() is not None:
        pytest.skip(f"the Gluon kernels cannot run here: {GL.available()}")
    from turbo_dispatch.backends.triton import dual_quantize_gluon as DQ
    from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
    from turbo_dispatch.backends.triton import fp8_blockwise_wgrad_ws as GWW

    _triton_fp8()
    a, b, lens, grad = _inputs("cuda", g=4, m=1024, n=512, k=512, lens=(256, 256, 256, 200))
    for _ in range(2):
        _step(a, b, lens, grad)
    kernels = [GWS._launcher().prebound, GWW._launcher().prebound, *(k.prebound for k in DQ._launchers())]
    before = [(k.binds, k.hits) for k in kernels]
    out = _step(a, b, lens, grad)
    torch.cuda.synchronize()
    assert [(k.binds, k.hits) for k in kernels] == before
    assert all(torch.isfinite(t).all() for t in out)


@pytest.mark.gpu
def test_gpu_a_planned_step_follows_the_gluon_switch(monkeypatch):
    """Switching the Gluon kernels off after a plan was made: the prepared launchers give way to
    the full path, which then takes the Triton kernels: the same bits as an unplanned step."""
    _triton_fp8()
    a, b, lens, grad = _inputs("cuda", g=4, m=1024, n=512, k=512, lens=(256, 256, 256, 200))
    _step(a, b, lens, grad)
    monkeypatch.setenv("PRIMUS_TURBO_GLUON_KERNELS", "0")
    planned = _step(a, b, lens, grad)
    _unplanned(monkeypatch)
    _same(planned, _step(a, b, lens, grad))


@pytest.mark.gpu
def test_gpu_planned_wgrad_counters_cycle(monkeypatch):
    """The planned wgrad takes its work-item counter from a per-stream buffer of pre-zeroed slots:
    with three slots per buffer, seven steps (six planned wgrads, so the buffer is refilled twice
    while the dgrad runs beside each wgrad on the side stream) give the unplanned step's bits
    every time."""
    from turbo_dispatch.backends.triton import work_counters

    monkeypatch.setattr(work_counters, "SLOTS", 3)
    monkeypatch.setattr(work_counters, "_pools", {})
    _triton_fp8()
    a, b, lens, grad = _inputs("cuda", g=5, m=1100, n=384, k=640, lens=(300, 0, 1, 523, 200))
    planned = [_step(a, b, lens, grad) for _ in range(7)]
    assert work_counters._pools, "the planned wgrad took no pooled counter"
    _unplanned(monkeypatch)
    want = _step(a, b, lens, grad)
    for got in planned:
        _same(got, want)
