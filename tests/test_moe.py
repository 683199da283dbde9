"""moe_dispatch / moe_combine / Buffer: 2 and 4 gloo processes against single-process references
(tests/moe_checks.py), in-process checks on a one-rank group, and the 2-GPU NCCL run (gpu marker)."""
import functools

import pytest
import torch
import torch.distributed as dist

import moe_checks
import turbo_dispatch as turbo
from turbo_dispatch.ops.moe import (MoeHandle, dispatch_layout, moe_combine, moe_dispatch, moe_dispatch_cached,
                                    moe_dispatch_problem)


# -- multi-process (gloo): every check on every rank ---------------------------------------------------
@functools.lru_cache(maxsize=None)
def _gloo_results(world: int) -> dict:
    return moe_checks.spawn(world, "gloo")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("check", list(moe_checks.CHECKS))
def test_multi_rank(world, check):
    results = _gloo_results(world)
    failures = {r: res.get(check, "missing") for r, res in results.items() if res.get(check) != "ok"}
    process = {r: res["__process__"] for r, res in results.items() if "__process__" in res}
    assert not failures and not process, f"{check} on {world} ranks: {failures or process}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL between 2 processes)")
def test_multi_gpu_nccl(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    results = moe_checks.spawn(2, "nccl", checks="gpu", timeout=400)
    bad = {r: {k: v for k, v in res.items() if v != "ok"} for r, res in results.items()}
    assert not any(bad.values()), bad


# -- in process: no group, then a one-rank group ---------------------------------------------------------
def test_needs_initialised_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        moe_dispatch(torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.int64), None, 2, None)


one_rank = pytest.fixture(scope="module")(moe_checks.one_rank_group)


def _inputs(t=7, h=5, k=3, e=6, probs_grad=False):
    x = torch.randn(t, h, dtype=torch.float64, requires_grad=True)
    idx = torch.rand(t, e).argsort(1)[:, :k]
    idx[0] = -1
    idx[1, 1] = -1
    p = torch.rand(t, k, requires_grad=probs_grad)
    return x, idx, p


def test_one_rank_semantics(one_rank):
    x, idx, p = _inputs(probs_grad=True)
    recv_x, recv_idx, recv_probs, counts, handle = moe_dispatch(x, idx, p, 6, None, async_finish=True,
                                                                allocate_on_comm_stream=True)
    keep = (idx >= 0).any(1)  # token 0 goes nowhere
    assert torch.equal(recv_x, x[keep]) and torch.equal(recv_idx, idx[keep])
    assert torch.equal(recv_probs, torch.where(idx >= 0, p, 0.0)[keep])
    assert counts == torch.bincount(idx[idx >= 0], minlength=6).tolist()
    assert isinstance(handle, MoeHandle) and handle.world_size == 1 and "num_recv=6" in repr(handle)
    out = moe_combine(recv_x * (1 + recv_probs.sum(1, keepdim=True)), None, handle)
    out.sum().backward()
    assert torch.equal(out[0], torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(x.grad, (1 + torch.where(idx >= 0, p, 0.0).sum(1, keepdim=True)).double()
                               .expand(-1, 5) * keep[:, None])
    torch.testing.assert_close(p.grad, x.detach().sum(1, keepdim=True).float().expand(-1, 3) * (idx >= 0))
    # cached dispatch of other rows along the same handle, and its backward (a combine)
    x2 = torch.randn(7, 2, requires_grad=True)
    recv2 = moe_dispatch_cached(x2, None, handle)
    assert torch.equal(recv2, x2[keep])
    w = torch.randn_like(recv2)
    (recv2 * w).sum().backward()
    torch.testing.assert_close(x2.grad, torch.zeros(7, 2).index_put_((keep.nonzero()[:, 0],), w))


def test_problem_key_and_explain(one_rank):
    x, idx, p = _inputs()
    prob = moe_dispatch_problem(x, idx, p, 6, None, num_worst_tokens=16)
    assert (prob.hidden, prob.topk, prob.num_experts, prob.world_size) == (5, 3, 6, 1)
    assert "num_tokens" not in prob._fields  # rank-uniform key: token counts differ between ranks
    assert prob.dtype == torch.float64 and prob.with_probs and prob.num_worst_tokens == 16 and prob.platform == "cpu"
    d = turbo.explain("moe_dispatch_combine", x, idx, p, 6, None)
    assert d.backend == "TORCH" and d.source == "default"
    assert d.key.startswith("hidden=5,topk=3,num_experts=6,world_size=1,dtype=fp64,with_probs=1,num_worst_tokens=0")
    assert any("one host sync per dispatch" in n for n in d.notes)


def test_env_pin_and_unknown_backend(one_rank, monkeypatch):
    x, idx, p = _inputs()
    monkeypatch.setenv("PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND", "torch")
    turbo.GlobalBackendManager.reset()
    assert turbo.explain("moe_dispatch_combine", x, idx, p, 6, None).source == "env"
    monkeypatch.setenv("PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND", "DEEP_EP")
    turbo.GlobalBackendManager.reset()
    with pytest.raises(turbo.BackendUnsupportedError, match="DEEP_EP is not registered"):
        moe_dispatch(x, idx, p, 6, None)


def test_autotune_spec_fails_per_candidate(one_rank):
    """make_inputs/reference never raise (the autotuner calls them outside its per-candidate guard);
    run raises the 'not tunable' ValueError, which the autotuner records as a failed candidate."""
    from turbo_dispatch.ops.moe import MOE_DISPATCH_COMBINE as spec

    x, idx, p = _inputs()
    prob = moe_dispatch_problem(x, idx, p, 6, None)
    inputs = spec.make_inputs(prob, torch.device("cpu"))
    assert spec.reference(prob, inputs) is None
    with pytest.raises(ValueError, match="not tunable without a process group"):
        spec.run(None, prob, inputs, None)
    turbo.GlobalBackendManager.set_auto_tune(True)
    recv_x, *_ = moe_dispatch(x, idx, p, 6, None)
    assert recv_x.shape[0] == 6


def test_argument_errors(one_rank):
    x, idx, p = _inputs()
    _, _, _, _, handle = moe_dispatch(x, idx, p, 6, None)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        moe_dispatch(x, idx, p, 6.0, None)
    with pytest.raises(ValueError, match="token_indices must be a 2-D tensor"):
        moe_dispatch(x, idx[0], p, 6, None)
    with pytest.raises(ValueError, match="combine: x must have 6 rows"):
        moe_combine(x, None, handle)
    with pytest.raises(TypeError, match="allocate_on_comm_stream must be a bool"):
        moe_combine(x[:6], None, handle, allocate_on_comm_stream="no")


def test_dispatch_layout_matches_reference(one_rank):
    idx = torch.tensor([[0, 5, -1], [-1, -1, -1], [3, 2, 1], [5, 4, 0]])
    per_rank, per_expert, in_rank = dispatch_layout(idx, 6, 3)
    assert in_rank.tolist() == [[True, False, True], [False, False, False], [True, True, False], [True, False, True]]
    assert per_rank.tolist() == [3, 1, 2]
    assert per_expert.tolist() == [2, 1, 1, 1, 1, 2]


def test_compile_graph_breaks_around_moe(one_rank):
    """Eager-only ops: a compiled region graph-breaks at them and still computes the same values."""
    x, idx, p = _inputs(probs_grad=True)

    def step(x, idx, p):
        recv_x, _, recv_probs, _, handle = moe_dispatch(x * 2, idx, p, 6, None)
        return moe_combine(recv_x * recv_probs.sum(1, keepdim=True).double(), None, handle).sin()

    ref = step(x, idx, p)
    ref.sum().backward()
    gx, gp = x.grad.clone(), p.grad.clone()
    x.grad = p.grad = None
    out = torch.compile(step, backend="aot_eager")(x, idx, p)
    out.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, gx)
    torch.testing.assert_close(p.grad, gp)
