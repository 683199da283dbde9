"""Multi-rank checks of moe_dispatch / moe_combine / the Buffer facade.

Shared by tests/test_moe.py (gloo processes on the CPU; NCCL on two GPUs for the gpu-marked test)
and benchmarks/probes/moe_gpu_check.py (NCCL). Every rank regenerates every rank's inputs from
per-rank seeds, so each rank can compute, in one process and without communication, what it must
receive and what its combine and gradients must return. Each check returns nothing or raises
AssertionError; ``run_checks`` records "ok" or the failure per check name.
"""
from __future__ import annotations

import copy
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

#: The backend the checks expect (a pin through the environment selects it for every rank); the
#: default is the platform default, TORCH.
PINNED = os.environ.get("PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND", "").strip().upper() or None

#: Tokens per source rank (index = rank); a rank with 0 tokens is covered from 3 ranks on.
TOKENS = (13, 6, 0, 21, 9, 4, 17, 2)
SMALL = dict(hidden=33, topk=3, local_experts=3)
LARGE = dict(hidden=1024, topk=8, local_experts=16, tokens=(300, 257, 128, 511))


class Case:
    """One rank's inputs, regenerated identically on every rank."""

    def __init__(self, seed: int, src: int, world: int, hidden: int, topk: int, local_experts: int,
                 tokens=TOKENS):
        g = torch.Generator().manual_seed(seed * 1000 + src)
        self.num_experts = local_experts * world
        t = tokens[src % len(tokens)]
        self.x = torch.randn(t, hidden, generator=g, dtype=torch.float64)
        idx = torch.rand(t, self.num_experts, generator=g).argsort(1)[:, :topk]
        idx[torch.rand(t, topk, generator=g) < 0.2] = -1
        if t:
            idx[0] = -1  # a token that goes nowhere
        self.idx = idx
        self.probs = torch.rand(t, topk, generator=g, dtype=torch.float32)
        self.grad_out = torch.randn(t, hidden, generator=g, dtype=torch.float64)  # dL/d(combined)

    def dest_ranks(self, world: int) -> list[list[int]]:
        local = self.num_experts // world
        return [sorted({e // local for e in row if e >= 0}) for row in self.idx.tolist()]


class Expected:
    """What rank ``me`` must receive from all ranks' cases."""

    def __init__(self, cases: list[Case], me: int, world: int):
        e = cases[0].num_experts
        local = e // world
        k = cases[0].idx.shape[1]
        rows, ids, probs, counts = [], [], [], [0] * local
        for case in cases:
            for t, row in enumerate(case.idx.tolist()):
                slots = [(j, v - me * local) for j, v in enumerate(row) if v >= 0 and v // local == me]
                if not slots:
                    continue
                rows.append(case.x[t])
                r_ids, r_probs = [-1] * k, [0.0] * k
                for j, lid in slots:
                    r_ids[j], r_probs[j] = lid, float(case.probs[t, j])
                    counts[lid] += 1
                ids.append(r_ids)
                probs.append(r_probs)
        h = cases[0].x.shape[1]
        self.x = torch.stack(rows) if rows else torch.empty(0, h, dtype=torch.float64)
        self.idx = torch.tensor(ids, dtype=torch.int64).reshape(-1, k)
        self.probs = torch.tensor(probs, dtype=torch.float32).reshape(-1, k)
        self.counts = counts


class Ctx:
    def __init__(self, rank: int, world: int, device: str):
        self.rank, self.world, self.device = rank, world, torch.device(device)

    def cases(self, seed: int, **sizes) -> list[Case]:
        return [Case(seed, src, self.world, **sizes) for src in range(self.world)]

    def to(self, t):
        """A copy on this rank's device (never an alias of the regenerated case)."""
        return None if t is None else t.to(self.device, copy=True)


def expected_backend(ctx: Ctx) -> str:
    """The backend a dispatch runs on: the pinned one, else the default (SYMM_MEM on one host's
    NVIDIA GPUs, TORCH on gloo CPU ranks)."""
    if PINNED:
        return PINNED
    return "SYMM_MEM" if ctx.device.type == "cuda" and torch.version.cuda else "TORCH"


def _eq(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got.cpu(), want.cpu()), f"{name}: values differ (max |diff| " \
        f"{(got.cpu().double() - want.cpu().double()).abs().max().item() if got.numel() else 0})"


def _close(name, got, want, rtol):
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = float((got - want).norm() / want.norm().clamp_min(1e-30)) if want.numel() else 0.0
    assert err <= rtol, f"{name}: relative error {err:.3e} > {rtol:.0e}"


def _raises(exc, match, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert match in str(e), f"{exc.__name__} without {match!r}: {e}"
        return str(e)
    raise AssertionError(f"expected {exc.__name__} containing {match!r}")


# -- checks ----------------------------------------------------------------------------------------------
def check_dispatch_combine(ctx: Ctx, seed=1, sizes=SMALL):
    from turbo_dispatch.ops.moe import moe_combine, moe_dispatch

    cases = ctx.cases(seed, **sizes)
    mine, want = cases[ctx.rank], Expected(cases, ctx.rank, ctx.world)
    n_dest = torch.tensor([len(d) for d in mine.dest_ranks(ctx.world)], dtype=torch.float64)[:, None]
    for dtype in (torch.float32, torch.bfloat16):
        x = ctx.to(mine.x.to(dtype))
        recv_x, recv_idx, recv_probs, counts, handle = moe_dispatch(x, ctx.to(mine.idx), ctx.to(mine.probs),
                                                                    mine.num_experts, None)
        _eq(f"{dtype} recv_x", recv_x, want.x.to(dtype))
        _eq("recv_idx", recv_idx, want.idx)
        _eq("recv_probs", recv_probs, want.probs)
        assert counts == want.counts, f"tokens_per_expert {counts} != {want.counts}"
        assert handle.num_recv == handle.recv_rows == want.x.shape[0]
        assert handle.backend == expected_backend(ctx), f"dispatch ran on {handle.backend}, expected " \
            f"{expected_backend(ctx)}"
        out = moe_combine(recv_x, None, handle)
        assert out.dtype == dtype and out.shape == x.shape
        _eq(f"{dtype} combine(recv_x)", out, (mine.x.to(dtype).float() * n_dest.float()).to(dtype))
    # without probabilities; fp8 rows travel bit-exactly
    x8 = ctx.to(mine.x.to(torch.float8_e4m3fn))
    recv8, recv_idx, recv_probs, counts, handle = moe_dispatch(x8, ctx.to(mine.idx), None, mine.num_experts, None)
    assert recv_probs is None and counts == want.counts
    _eq("fp8 recv_x bytes", recv8.view(torch.uint8), want.x.to(torch.float8_e4m3fn).view(torch.uint8))
    _eq("recv_idx (no probs)", recv_idx, want.idx)


def check_worst_tokens(ctx: Ctx, seed=2, sizes=SMALL):
    from turbo_dispatch.ops.moe import moe_combine, moe_dispatch

    cases = ctx.cases(seed, **sizes)
    mine, want = cases[ctx.rank], Expected(cases, ctx.rank, ctx.world)
    worst = sum(c.x.shape[0] for c in cases) + 1
    n_dest = torch.tensor([len(d) for d in mine.dest_ranks(ctx.world)], dtype=torch.float64)[:, None]
    x = ctx.to(mine.x).requires_grad_()
    recv_x, recv_idx, recv_probs, counts, handle = moe_dispatch(x, ctx.to(mine.idx), ctx.to(mine.probs),
                                                                mine.num_experts, None, num_worst_tokens=worst)
    r = want.x.shape[0]
    assert recv_x.shape == (worst, x.shape[1]) and recv_idx.shape == recv_probs.shape == (worst, mine.idx.shape[1])
    _eq("padded recv_x head", recv_x[:r].detach(), want.x)
    _eq("padded recv_x tail", recv_x[r:].detach(), torch.zeros(worst - r, x.shape[1], dtype=torch.float64))
    _eq("padded recv_idx", recv_idx, torch.cat([want.idx, torch.full((worst - r, want.idx.shape[1]), -1)]))
    _eq("padded recv_probs", recv_probs, torch.cat([want.probs, torch.zeros(worst - r, want.idx.shape[1])]))
    assert isinstance(counts, torch.Tensor) and counts.tolist() == want.counts, (counts, want.counts)
    assert handle.recv_rows == worst and int(handle.num_recv) == r
    out = moe_combine(recv_x * 2, None, handle)
    _close("padded combine", out, mine.x * 2 * n_dest, 1e-15)
    out.sum().backward()
    _close("padded grad x", x.grad, (2 * n_dest).expand_as(mine.x), 1e-15)
    # too small: nothing raises (that would need a host read); a rank keeps its first rows in
    # receive order, counts only those, and num_recv still tells how many arrived
    recv_x, recv_idx, _, counts, handle = moe_dispatch(ctx.to(mine.x), ctx.to(mine.idx), None, mine.num_experts,
                                                       None, num_worst_tokens=1)
    kept = min(r, 1)
    _eq("overflow recv_x", recv_x[:kept], want.x[:kept])
    _eq("overflow recv_idx", recv_idx[:kept], want.idx[:kept])
    want_counts = torch.zeros(len(want.counts), dtype=torch.int64)
    for lid in want.idx[:kept].reshape(-1).tolist():
        want_counts[lid] += lid >= 0
    _eq("overflow counts", counts, want_counts)
    assert int(handle.num_recv) == r and moe_combine(recv_x, None, handle).shape == mine.x.shape
    dist.barrier()


def check_grads(ctx: Ctx, seed=3, sizes=SMALL):
    """L = sum_src <g_src, combine(recv_x * (c_r + sum_j recv_probs))>; in closed form,
    dL/dx[t] = g[t] * sum_{r in D(t)} (c_r + s_r(t)) and dL/dp[t, j] = <g[t], x[t]> for idx[t, j] >= 0,
    with s_r(t) the sum of t's probabilities of experts on rank r and c_r = 1 + r."""
    from turbo_dispatch.ops.moe import moe_combine, moe_dispatch

    cases = ctx.cases(seed, **sizes)
    mine = cases[ctx.rank]
    local = mine.num_experts // ctx.world
    x = ctx.to(mine.x).requires_grad_()
    probs = ctx.to(mine.probs).requires_grad_()
    recv_x, recv_idx, recv_probs, _, handle = moe_dispatch(x, ctx.to(mine.idx), probs, mine.num_experts, None)
    scale = (1.0 + ctx.rank) + recv_probs.sum(1, keepdim=True).double()
    out = moe_combine(recv_x * scale, None, handle)
    (out * ctx.to(mine.grad_out)).sum().backward()

    factor = torch.zeros(mine.x.shape[0], 1, dtype=torch.float64)
    for t, ranks in enumerate(mine.dest_ranks(ctx.world)):
        for r in ranks:
            s = sum(float(mine.probs[t, j]) for j, e in enumerate(mine.idx[t].tolist()) if e >= 0 and e // local == r)
            factor[t] += 1.0 + r + s
    want_x = mine.grad_out * factor
    want_p = ((mine.grad_out * mine.x).sum(1, keepdim=True) * (mine.idx >= 0)).to(torch.float32)
    _close("grad x", x.grad, want_x, 1e-6)
    _close("grad token_probs", probs.grad, want_p, 1e-6)
    _close("combine forward", out, mine.x * factor, 1e-6)


def check_errors_local(ctx: Ctx, seed=4, sizes=SMALL):
    """Argument errors raise before any communication, with messages that name the argument."""
    from turbo_dispatch.ops.moe import moe_dispatch

    c = ctx.cases(seed, **sizes)[ctx.rank]
    x, idx, p, e = ctx.to(c.x), ctx.to(c.idx), ctx.to(c.probs), c.num_experts
    _raises(ValueError, "x must be a 2-D tensor", moe_dispatch, x[None], idx, p, e, None)
    _raises(ValueError, "token_indices must be [num_tokens=", moe_dispatch, x,
            idx.new_full((x.shape[0] + 1, idx.shape[1]), -1), p, e, None)
    _raises(ValueError, "token_probs must have token_indices' shape", moe_dispatch, x, idx, p[:, :1], e, None)
    _raises(TypeError, "token_indices must be int64", moe_dispatch, x, idx.int(), p, e, None)
    _raises(TypeError, "token_probs.dtype must be one of float32, bfloat16", moe_dispatch, x, idx, p.double(), e,
            None)
    _raises(TypeError, "x.dtype must be one of", moe_dispatch, x.to(torch.int32), idx, p, e, None)
    _raises(ValueError, "must be divisible by the group size", moe_dispatch, x, idx, p, ctx.world * 3 + 1, None)
    _raises(ValueError, "num_experts must be >= 1", moe_dispatch, x, idx, p, 0, None)
    _raises(ValueError, "num_worst_tokens must be >= 0", moe_dispatch, x, idx, p, e, None, num_worst_tokens=-1)
    _raises(TypeError, "async_finish must be a bool", moe_dispatch, x, idx, p, e, None, async_finish=1)
    _raises(TypeError, "group must be a torch.distributed.ProcessGroup", moe_dispatch, x, idx, p, e, "world")


def check_errors_collective(ctx: Ctx, seed=5, sizes=SMALL):
    """A bad expert id on one rank makes EVERY rank raise (and the group stays usable)."""
    from turbo_dispatch.ops.moe import moe_dispatch

    c = ctx.cases(seed, **sizes)[ctx.rank]
    last = ctx.world - 1
    for bad_rank, bad_value in ((last, c.num_experts), (0, -2)):
        idx = c.idx.clone()
        if ctx.rank == bad_rank:
            idx = torch.full((max(c.idx.shape[0], 1), c.idx.shape[1]), -1)
            idx[0, 0] = bad_value
        x = torch.randn(idx.shape[0], c.x.shape[1], dtype=torch.float64)
        msg = _raises(ValueError, f"rank {bad_rank}", moe_dispatch, ctx.to(x), ctx.to(idx), None, c.num_experts, None)
        assert "[-1, num_experts=" in msg and (("(this rank)" in msg) == (ctx.rank == bad_rank)), msg
    check_dispatch_combine(ctx, seed=6)  # still in step with the other ranks


def check_handle_errors(ctx: Ctx, seed=7, sizes=SMALL):
    from turbo_dispatch.ops.moe import moe_combine, moe_dispatch, moe_dispatch_cached

    c = ctx.cases(seed, **sizes)[ctx.rank]
    recv_x, _, _, _, handle = moe_dispatch(ctx.to(c.x), ctx.to(c.idx), ctx.to(c.probs), c.num_experts, None)
    _raises(TypeError, "handle must be the MoeHandle", moe_combine, recv_x, None, (1, 2))
    _raises(ValueError, f"must have {handle.recv_rows} rows", moe_combine, torch.cat([recv_x, recv_x[:1]])
            if recv_x.shape[0] else recv_x.new_zeros(1, recv_x.shape[1]), None, handle)
    _raises(TypeError, "x.dtype must be one of", moe_combine, recv_x.to(torch.float8_e4m3fn), None, handle)
    _raises(ValueError, "one row per dispatched token", moe_dispatch_cached, recv_x.new_zeros(c.x.shape[0] + 1, 2),
            None, handle)
    if ctx.world > 1:
        mine, _ = dist.new_subgroups(group_size=1)  # collective: every rank builds every subgroup
        _raises(ValueError, f"a group of {ctx.world} ranks; this group has 1", moe_combine, recv_x, mine, handle)
    dist.barrier()


def check_buffer(ctx: Ctx, seed=8, sizes=SMALL):
    from turbo_dispatch.moe_buffer import Buffer

    cases = ctx.cases(seed, **sizes)
    mine, want = cases[ctx.rank], Expected(cases, ctx.rank, ctx.world)
    n_dest = torch.tensor([len(d) for d in mine.dest_ranks(ctx.world)], dtype=torch.float64)[:, None]
    buf = Buffer(None, num_nvl_bytes=1 << 20)
    assert buf.group_size == ctx.world and buf.rank == ctx.rank
    x, idx, w = ctx.to(mine.x.float()), ctx.to(mine.idx), ctx.to(mine.probs)
    per_rank, rdma, per_expert, in_rank, event = buf.get_dispatch_layout(idx, mine.num_experts)
    assert rdma is None and event is None and per_rank.dtype == per_expert.dtype == torch.int32
    dests = mine.dest_ranks(ctx.world)
    want_in = torch.zeros(mine.x.shape[0], ctx.world, dtype=torch.bool)
    for t, ranks in enumerate(dests):
        want_in[t, ranks] = True
    _eq("is_token_in_rank", in_rank, want_in)
    _eq("num_tokens_per_rank", per_rank, want_in.sum(0).int())
    valid = mine.idx[mine.idx >= 0]
    _eq("num_tokens_per_expert", per_expert, torch.bincount(valid, minlength=mine.num_experts).int())

    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=w, expert_alignment=4, async_finish=True)
    assert event is None
    _eq("Buffer recv_x", recv_x, want.x.float())
    _eq("Buffer recv_topk_idx", recv_idx, want.idx)
    _eq("Buffer recv_topk_weights", recv_w, want.probs)
    assert counts == [-(-n // 4) * 4 for n in want.counts], (counts, want.counts)
    # cached mode: other rows of the same tokens, and DeepEP's (fp8, scales) tuple
    extra = []
    for src, case in enumerate(cases):
        other = copy.copy(case)
        other.x = torch.randn(case.x.shape[0], 5, generator=torch.Generator().manual_seed(src), dtype=torch.float64)
        extra.append(other)
    got = buf.dispatch(ctx.to(extra[ctx.rank].x), handle=handle)
    assert got[1:] == (None,) * 5
    _eq("cached dispatch", got[0], Expected(extra, ctx.rank, ctx.world).x)
    data = ctx.to(mine.x.to(torch.float8_e4m3fn))
    scales = ctx.to(mine.x[:, :2].float().abs() + 1)
    (rd, rs), *_ = buf.dispatch((data, scales), handle=handle)
    _eq("cached fp8 data", rd.view(torch.uint8), want.x.to(torch.float8_e4m3fn).view(torch.uint8))
    _eq("cached scales", rs, want.x[:, :2].float().abs() + 1)
    (rd, rs), _, _, counts2, _, _ = buf.dispatch((data, scales), num_tokens_per_expert=per_expert, topk_idx=idx,
                                                 topk_weights=w)
    _eq("fp8 tuple data", rd.view(torch.uint8), want.x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert counts2 == want.counts
    # combine: rows summed back; weights restored where the expert was dispatched; bias added
    bias = ctx.to(torch.full(mine.x.shape, 0.5, dtype=torch.float32))
    y, y_w, event = buf.combine(recv_x, handle, topk_weights=recv_w, bias=(bias, None))
    assert event is None
    _close("Buffer combine", y, mine.x.float() * n_dest.float() + 0.5, 1e-6)
    _eq("Buffer combined weights", y_w, torch.where(mine.idx >= 0, mine.probs, torch.zeros(())))
    y2, none, _ = buf.combine(recv_x, handle)
    assert none is None
    _close("Buffer combine without weights", y2, mine.x.float() * n_dest.float(), 1e-6)
    _raises(NotImplementedError, "low_latency_mode", Buffer, None, low_latency_mode=True)
    _raises(ValueError, "topk_idx and num_tokens_per_expert", buf.dispatch, x)
    dist.barrier()


def check_resolver(ctx: Ctx, seed=9, sizes=SMALL):
    """Global autotuning does not break the op (it is recorded as not tunable); code pins work."""
    import turbo_dispatch as turbo
    from turbo_dispatch.ops.moe import group_is_intranode, moe_dispatch

    c = ctx.cases(seed, **sizes)[ctx.rank]
    args = (ctx.to(c.x), ctx.to(c.idx), ctx.to(c.probs), c.num_experts, None)
    try:
        turbo.GlobalBackendManager.set_auto_tune(True)
        moe_dispatch(*args)
        d = turbo.explain("moe_dispatch_combine", *args)
        if PINNED is None:
            assert d.backend == expected_backend(ctx) and d.source == "default", d
            assert group_is_intranode() and group_is_intranode(ask_peers=False), "every rank runs on this host"
            assert any("not tunable without a process group" in n for n in d.notes), d.notes
        else:
            assert d.backend == PINNED, d
        turbo.GlobalBackendManager.reset()
        turbo.GlobalBackendManager.set_moe_dispatch_combine_backend(PINNED or "TORCH")
        d = turbo.explain("moe_dispatch_combine", *args)
        assert d.source == "code" and f"world_size={ctx.world}" in d.key, d
        moe_dispatch(*args)
    finally:
        turbo.GlobalBackendManager.reset()
    dist.barrier()


def check_captured_step(ctx: Ctx, seed=13, sizes=SMALL):
    """With num_worst_tokens, dispatch + combine captured in one CUDA graph and replayed on new
    token values and new routing give what eager calls give (GPUs only: NCCL or symmetric memory)."""
    from turbo_dispatch.ops.moe import moe_combine, moe_dispatch

    if ctx.device.type != "cuda":
        return
    first, second = ctx.cases(seed, **sizes), ctx.cases(seed + 100, **sizes)
    worst = sum(c.x.shape[0] for c in first + second)
    mine = first[ctx.rank]
    x, idx, probs = ctx.to(mine.x.float()), ctx.to(mine.idx), ctx.to(mine.probs)

    def step():
        recv_x, recv_idx, recv_probs, counts, handle = moe_dispatch(x, idx, probs, mine.num_experts, None,
                                                                    num_worst_tokens=worst)
        weight = 1 + recv_probs.sum(1, keepdim=True)
        return moe_combine(recv_x * weight, None, handle), recv_x, counts

    step()  # eager: sizes buffers and compiles kernels, which capture cannot do
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s, recv_s, counts_s = step()
    for cases in (first, second):
        other = cases[ctx.rank]
        x.copy_(ctx.to(other.x.float()))
        idx.copy_(ctx.to(other.idx))
        probs.copy_(ctx.to(other.probs))
        graph.replay()
        torch.cuda.synchronize()
        want_out, want_recv, want_counts = step()
        _eq("captured recv_x", recv_s, want_recv)
        _eq("captured counts", counts_s, want_counts)
        _close("captured combine", out_s, want_out, 1e-6)
        want = Expected(cases, ctx.rank, ctx.world)
        _close("captured recv_x vs reference", recv_s[: want.x.shape[0]].double(), want.x.float().double(), 1e-6)
    dist.barrier()


def check_repeated_worst_tokens(ctx: Ctx, seed=15, sizes=SMALL):
    """Same-shape ``num_worst_tokens`` calls on new data (a backend may replay a captured graph for
    them), with every handle and output held until the end and combined in reverse order, as a
    model's backward does: each call's results stay its own."""
    from turbo_dispatch.ops.moe import moe_combine, moe_dispatch

    rounds = [ctx.cases(seed + i, **sizes) for i in range(4)]
    worst = max(sum(c.x.shape[0] for c in cases) for cases in rounds)
    held = []
    for cases in rounds:
        mine = cases[ctx.rank]
        out = moe_dispatch(ctx.to(mine.x), ctx.to(mine.idx), ctx.to(mine.probs), mine.num_experts, None,
                           num_worst_tokens=worst)
        held.append((cases, out))
    for cases, (recv_x, recv_idx, recv_probs, counts, handle) in reversed(held):
        mine, want = cases[ctx.rank], Expected(cases, ctx.rank, ctx.world)
        r = want.x.shape[0]
        _eq("repeated recv_x", recv_x[:r], want.x)
        _eq("repeated recv_idx", recv_idx[:r], want.idx)
        _eq("repeated recv_probs", recv_probs[:r], want.probs)
        _eq("repeated padding", recv_idx[r:], torch.full((worst - r, want.idx.shape[1]), -1))
        assert counts.tolist() == want.counts and int(handle.num_recv) == r, (counts, want.counts)
        n_dest = torch.tensor([len(d) for d in mine.dest_ranks(ctx.world)], dtype=torch.float64)[:, None]
        _close("repeated combine", moe_combine(recv_x * 3, None, handle), mine.x * 3 * n_dest, 1e-15)
    dist.barrier()


CHECKS = {
    "dispatch_combine": check_dispatch_combine,
    "worst_tokens": check_worst_tokens,
    "grads": check_grads,
    "errors_local": check_errors_local,
    "errors_collective": check_errors_collective,
    "handle_errors": check_handle_errors,
    "buffer": check_buffer,
    "resolver": check_resolver,
    "repeated_worst_tokens": check_repeated_worst_tokens,
}
GPU_EXTRA = {
    "large_dispatch_combine": lambda ctx: check_dispatch_combine(ctx, seed=11, sizes=LARGE),
    "large_grads": lambda ctx: check_grads(ctx, seed=12, sizes=LARGE),
    "large_worst_tokens": lambda ctx: check_worst_tokens(ctx, seed=14, sizes=LARGE),
    "captured_step": check_captured_step,
}


def run_checks(ctx: Ctx, checks: dict) -> dict:
    results = {}
    for name, fn in checks.items():
        try:
            fn(ctx)
            results[name] = "ok"
        except Exception:  # record and go on: one broken check must not hide the others
            results[name] = "FAIL " + traceback.format_exc(limit=4)[-1500:]
    return results


def one_rank_group():
    """Generator for a module-scoped pytest fixture: a one-rank gloo group in this process (skips if
    a group already exists)."""
    import pytest

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _chosen(checks: str) -> dict:
    """``"cpu"``, ``"gpu"`` (CHECKS plus the large GPU cases) or ``"module:ATTR"``, a dict of checks
    another test module defines (imported in the worker process)."""
    if ":" in checks:
        import importlib

        module, attr = checks.split(":")
        return getattr(importlib.import_module(module), attr)
    return dict(CHECKS, **(GPU_EXTRA if checks == "gpu" else {}))


def worker(rank: int, world: int, port: int, backend: str, results, checks: str = "cpu") -> None:
    """torch.multiprocessing target: init the group, run the checks, store {name: "ok" | failure}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = "cpu"
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=90))
    try:
        results[rank] = run_checks(Ctx(rank, world, device), _chosen(checks))
    finally:
        dist.destroy_process_group()


def spawn(world: int, backend: str, checks: str = "cpu", timeout: float = 240.0) -> dict:
    """Runs ``worker`` on ``world`` fresh processes; returns {rank: {check: result}}."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=worker, args=(r, world, port, backend, results, checks)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        out = {r: dict(results.get(r, {})) for r in range(world)}
        codes = {r: p.exitcode for r, p in enumerate(procs)}
    for r, code in codes.items():
        if code != 0:
            out[r]["__process__"] = f"FAIL exit code {code}"
    return out
