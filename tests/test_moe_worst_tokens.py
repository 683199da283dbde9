"""moe_dispatch / moe_combine with ``num_worst_tokens`` (no host sync) and with fp8 payloads.

On 2 and 3 gloo processes (3 ranks include a rank with no tokens): the ``num_worst_tokens`` path,
run with every host-reading tensor call made to raise, gives bit for bit what the synchronising
path gives (forward, combine and gradients) for random, skewed and bad-id routing, fp32/bf16/fp64
rows and fp32/bf16/no probabilities; fp8 activations (a blockwise QuantizedTensor or DeepEP's
``(x_fp8, scales)`` pair) arrive with their scales, ready for ``grouped_gemm_fp8``.
"""
from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

import moe_checks
from moe_checks import SMALL, Expected, _eq, _raises

#: Tensor methods and torch functions that read device data on the host (a sync on GPUs).
SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")
SYNCING_FUNCTIONS = ("nonzero", "argwhere", "unique", "unique_consecutive", "bincount", "masked_select")


@contextlib.contextmanager
def no_host_reads():
    """Makes every call that copies tensor data to the host raise AssertionError while active.

    On a CPU nothing actually synchronises, so this is how a CPU test shows that a code path never
    asks for a host read, the property that lets it run without a sync (and be captured) on GPUs.
    ``repeat_interleave`` is allowed with an int count only (a tensor count sizes its output on the host).
    """
    saved = []

    def replace(owner, name, fn):
        saved.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, fn)

    def forbid(name):
        def raiser(*_args, **_kwargs):
            raise AssertionError(f"host read inside a no-sync path: {name}")
        return raiser

    def checked_repeat_interleave(original):
        def repeat_interleave(*args, **kwargs):
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
            if isinstance(repeats, torch.Tensor):
                raise AssertionError("host read inside a no-sync path: repeat_interleave with tensor repeats")
            return original(*args, **kwargs)
        return repeat_interleave

    for name in SYNCING_METHODS:
        replace(torch.Tensor, name, forbid(f"Tensor.{name}"))
    for name in SYNCING_FUNCTIONS:
        replace(torch, name, forbid(f"torch.{name}"))
    replace(torch.Tensor, "repeat_interleave", checked_repeat_interleave(torch.Tensor.repeat_interleave))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _route(cases, routing: str, world: int):
    """Rewrites every case's ids: ``random`` keeps them, ``skewed`` sends every expert slot to rank 0's
    experts, ``bad`` plants ids outside [-1, num_experts) (returned ``clean`` ids hold -1 there)."""
    clean = []
    for src, case in enumerate(cases):
        idx = case.idx
        local = case.num_experts // world
        if routing == "skewed":
            idx = torch.where(idx >= 0, idx % local, idx)
        good = idx.clone()
        if routing == "bad" and idx.shape[0] > 1:
            idx = idx.clone()
            idx[1, 0] = case.num_experts + src
            idx[-1, -1] = -2 - src
            good = torch.where((idx >= 0) & (idx < case.num_experts), idx, -1)
        case.idx = idx
        clean.append(good)
    return clean


def _step(ctx, x, idx, probs, num_experts, g, worst):
    """dispatch -> scale rows by their probabilities -> combine -> backward; returns every output."""
    from turbo_dispatch.ops.moe import moe_combine, moe_dispatch

    recv_x, recv_idx, recv_probs, counts, handle = moe_dispatch(x, idx, probs, num_experts, None,
                                                                num_worst_tokens=worst)
    scale = 2.0 if recv_probs is None else 1 + recv_probs.sum(1, keepdim=True).to(x.dtype)
    out = moe_combine(recv_x * scale, None, handle)
    (out.float() * g).sum().backward()
    return recv_x.detach(), recv_idx, recv_probs, counts, handle, out.detach()


def check_matches_sync(ctx: moe_checks.Ctx, seed=21):
    """The no-sync path equals the synchronising one bit for bit, with no host read anywhere in it."""
    for routing in ("random", "skewed", "bad"):
        cases = ctx.cases(seed, **SMALL)
        clean = _route(cases, routing, ctx.world)
        mine = cases[ctx.rank]
        worst = sum(c.x.shape[0] for c in cases)  # rank-uniform, at least any rank's receive count
        g = ctx.to(mine.grad_out.float())
        for dtype, pdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float64, None)):
            runs = []
            for guard, ids, w in ((contextlib.nullcontext(), clean[ctx.rank], 0), (no_host_reads(), mine.idx, worst)):
                x = ctx.to(mine.x.to(dtype)).requires_grad_()
                p = None if pdtype is None else ctx.to(mine.probs.to(pdtype)).requires_grad_()
                with guard:
                    outs = _step(ctx, x, ctx.to(ids), p, mine.num_experts, g, w)
                runs.append(outs + (x.grad, None if p is None else p.grad))
            (rx, ri, rp, rc, rh, ro, gx, gp), (fx, fi, fp, fc, fh, fo, fgx, fgp) = runs
            what = f"{routing} {dtype} probs={pdtype}"
            r = rx.shape[0]
            assert fx.shape[0] == worst and int(fh.num_recv) == r, what
            _eq(f"{what} recv_x", fx[:r], rx)
            _eq(f"{what} recv_x padding", fx[r:], torch.zeros_like(fx[r:]))
            _eq(f"{what} recv_idx", fi, torch.cat([ri, ri.new_full((worst - r, ri.shape[1]), -1)]))
            if rp is not None:
                _eq(f"{what} recv_probs", fp.detach(), torch.cat([rp.detach(), rp.new_zeros(worst - r, rp.shape[1])]))
            assert isinstance(fc, torch.Tensor) and fc.tolist() == rc, (what, fc, rc)
            _eq(f"{what} combine", fo, ro)
            _eq(f"{what} grad x", fgx, gx)
            if gp is not None:
                _eq(f"{what} grad probs", fgp, gp)
            if routing == "random" and dtype == torch.float32:
                want = Expected(cases, ctx.rank, ctx.world)
                _eq("recv_x against the reference", fx[:r], want.x.float())


def check_cached_no_sync(ctx: moe_checks.Ctx, seed=22):
    """A cached dispatch along a no-sync handle, and its backward, read nothing on the host."""
    from turbo_dispatch.moe_buffer import Buffer
    from turbo_dispatch.ops.moe import moe_dispatch, moe_dispatch_cached

    cases = ctx.cases(seed, **SMALL)
    mine, want = cases[ctx.rank], Expected(cases, ctx.rank, ctx.world)
    worst = sum(c.x.shape[0] for c in cases)
    other = ctx.to(mine.x[:, :4].float()).requires_grad_()
    with no_host_reads():
        *_, handle = moe_dispatch(ctx.to(mine.x), ctx.to(mine.idx), None, mine.num_experts, None,
                                  num_worst_tokens=worst)
        recv = moe_dispatch_cached(other, None, handle)
        recv.sum().backward()
    r = want.x.shape[0]
    _eq("cached rows", recv[:r].detach(), want.x[:, :4].float())
    _eq("cached padding", recv[r:].detach(), torch.zeros(worst - r, 4))
    n_dest = torch.tensor([len(d) for d in mine.dest_ranks(ctx.world)], dtype=torch.float32)[:, None]
    _eq("cached backward", other.grad, n_dest.expand(-1, 4).contiguous())
    # the Buffer facade: the same no-sync dispatch, counts aligned on the device
    buf = Buffer(None)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(ctx.to(mine.idx), mine.num_experts)
    with no_host_reads():
        recv_x, _, _, counts, _, _ = buf.dispatch(ctx.to(mine.x), num_tokens_per_expert=per_expert,
                                                  topk_idx=ctx.to(mine.idx), expert_alignment=4,
                                                  num_worst_tokens=worst)
    _eq("Buffer no-sync recv_x", recv_x[:r], want.x)
    _eq("Buffer aligned counts", counts, torch.tensor([-(-n // 4) * 4 for n in want.counts]))


def check_fp8_payloads(ctx: moe_checks.Ctx, seed=23):
    """fp8 rows and their 1 x 128 scales arrive as they left; grouped_gemm_fp8 takes them as they are."""
    import turbo_dispatch as turbo
    from turbo_dispatch.low_precision import Float8QuantConfig, QuantizedTensor, ScalingRecipe, quantize
    from turbo_dispatch.ops.moe import moe_dispatch

    sizes = dict(hidden=256, topk=2, local_experts=2)
    cases = ctx.cases(seed, **sizes)
    mine, want = cases[ctx.rank], Expected(cases, ctx.rank, ctx.world)
    total = sum(c.x.shape[0] for c in cases)
    q = quantize(ctx.to(mine.x.float()), torch.float8_e4m3fn, "blockwise", block_size=128)
    wq = quantize(want.x.float(), torch.float8_e4m3fn, "blockwise", block_size=128)  # per-row scales: same rows
    w = torch.randn(1, 64, 256, generator=torch.Generator().manual_seed(seed))
    qw = QuantizedTensor.quantize(w, torch.float8_e4m3fn, "blockwise", axis=-1, block_size=128,
                                  scaling_recipe=ScalingRecipe(use_2d_block=True))
    cfg = Float8QuantConfig(granularity="blockwise", block_size=128)
    r = want.x.shape[0]
    lens = torch.tensor([r])
    want_out = turbo.ops.grouped_gemm_fp8(wq, qw, lens, config=cfg, out_dtype=torch.float32)
    for worst in (0, total):
        guard = no_host_reads() if worst else contextlib.nullcontext()
        with guard:
            recv_q, *_ = moe_dispatch(q, ctx.to(mine.idx), ctx.to(mine.probs), mine.num_experts, None,
                                      num_worst_tokens=worst)
            (rd, rs), *_ = moe_dispatch((q.data, q.scale), ctx.to(mine.idx), None, mine.num_experts, None,
                                        num_worst_tokens=worst)
        rows = worst or r
        assert isinstance(recv_q, QuantizedTensor) and recv_q.block_size == 128 and recv_q.axis == 1
        assert recv_q.granularity == q.granularity and recv_q.data.shape == (rows, 256)
        for name, data, scale in (("QuantizedTensor", recv_q.data, recv_q.scale), ("pair", rd, rs)):
            assert data.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, name
            _eq(f"{name} fp8 rows", data[:r].view(torch.uint8), wq.data.view(torch.uint8))
            _eq(f"{name} scales", scale[:r], wq.scale)
            _eq(f"{name} padding", data[r:].view(torch.uint8), torch.zeros(rows - r, 256, dtype=torch.uint8))
            _eq(f"{name} padding scales", scale[r:], torch.zeros(rows - r, 2))
        got = turbo.ops.grouped_gemm_fp8(recv_q, qw, lens, config=cfg, out_dtype=torch.float32)
        _eq(f"grouped_gemm_fp8 on received rows (num_worst_tokens={worst})", got[:r], want_out)
        _eq("grouped_gemm_fp8 padding rows", got[r:], torch.zeros(rows - r, 64))
    dist.barrier()


WORST_CHECKS = {
    "matches_sync": check_matches_sync,
    "cached_no_sync": check_cached_no_sync,
    "fp8_payloads": check_fp8_payloads,
}


@functools.lru_cache(maxsize=None)
def _gloo_results(world: int) -> dict:
    return moe_checks.spawn(world, "gloo", checks="test_moe_worst_tokens:WORST_CHECKS")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("check", list(WORST_CHECKS))
def test_multi_rank(world, check):
    results = _gloo_results(world)
    failures = {r: res.get(check, "missing") for r, res in results.items() if res.get(check) != "ok"}
    process = {r: res["__process__"] for r, res in results.items() if "__process__" in res}
    assert not failures and not process, f"{check} on {world} ranks: {failures or process}"


def test_guard_catches_host_reads():
    t = torch.arange(4)
    with no_host_reads():
        for read in (lambda: t.sum().item(), lambda: t.tolist(), lambda: bool(t[0]), lambda: t.nonzero(),
                     lambda: torch.bincount(t), lambda: t.repeat_interleave(t)):
            with pytest.raises(AssertionError, match="host read"):
                read()
        assert t.repeat_interleave(2).shape == (8,)
    assert t.sum().item() == 6 and bool(t[1]) and "__bool__" not in torch.Tensor.__dict__


# -- in process, on a one-rank group -----------------------------------------------------------------
one_rank = pytest.fixture(scope="module")(moe_checks.one_rank_group)


def test_fp8_payload_errors(one_rank):
    from turbo_dispatch.low_precision import quantize
    from turbo_dispatch.ops.moe import moe_dispatch

    x = torch.randn(5, 256)
    idx = torch.zeros(5, 1, dtype=torch.int64)
    q = quantize(x, torch.float8_e4m3fn, "blockwise", block_size=128)
    with pytest.raises(ValueError, match="quantised along hidden with row or 1-D block scales"):
        moe_dispatch(quantize(x, torch.float8_e4m3fn, "blockwise", block_size=128, block_2d=True), idx, None, 2)
    with pytest.raises(ValueError, match="quantised along hidden"):
        moe_dispatch(quantize(x, torch.float8_e4m3fn, "tensorwise"), idx, None, 2)
    with pytest.raises(ValueError, match=r"scales must be \[num_tokens=5"):
        moe_dispatch((q.data, q.scale[:4]), idx, None, 2)
    with pytest.raises(TypeError, match="must be a 2-D float8 tensor"):
        moe_dispatch((x, q.scale), idx, None, 2)
    with pytest.raises(TypeError, match="scales of an .x_fp8, scales. pair must be float32"):
        moe_dispatch((q.data, q.scale.int()), idx, None, 2)
    with pytest.raises(TypeError, match="DeepEP's .x_fp8"):
        moe_dispatch((q.data,), idx, None, 2)


def test_explain_and_handle(one_rank):
    import turbo_dispatch as turbo
    from turbo_dispatch.low_precision import quantize
    from turbo_dispatch.ops.moe import moe_dispatch

    x = torch.randn(5, 256)
    idx = torch.tensor([[0], [1], [-1], [1], [0]])
    q = quantize(x, torch.float8_e4m3fn, "blockwise", block_size=128)
    d = turbo.explain("moe_dispatch_combine", q, idx, None, 2, None, num_worst_tokens=8)
    assert "dtype=e4m3" in d.key and "num_worst_tokens=8" in d.key, d.key
    assert any("no host read" in n for n in d.notes), d.notes
    _, _, _, counts, handle = moe_dispatch(x, idx, torch.rand(5, 1, dtype=torch.bfloat16), 2, num_worst_tokens=8)
    assert counts.tolist() == [2, 2] and "num_recv=on device, recv_rows=8" in repr(handle)
    _raises(ValueError, "must have 8 rows", turbo.ops.moe_combine, x, None, handle)


@pytest.mark.parametrize("hidden, scale_dtype, scales", [(256, torch.float32, 2), (20, torch.float32, 1),
                                                         (7, torch.bfloat16, 3), (7168, torch.float64, 56)])
def test_fp8_rows_and_scales_travel_packed_in_one_row(hidden, scale_dtype, scales):
    """``pack_rows`` puts each token's fp8 bytes and scale bytes in one row (scales 16-byte aligned,
    rows padded to 16 bytes); ``unpack_rows`` gives both back bit for bit and contiguous, also for
    padding rows of zeros (zero data, zero scales)."""
    from turbo_dispatch.ops.moe_fp8 import pack_rows, packed_layout, unpack_rows

    data = torch.randn(9, hidden).to(torch.float8_e4m3fn)
    scale = torch.rand(9, scales, dtype=torch.float64).to(scale_dtype)
    offset, nbytes, width = packed_layout(hidden, scale)
    assert offset % 16 == 0 and width % 16 == 0 and offset >= hidden and width >= offset + nbytes
    packed = pack_rows(data, scale)
    assert packed.shape == (9, width) and packed.dtype == data.dtype
    rows = torch.cat([packed, torch.zeros(2, width, dtype=torch.uint8).view(packed.dtype)])
    got_data, got_scale = unpack_rows(rows, hidden, scale)
    assert got_data.is_contiguous() and got_scale.is_contiguous()
    assert torch.equal(got_data[:9].view(torch.uint8), data.view(torch.uint8)) and torch.equal(got_scale[:9], scale)
    assert not got_data[9:].view(torch.uint8).any() and not got_scale[9:].any()


def test_fp8_dispatch_key_is_the_packed_row(one_rank):
    """explain shows the key moe_dispatch resolves for an fp8 payload: the packed row's width."""
    import turbo_dispatch as turbo
    from turbo_dispatch.low_precision import quantize
    from turbo_dispatch.ops.moe_fp8 import packed_layout

    q = quantize(torch.randn(5, 256), torch.float8_e4m3fn, "blockwise", block_size=128)
    idx = torch.zeros(5, 1, dtype=torch.int64)
    decision = turbo.explain("moe_dispatch_combine", q, idx, None, 2)
    assert decision.problem.hidden == packed_layout(256, q.scale)[2] != 256
