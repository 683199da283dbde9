#!/usr/bin/env python3
"""MoE dispatch / combine per backend, against NCCL's own all_to_all_single and a peer-to-peer copy
of the same bytes, all measured in the same run.

One process per GPU talking over NCCL, launched by torchrun or spawned by the script itself
(``--nproc``); on a CPU the processes talk over gloo (``--quick``: a smoke run whose timings mean
nothing). For every model shape x tokens per rank x routing x payload, the report has these rows:

* ``turbo <BACKEND>`` for every backend registered for ``moe_dispatch_combine`` (one that is not
  available or whose ``supports()`` refuses the problem gets a SKIP row saying why): dispatch and
  combine time and bandwidth, and each time as a ratio to the raw all_to_all_single below
  (``x a2a`` = a2a time / backend time: 1 matches NCCL, more beats it);
* ``turbo <BACKEND> no-sync``: one dispatch + combine round trip with ``num_worst_tokens`` (no host
  read), in microseconds and as a multiple of one raw all_to_all_single, for token counts up to
  ``--worst-max-tokens``. N is the most rows any rank receives (the tightest valid worst case);
* ``torch all_to_all_single``: the same rows with the same split sizes and bytes (the payload as
  uint8 rows: bf16 rows, or fp8 data + scales), out (dispatch) and back (combine);
* ``p2p copy to next rank``: ``copy_`` of the same byte count from this GPU into a buffer on the
  next rank's GPU (peer access: the copy engine over NVLink where the GPUs have it), every rank at
  once: the link's limit. A CPU run has no such row's numbers.

Timing: before each round every rank meets at a barrier (then synchronises its device); CUDA events
bracket one call (``perf_counter`` on a CPU); untimed warm-up rounds come first. A row's time is the
median of its timed rounds on each rank, then the max over the ranks. A dispatch's host sync and the
host work after it fall inside the window, as in training. Combine is timed on the handle of an
untimed dispatch. Bandwidth: GB/s = the payload bytes of the rank that receives the most from OTHER
ranks (dispatch: token rows, fp8 data + scales; combine: the bf16 rows coming back) / the row's
time (1 GB = 1e9 bytes). fp8 rows time dispatch only: combine moves bf16 rows, as in the bf16 row.

Correctness, per turbo row: the received rows equal the reference bit for bit (every rank
regenerates every rank's inputs from per-rank seeds), and so do the received local expert ids and
probabilities; combine(received bf16 rows) equals ``x * (number of destination ranks)`` per token,
which fp32 accumulation gives exactly in bf16. The raw all_to_all_single row checks its own output
the same way. A FAIL voids the row's timings.

Routing: ``uniform`` draws distinct top-k experts uniformly; ``skewed`` draws them (distinct, by
Gumbel top-k) with Zipf-like popularity ``1 / rank^1.2`` over the experts in a fixed random order,
so hot experts, and the rows they draw, pile up on some ranks.

Output: ``<out>/<gpu>_<date>_<name>.csv`` and ``.md`` (GPU, world size and date in the header),
rewritten after each configuration, so a run stopped early keeps what it measured. ``--out``
defaults to ``$TURBO_BENCH_OUT/moe``, else ``bench-out/moe``. The exit status is 1 when a row
FAILed (its configuration and backend are printed), 2 when there are too few GPUs, else 0.

Usage:
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_moe.py --out bench-out/moe
    python benchmarks/bench_moe.py --nproc 4 --models deepseek-v3 --tokens 128,4096
    python benchmarks/bench_moe.py --quick            # 2 gloo processes on the CPU: a smoke run
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from bench_out import resolve_out_dir
from harness import gpu_slug, profile_calls

HERE = Path(__file__).resolve().parent
OP = "moe_dispatch_combine"
FP8_BLOCK = 128
ZIPF = 1.2
COLUMNS = ["model", "hidden", "topk", "experts", "world", "tokens", "routing", "payload", "backend", "check",
           "dispatch_ms", "dispatch_gbps", "combine_ms", "combine_gbps", "dispatch_vs_a2a", "combine_vs_a2a",
           "round_trip_us", "rt_vs_a2a", "dispatch_host_us", "combine_host_us", "round_trip_host_us", "worst_tokens",
           "recv_mb", "back_mb", "note"]


@dataclass(frozen=True)
class Model:
    hidden: int
    topk: int
    experts: int


MODELS = {"deepseek-v3": Model(7168, 8, 256), "qwen3-235b": Model(4096, 8, 128), "mixtral": Model(4096, 2, 8)}
TOKENS = (128, 512, 4096, 16384)
QUICK_TOKENS = (16,)
ROUTINGS = ("uniform", "skewed")
PAYLOADS = ("bf16", "fp8")


@dataclass(frozen=True)
class Config:
    index: int
    model_name: str
    model: Model
    tokens: int
    routing: str
    payload: str

    def row(self, world: int, **values: Any) -> dict:
        m = self.model
        return dict(model=self.model_name, hidden=m.hidden, topk=m.topk, experts=m.experts, world=world,
                    tokens=self.tokens, routing=self.routing, payload=self.payload, **values)


# -- the process group -------------------------------------------------------------------------------
class Group:
    """This rank's view of the group: barriers, agreement across ranks, the device."""

    def __init__(self, rank: int, world: int, device: torch.device, local_rank: int, local_world: int):
        self.rank, self.world, self.device = rank, world, device
        self.local_rank, self.local_world = local_rank, local_world
        self.cuda = device.type == "cuda"

    def barrier(self) -> None:
        if self.cuda:
            dist.barrier(device_ids=[self.device.index])
            torch.cuda.synchronize(self.device)
        else:
            dist.barrier()

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def all_true(self, ok: bool) -> bool:
        return self.max(0.0 if ok else 1.0) == 0.0

    def notes(self, note: str) -> str:
        """Every rank's non-empty note, the same string on every rank: the note itself when every
        rank has it, else ``rank r: ...`` per rank, joined. Empty when no rank has one."""
        notes: list = [None] * self.world
        dist.all_gather_object(notes, note)
        if len(set(notes)) == 1:
            return notes[0]
        return "; ".join(f"rank {r}: {n}" for r, n in enumerate(notes) if n)


def timed(g: Group, fn: Callable[[Any], Any], setup: Optional[Callable[[], Any]], warmup: int,
          iters: int) -> tuple[float, float]:
    """``(ms, host_us)`` of ``fn(setup())``: per rank the median over ``iters`` rounds after ``warmup``
    untimed ones, each round entered together at a barrier, then the max over the ranks. ``ms`` is
    the whole call (CUDA events; ``perf_counter`` on a CPU); ``host_us`` is the host's time from the
    call to its return (what a CUDA call costs the issuing thread; the whole call on a CPU)."""
    times, host = [], []
    for i in range(warmup + iters):
        state = setup() if setup else None
        g.barrier()
        if g.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn(state)
            t1 = time.perf_counter()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn(state)
            t1 = time.perf_counter()
            ms = (t1 - t0) * 1e3
        if i >= warmup:
            times.append(ms)
            host.append((t1 - t0) * 1e6)
        del state
    return g.max(statistics.median(times)), g.max(statistics.median(host))


def profiled(g: Group, fn: Callable[[Any], Any], iters: int, path: Path) -> None:
    """Runs ``fn(None)`` (a collective) ``2 * iters`` times on every rank, rank 0 under cProfile and
    torch.profiler (``harness.profile_calls``), and writes rank 0's tables to ``path``."""
    g.barrier()
    if g.rank == 0:
        text = profile_calls(lambda: fn(None), iters, g.device, f"rank 0 of {g.world}")
    else:
        for _ in range(2 * iters):
            fn(None)
    g.barrier()
    if g.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"[bench_moe] profile: {path}", flush=True)


# -- inputs and the reference --------------------------------------------------------------------------
def source_inputs(cfg: Config, src: int, device: torch.device, seed: int):
    """Rank ``src``'s ``(x bf16 [T, H], token_indices [T, k], token_probs fp32 [T, k])``, the same on every rank."""
    m, t = cfg.model, cfg.tokens
    g = torch.Generator(device=device).manual_seed(((seed * 7919 + cfg.index) * 1009 + src) % (2 ** 63))
    x = torch.randn(t, m.hidden, generator=g, device=device, dtype=torch.bfloat16)
    u = torch.rand(t, m.experts, generator=g, device=device)
    if cfg.routing == "skewed":
        order = torch.randperm(m.experts, generator=torch.Generator().manual_seed(seed))
        log_pop = torch.empty(m.experts)
        log_pop[order] = -ZIPF * torch.log(torch.arange(1, m.experts + 1, dtype=torch.float32))
        u = log_pop.to(device) - torch.log(-torch.log(u.clamp_(1e-12, 1.0 - 1e-7)))  # Gumbel top-k
    idx = u.topk(m.topk, dim=1).indices
    probs = torch.softmax(torch.randn(t, m.topk, generator=g, device=device), dim=1)
    return x, idx, probs


def quantized(x: torch.Tensor):
    from turbo_dispatch.low_precision import quantize

    return quantize(x, torch.float8_e4m3fn, "blockwise", block_size=FP8_BLOCK)


def payload_bytes(q_or_x) -> torch.Tensor:
    """The payload's rows as uint8 (bf16 rows, or fp8 data then scales): what raw all_to_all_single moves."""
    if isinstance(q_or_x, torch.Tensor):
        return q_or_x.contiguous().view(torch.uint8)
    return torch.cat([q_or_x.data.contiguous().view(torch.uint8), q_or_x.scale.contiguous().view(torch.uint8)], 1)


@dataclass
class Reference:
    """This rank's inputs and everything it must receive, from every rank's regenerated inputs."""

    x: torch.Tensor  # [T, H] bf16
    idx: torch.Tensor
    probs: torch.Tensor
    payload: Any  # x, or its QuantizedTensor
    counts: list  # counts[s][d]: rows rank s sends rank d
    send_order: torch.Tensor  # [S] this rank's tokens in send order (destination rank, token)
    recv_x: torch.Tensor  # [R, H] bf16 rows this rank receives
    recv_payload: torch.Tensor  # [R, C] uint8: the payload bytes of those rows
    recv_idx: torch.Tensor
    recv_probs: torch.Tensor
    combined: torch.Tensor  # [T, H] bf16: x * number of destination ranks

    @property
    def num_recv(self) -> int:
        return self.recv_x.shape[0]


def reference(cfg: Config, g: Group, seed: int) -> Reference:
    from turbo_dispatch.ops.moe import dispatch_layout

    m, me, world = cfg.model, g.rank, g.world
    local = m.experts // world
    counts, rows, payloads, ids, probs = [], [], [], [], []
    mine = None
    for src in range(world):
        x, idx, p = source_inputs(cfg, src, g.device, seed)
        _, _, in_rank = dispatch_layout(idx, m.experts, world)
        counts.append(in_rank.sum(0).tolist())
        payload = x if cfg.payload == "bf16" else quantized(x)
        if src == me:
            order = torch.cat([in_rank[:, d].nonzero()[:, 0] for d in range(world)])
            n_dest = in_rank.sum(1, keepdim=True).float()
            mine = (x, idx, p, payload, order, (x.float() * n_dest).to(torch.bfloat16))
        sel = in_rank[:, me]
        rows.append(x[sel])
        payloads.append(payload_bytes(payload)[sel])
        lid = idx[sel] - me * local
        here = (lid >= 0) & (lid < local)
        ids.append(torch.where(here, lid, -1))
        probs.append(torch.where(here, p[sel], 0.0))
    x, idx, p, payload, order, combined = mine
    return Reference(x, idx, p, payload, counts, order, torch.cat(rows), torch.cat(payloads), torch.cat(ids),
                     torch.cat(probs), combined)


# -- the rows ----------------------------------------------------------------------------------------------
def _bytes_from_others(counts: list, row_bytes: int, back: bool) -> int:
    """The most payload bytes any rank receives from the other ranks (dispatch, or combine: ``back``)."""
    world = len(counts)
    if back:  # rank d gets back the rows it sent to every other rank
        return max(sum(counts[d][r] for r in range(world) if r != d) for d in range(world)) * row_bytes
    return max(sum(counts[s][d] for s in range(world) if s != d) for d in range(world)) * row_bytes


def _gbps(nbytes: int, ms: Optional[float]) -> Optional[float]:
    return None if not ms else nbytes / (ms * 1e-3) / 1e9


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return None if not num or not den else num / den


def _differences(cfg: Config, ref: Reference, out, handle_combine: Callable, worst: int) -> list[str]:
    """What a dispatch's outputs (and the combine of its rows) get wrong against ``ref``."""
    recv, recv_idx, recv_probs, _, handle = out
    r = ref.num_recv
    bad = []
    got = payload_bytes(recv)
    want_rows = worst or r
    if got.shape != (want_rows, ref.recv_payload.shape[1]):
        return [f"received {tuple(got.shape)} payload bytes, want {(want_rows, ref.recv_payload.shape[1])}"]
    if not torch.equal(got[:r], ref.recv_payload):
        bad.append("received rows differ from the reference")
    if worst and got[r:].any():
        bad.append("padding rows are not zero")
    if not torch.equal(recv_idx[:r], ref.recv_idx) or (worst and not bool((recv_idx[r:] == -1).all())):
        bad.append("recv_idx differs")
    if not torch.equal(recv_probs[:r], ref.recv_probs) or (worst and recv_probs[r:].any()):
        bad.append("recv_probs differs")
    y = recv if cfg.payload == "bf16" else torch.cat([ref.recv_x, ref.recv_x.new_zeros(want_rows - r, ref.x.shape[1])])
    if not torch.equal(handle_combine(y, handle), ref.combined):
        bad.append("combine(dispatch(x)) != x * destinations")
    return bad


def backend_rows(cfg: Config, g: Group, ref: Reference, entry, args, a2a_ms: tuple, worst: int) -> list[dict]:
    """The ``turbo <name>`` row and, for small token counts, its ``no-sync`` row."""
    from turbo_dispatch import GlobalBackendManager
    from turbo_dispatch.device_platform import platform_of
    from turbo_dispatch.ops.moe import moe_combine, moe_dispatch, moe_dispatch_problem

    e, data = cfg.model.experts, ref.x if cfg.payload == "bf16" else ref.payload.data
    dispatch = lambda n: moe_dispatch(ref.payload, ref.idx, ref.probs, e, None, num_worst_tokens=n)
    combine = lambda y, handle: moe_combine(y, None, handle)
    row_bytes = ref.recv_payload.shape[1]
    recv_bytes = _bytes_from_others(ref.counts, row_bytes, back=False)
    back_bytes = _bytes_from_others(ref.counts, ref.x.shape[1] * 2, back=True)
    rows = []
    for label, n in ((f"turbo {entry.name}", 0), (f"turbo {entry.name} no-sync", worst)):
        if n and cfg.tokens > args.worst_max_tokens:
            continue
        row = cfg.row(g.world, backend=label, worst_tokens=n or "")
        rows.append(row)
        why = entry.check(moe_dispatch_problem(data, ref.idx, ref.probs, e, None, n), platform_of(g.device.type))
        why = g.notes(why or "")  # a backend runs only where every rank can run it
        if why:
            row.update(check="SKIP", note=why)
            continue
        GlobalBackendManager.set_auto_tune(False)
        GlobalBackendManager.set_moe_dispatch_combine_backend(entry.name)
        try:
            try:
                wrong = "; ".join(_differences(cfg, ref, dispatch(n), combine, n))
            except Exception as exc:  # a failing backend is a FAIL row, not the end of the run
                wrong = f"{type(exc).__name__}: {exc}"[:300]
            wrong = g.notes(wrong)
            if wrong:
                row.update(check="FAIL", note=wrong)
                continue
            row["check"] = "PASS"
            if n:
                y = ref.recv_x.new_zeros(n, ref.x.shape[1]) if cfg.payload == "fp8" else None

                def round_trip(_):
                    recv, _, _, _, handle = dispatch(n)
                    return combine(recv if y is None else y, handle)

                rt, rt_host = timed(g, round_trip, None, args.warmup, args.iters)
                row.update(round_trip_us=rt * 1e3, rt_vs_a2a=_ratio(rt, a2a_ms[0]), round_trip_host_us=rt_host)
                if args.profile:
                    profiled(g, round_trip, args.iters, _profile_path(args, cfg, entry.name, "no-sync"))
                continue
            d_ms, d_host = timed(g, lambda _: dispatch(0), None, args.warmup, args.iters)
            row.update(dispatch_ms=d_ms, dispatch_gbps=_gbps(recv_bytes, d_ms), dispatch_vs_a2a=_ratio(a2a_ms[0], d_ms),
                       dispatch_host_us=d_host)
            if cfg.payload == "bf16":
                def setup():
                    recv, _, _, _, handle = dispatch(0)
                    return recv, handle

                c_ms, c_host = timed(g, lambda s: combine(*s), setup, args.warmup, args.iters)
                row.update(combine_ms=c_ms, combine_gbps=_gbps(back_bytes, c_ms),
                           combine_vs_a2a=_ratio(a2a_ms[1], c_ms), combine_host_us=c_host)
            if args.profile:
                def dispatch_combine(_):
                    recv, _, _, _, handle = dispatch(0)
                    return combine(recv, handle) if cfg.payload == "bf16" else recv

                profiled(g, dispatch_combine, args.iters, _profile_path(args, cfg, entry.name, "sync"))
        finally:
            GlobalBackendManager.set_moe_dispatch_combine_backend(None)
            GlobalBackendManager.set_auto_tune(None)
    return rows


def _profile_path(args, cfg: Config, backend: str, mode: str) -> Path:
    return args.out / "profile" / f"{cfg.model_name}_{cfg.tokens}_{cfg.routing}_{cfg.payload}_{backend}_{mode}.txt"


def a2a_row(cfg: Config, g: Group, ref: Reference, args) -> tuple[dict, tuple]:
    """Raw all_to_all_single of the same rows, out and (bf16) back; returns the row and its times."""
    world = g.world
    send_splits = list(ref.counts[g.rank])
    recv_splits = [ref.counts[s][g.rank] for s in range(world)]
    send = payload_bytes(ref.payload).index_select(0, ref.send_order)
    out = send.new_empty((ref.num_recv, send.shape[1]))
    go = lambda _: dist.all_to_all_single(out, send, recv_splits, send_splits)
    go(None)
    ok = torch.equal(out, ref.recv_payload)
    if cfg.payload == "bf16":
        back_send = ref.recv_x.contiguous().view(torch.uint8)
        back = send.new_empty((send.shape[0], back_send.shape[1]))
        come_back = lambda _: dist.all_to_all_single(back, back_send, send_splits, recv_splits)
        come_back(None)
        ok = ok and torch.equal(back, send)
    ok = g.all_true(ok)
    row = cfg.row(world, backend="torch all_to_all_single", check="PASS" if ok else "FAIL",
                  recv_mb=_bytes_from_others(ref.counts, send.shape[1], back=False) / 1e6,
                  back_mb=(_bytes_from_others(ref.counts, ref.x.shape[1] * 2, back=True) / 1e6
                           if cfg.payload == "bf16" else None))
    if not ok:
        row["note"] = "all_to_all_single delivered other bytes than the reference"
        return row, (None, None)
    d_ms, d_host = timed(g, go, None, args.warmup, args.iters)
    c_ms, c_host = timed(g, come_back, None, args.warmup, args.iters) if cfg.payload == "bf16" else (None, None)
    row.update(dispatch_ms=d_ms, dispatch_gbps=_gbps(int(row["recv_mb"] * 1e6), d_ms), dispatch_vs_a2a=1.0,
               dispatch_host_us=d_host)
    if c_ms is not None:
        row.update(combine_ms=c_ms, combine_gbps=_gbps(int(row["back_mb"] * 1e6), c_ms), combine_vs_a2a=1.0,
                   combine_host_us=c_host)
    return row, (d_ms, c_ms)


def p2p_row(cfg: Config, g: Group, ref: Reference, args, a2a_ms: tuple) -> dict:
    """``copy_`` of the dispatch's (and combine's) byte count into a buffer on the next rank's GPU."""
    row = cfg.row(g.world, backend="p2p copy to next rank")
    peer = (g.local_rank + 1) % g.local_world
    why = None
    if not g.cuda:
        why = "a CPU run has no GPU peers"
    elif g.local_world < 2 or torch.cuda.device_count() <= peer:
        why = f"the next rank's GPU cuda:{peer} is not visible in this process"
    elif not torch.cuda.can_device_access_peer(g.device.index, peer):
        why = f"cuda:{g.device.index} has no peer access to cuda:{peer}"
    why = g.notes(why or "")
    if why:
        row.update(check="SKIP", note=why)
        return row
    sizes = [_bytes_from_others(ref.counts, ref.recv_payload.shape[1], back=False)]
    if cfg.payload == "bf16":
        sizes.append(_bytes_from_others(ref.counts, ref.x.shape[1] * 2, back=True))
    src = torch.randint(0, 256, (max(max(sizes), 1),), dtype=torch.uint8, device=g.device)
    dst = torch.empty_like(src, device=torch.device("cuda", peer))
    times = []
    for n in sizes:
        times.append(timed(g, lambda _: dst[:n].copy_(src[:n]), None, args.warmup, args.iters)[0])
    seen = min(sizes[0], 4096)
    ok = g.all_true(torch.equal(dst[:seen].cpu(), src[:seen].cpu()))
    row.update(check="PASS" if ok else "FAIL", note="copy_ into a tensor on the peer GPU (peer access)")
    if ok:
        row.update(dispatch_ms=times[0], dispatch_gbps=_gbps(sizes[0], times[0]),
                   dispatch_vs_a2a=_ratio(a2a_ms[0], times[0]))
        if len(times) > 1:
            row.update(combine_ms=times[1], combine_gbps=_gbps(sizes[1], times[1]),
                       combine_vs_a2a=_ratio(a2a_ms[1], times[1]))
    return row


def config_rows(cfg: Config, g: Group, args) -> list[dict]:
    from turbo_dispatch.registry import get_registry

    ref = reference(cfg, g, args.seed)
    worst = max(max(sum(c[d] for c in ref.counts) for d in range(g.world)), 1)
    a2a, a2a_ms = a2a_row(cfg, g, ref, args)
    rows = []
    for entry in get_registry().backends(OP):
        if args.backends and entry.name not in args.backends:
            continue
        rows += backend_rows(cfg, g, ref, entry, args, a2a_ms, worst)
    rows += [a2a, p2p_row(cfg, g, ref, args, a2a_ms)]
    del ref
    if g.cuda:
        torch.cuda.empty_cache()
    return rows


# -- reports ---------------------------------------------------------------------------------------------
def _cell(value: Any, digits: int) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 6)
    return "" if value is None else value


def write_reports(rows: list[dict], g: Group, args, started: str) -> tuple[Path, Path]:
    """``<out>/<gpu>_<date>_<name>.{csv,md}``; returns both paths."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(g.device) if g.cuda else "CPU"
    stem = out / f"{gpu_slug(g.device)}_{started[:10]}_{args.name}"
    with open(stem.with_suffix(".csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({c: _csv_value(r.get(c)) for c in COLUMNS})
    comm = "NCCL " + ".".join(map(str, torch.cuda.nccl.version())) if g.cuda else "gloo"
    lines = [f"# MoE dispatch / combine: {name} x {g.world}, {started}", "",
             f"{g.world} ranks over {comm}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
             f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', 'unset')}", "",
             "Command: `" + " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) + "`", ""]
    if not g.cuda:
        lines += ["**CPU smoke run: the timings below are meaningless** (gloo between CPU processes; the run only "
                  "checks the script, the correctness checks and the reports).", ""]
    lines += ["- time: per rank the median of the timed rounds (each entered at a barrier; CUDA events, "
              "perf_counter on a CPU), the max over ranks; GB/s: payload bytes the busiest rank receives from other "
              "ranks / time; x a2a: raw all_to_all_single time of the same rows / this row's time (>1 beats NCCL's "
              "own exchange)",
              "- no-sync: dispatch + combine with num_worst_tokens = the most rows any rank receives, in us, and as "
              "a multiple of one raw all_to_all_single of the dispatch's rows",
              "- p2p: copy_ of the same byte count into a tensor on the next rank's GPU, all ranks at once",
              "- host us: the issuing thread's time per call, from the call to its return (dispatch / combine, or "
              "the no-sync round trip)", "",
              "| model | tokens | routing | payload | backend | check | dispatch ms | GB/s | combine ms | GB/s "
              "| x a2a (dispatch / combine) | no-sync round trip us (x a2a) | host us | note |",
              "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ratios = " / ".join(_cell(r.get(k), 2) or "-" for k in ("dispatch_vs_a2a", "combine_vs_a2a"))
        rt = _cell(r.get("round_trip_us"), 1)
        rt += f" ({_cell(r.get('rt_vs_a2a'), 2)})" if rt and r.get("rt_vs_a2a") else ""
        note = str(r.get("note") or "").replace("|", "/")
        host = " / ".join(_cell(r.get(k), 0) for k in ("dispatch_host_us", "combine_host_us", "round_trip_host_us")
                          if r.get(k) is not None)
        lines.append(f"| {r['model']} | {r['tokens']} | {r['routing']} | {r['payload']} | {r['backend']} | "
                     f"{r.get('check', '')} | {_cell(r.get('dispatch_ms'), 3)} | {_cell(r.get('dispatch_gbps'), 1)} | "
                     f"{_cell(r.get('combine_ms'), 3)} | {_cell(r.get('combine_gbps'), 1)} | "
                     f"{ratios if ratios != '- / -' else ''} | {rt} | {host} | {note} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem.with_suffix(".csv"), stem.with_suffix(".md")


# -- processes ---------------------------------------------------------------------------------------------
def configs(args) -> list[Config]:
    out = []
    for name in args.models:
        for tokens in args.tokens:
            for routing in args.routings:
                for payload in args.payloads:
                    out.append(Config(len(out), name, MODELS[name], tokens, routing, payload))
    return out


def join_group(device_type: str, timeout_s: float, rank: int, world: int, local_rank: int, local_world: int) -> Group:
    """Initialises the process group (NCCL on ``cuda``, gloo on ``cpu``, where the ranks share the
    cores) and returns this rank's ``Group``; the caller destroys the process group."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return Group(rank, world, device, local_rank, local_world)


def run_rank(args, rank: int, world: int, local_rank: int, local_world: int) -> int:
    """One rank's whole run: join the group, measure every configuration, rank 0 writes the reports.
    Returns the number of FAIL rows (the same on every rank: each check is agreed over the ranks)."""
    g = join_group(args.device, args.timeout, rank, world, local_rank, local_world)
    try:
        started = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
        bad = [n for n in args.models if MODELS[n].experts % world]
        if bad:
            raise SystemExit(f"bench_moe: {', '.join(bad)}: experts not divisible by {world} ranks")
        rows: list[dict] = []
        paths: tuple = ()
        for cfg in configs(args):
            t0 = time.perf_counter()
            rows += config_rows(cfg, g, args)
            if rank == 0:
                paths = write_reports(rows, g, args, started)
                print(f"[bench_moe] {cfg.model_name} tokens={cfg.tokens} {cfg.routing} {cfg.payload}: "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
        failed = [f"{r['model']} tokens={r['tokens']} {r['routing']} {r['payload']} {r['backend']}"
                  for r in rows if r.get("check") == "FAIL"]
        if rank == 0:
            for path in paths:
                print(f"wrote {path}")
            for what in failed:
                print(f"bench_moe: FAIL {what}")
        return len(failed)
    finally:
        dist.destroy_process_group()


def _spawned(index: int, args, world: int) -> None:
    if run_rank(args, index, world, index, world):
        sys.exit(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default: "
                        f"{','.join(map(str, TOKENS))}; --quick: {','.join(map(str, QUICK_TOKENS))})")
    parser.add_argument("--routings", default=",".join(ROUTINGS), help="uniform, skewed (default: both)")
    parser.add_argument("--payloads", default=",".join(PAYLOADS), help="bf16, fp8 (default: both)")
    parser.add_argument("--backends", default=None, help="only these registered backends (default: every one)")
    parser.add_argument("--iters", type=int, default=None, help="timed rounds per row (default 20; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 3; --quick 1)")
    parser.add_argument("--worst-max-tokens", type=int, default=512,
                        help="no-sync (num_worst_tokens) rows up to this many tokens per rank (default 512)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="without torchrun: processes to spawn (default: the visible GPUs; 2 on a CPU)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is a GPU")
    parser.add_argument("--out", default=None, help="report folder (default $TURBO_BENCH_OUT/moe, else bench-out/moe)")
    parser.add_argument("--name", default="moe", help="report name: <gpu>_<date>_<name>.csv/.md (default moe)")
    parser.add_argument("--quick", action="store_true", help="smoke form: a few tokens, few rounds (CPU works)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="also profile every turbo row (cProfile and torch.profiler on rank 0, "
                             "<out>/profile/<model>_<tokens>_<routing>_<payload>_<backend>_<mode>.txt)")
    parser.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    args = parser.parse_args(argv)
    args.models = args.models.split(",") if args.models else list(MODELS)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else \
        list(QUICK_TOKENS if args.quick else TOKENS)
    args.routings = args.routings.split(",")
    args.payloads = args.payloads.split(",")
    for name, got, known in (("--routings", args.routings, ROUTINGS), ("--payloads", args.payloads, PAYLOADS)):
        if set(got) - set(known):
            parser.error(f"{name}: unknown {', '.join(sorted(set(got) - set(known)))}; known: {', '.join(known)}")
    args.backends = [b.strip().upper() for b in args.backends.split(",")] if args.backends else None
    args.iters = args.iters or (2 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out = Path(args.out) if args.out else resolve_out_dir(None) / "moe"
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        return 1 if run_rank(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                             int(os.environ.get("LOCAL_RANK", 0)), local_world) else 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    world = args.nproc or (gpus if args.device == "cuda" else 2)
    if args.device == "cuda" and (world < 2 or gpus < world):
        print(f"bench_moe: SKIPPED: needs {max(world, 2)} GPUs (one per rank); {gpus} visible")
        return 2
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    try:
        mp.start_processes(_spawned, args=(args, world), nprocs=world, start_method="spawn")
    except ProcessException as exc:  # a rank with FAIL rows exits 1 (rank 0 lists them), or one crashed
        print(f"bench_moe: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
