#!/usr/bin/env python3
"""One MoE layer's training step under expert parallelism: plain torch against turbo_dispatch, on the
same weights and tokens, one process per GPU.

Processes talk over NCCL (gloo between CPU processes: ``--quick`` there is a smoke run whose timings
mean nothing); launched by torchrun, or spawned by the script itself (``--nproc``, default 2). Rank r
holds global experts ``[r * L, (r + 1) * L)``, ``L = experts / world``. Variants (``--variants``,
bench_model.py's names; no ``:tune`` or ``:unfused`` here):

* ``torch`` (the peer): an ``nn.Linear`` router (softmax in fp32, top-k, the k probabilities
  renormalised); the per-expert row counts exchanged with ``torch.distributed.all_to_all_single``,
  read on the host, then one row per (token, expert) pair sent with it; the received rows regrouped
  by local expert and run through bench_model.py's ``TorchGroupedLinear`` experts (SwiGLU up_gate,
  down: ``torch._grouped_mm`` on sm_90/sm_100, a per-expert ``torch.mm`` loop elsewhere); the
  outputs sent back the same way, weighted by their probabilities and summed per source token with
  ``index_add``;
* ``bf16``: examples/train_moe.py's ``MoE`` layer (``ops.moe_dispatch`` / ``moe_combine`` and
  ``modules.GroupedLinear`` experts) in the model dtype;
* ``fp8-rowwise``, ``fp8-blockwise`` (and ``fp8-tensorwise``): the same layer with
  ``GroupedLinear(fp8_config=...)`` experts (HYBRID format; the router stays in the model dtype).

Every variant holds the same parameter tensors (the turbo layers share the peer's), so only one
set of weights is resident. The model dtype is bf16 on GPUs, float32 on the CPU.

Per config (widths x tokens per rank) and variant:

1. check: one forward+backward on this rank's tokens and a fixed upstream gradient; the output and
   the gradients of the input, the router and both expert weights, against the plain-torch layer
   run in float32 (float64 on the CPU) on the same weights (each rank's tensors checked, the worst
   rank reported). Every layer is given the reference's routing (its top-k, imposed through the
   router's logits: -inf outside each token's k experts, which leaves the renormalised
   probabilities and their gradients as they were), since rounding breaks near-ties between a
   token's k-th and next expert either way. The torch peer passes within 10% (a sanity bound), a
   turbo variant in the model dtype within max(2e-2 bf16 / 5e-3 fp32, twice the peer's error) per
   tensor, an fp8 one at SNR >= 15 dB (bench_model.py's gate). A FAIL voids the row's timing;
2. peak memory (GPU): the most memory one forward+backward held above what was allocated before
   it (the shared weights, the inputs): activations, gradients, workspaces, fp8 copies;
3. timing: forward (``fwd_ms``) and forward+backward (``step_ms``, gradients set to None first) of
   every PASSing variant in turns (benchmarks/harness.py's ``Timer.time_interleaved``, a fixed
   number of calls, the same on every rank), routing by each layer's own router. Before each timed
   call the ranks agree on the GPU spin that covers the host's issue time (an all-reduce, which
   also lines their hosts up), so every rank starts the call together; a row's time is the max
   over ranks of each rank's median. ``ratio_vs_best_peer`` = the torch peer's step time / the
   variant's (> 1: faster than plain torch); ``tokens_per_s`` = the group's tokens (world x tokens
   per rank) per second of step. TFLOPS count one rank's nominal GEMM work (router, and k routed
   rows per token through the three expert projections; a step is 3x the forward).

Widths: ``--model`` (an MoE preset of turbo_dispatch.presets, default deepseek-v3), each overridable
(``--hidden``, ``--experts``, ``--topk``, ``--expert-ffn``); a CPU run shrinks them to a tiny layer.
The report's notes say whether the run met the issue's target: turbo fp8 blockwise >= 1.3x the
plain-torch bf16 step at EP2, 4096 tokens per rank, DeepSeek-V3 widths (hidden 7168, 256 experts
top-8, expert FFN 2048: 128 experts per rank).

Results: ``<out>/<gpu>_<date>_<name>.{csv,md,png}`` (benchmarks/harness.py's reports, rewritten by
rank 0 after each config), ``--out`` defaulting to ``$TURBO_BENCH_OUT/moe_layer``, else
bench-out/moe_layer. The exit status is 1 when a turbo row FAILed, else 0; with fewer GPUs than
ranks the report holds one SKIP row saying so (exit 0). SIGTERM to a spawning run ends its ranks.

Usage:
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_moe_layer.py            # EP2, DeepSeek-V3
    torchrun --standalone --nproc_per_node 4 benchmarks/bench_moe_layer.py --tokens 4096,8192
    python benchmarks/bench_moe_layer.py --nproc 2 --experts 64 --hidden 4096          # smaller config
    python benchmarks/bench_moe_layer.py --quick --device cpu                          # 2 gloo processes
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import harness as H  # noqa: E402
from bench_model import TorchGroupedLinear, Variant, compare, parse_variant, settings  # noqa: E402
from bench_moe import Group, _free_port, join_group  # noqa: E402
from train_llama import fp8_config  # noqa: E402
from train_moe import MoE  # noqa: E402

from turbo_dispatch import GlobalBackendManager, host_cover  # noqa: E402
from turbo_dispatch.presets import MODELS as PRESETS  # noqa: E402

OP = "moe_layer"
DEFAULT_VARIANTS = "torch,bf16,fp8-rowwise,fp8-blockwise"
#: The issue's target: (variant, minimum ratio vs the torch peer, world, tokens per rank, model).
TARGET = ("fp8-blockwise", 1.3, 2, 4096, "deepseek-v3")


@dataclass(frozen=True)
class LayerConfig:
    """One layer's widths and this rank's token count."""

    model: str
    hidden: int
    experts: int
    topk: int
    ffn: int
    tokens: int

    def shape(self, world: int) -> str:
        return f"EP{world} T{self.tokens} H{self.hidden} E{self.experts} k{self.topk} F{self.ffn}"

    def flops(self) -> tuple[float, float]:
        """One rank's nominal (forward, step) GEMM FLOPs: the router, then ``topk`` routed rows per
        token through up_gate (hidden -> 2 ffn) and down (ffn -> hidden)."""
        router = 2.0 * self.tokens * self.hidden * self.experts
        experts = 2.0 * self.tokens * self.topk * 3 * self.hidden * self.ffn
        return router + experts, 3.0 * (router + experts)


#: Every MoE preset's layer (turbo_dispatch.presets), 4096 tokens per rank.
MODELS = {p.name: LayerConfig(p.name, p.hidden, p.experts, p.topk, p.moe_intermediate, 4096)
          for p in PRESETS.values() if p.experts and p.name != "tiny"}
#: The CPU smoke form of every model: seconds per variant.
CPU_TINY = dict(hidden=64, experts=8, topk=2, ffn=32, tokens=16)


# -- the plain-torch layer -----------------------------------------------------------------------------
class _Exchange(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows (``in_splits`` rows to each rank, ``out_splits`` from each)
    with autograd: the backward sends the gradient rows back the way the rows came."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits)
        return back, None, None


class TorchEPMoE(torch.nn.Module):
    """train_moe.MoE in plain torch, with its parameters (``router.weight`` [E, hidden],
    ``up_gate.weight`` [L, 2 ffn, hidden], ``down.weight`` [L, hidden, ffn]) and math;
    ``forward(x [T, hidden])`` is a collective over the default group (see the module docstring).
    One row per (token, expert) pair travels, as a plain all-to-all MoE sends it."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, world: int) -> None:
        super().__init__()
        self.num_experts, self.topk, self.world = num_experts, topk, world
        self.local_experts = num_experts // world
        self.router = torch.nn.Linear(hidden, num_experts, bias=False)
        self.up_gate = TorchGroupedLinear(self.local_experts, hidden, 2 * ffn)
        self.down = TorchGroupedLinear(self.local_experts, ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, local = self.world, self.local_experts
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        top_probs, top_idx = probs.topk(self.topk, dim=-1)
        top_probs = top_probs / top_probs.sum(-1, keepdim=True)
        flat = top_idx.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs by global expert, hence by rank
        rows = order // self.topk
        sent = flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))
        received = torch.empty_like(sent)  # [source rank, local expert]: rows each rank sends this one
        dist.all_to_all_single(received, sent)
        counts = torch.stack([sent, received]).cpu()  # the host must know the split sizes
        send_splits = counts[0].view(w, local).sum(1).tolist()
        by_source = counts[1].view(w, local)
        recv_splits = by_source.sum(1).tolist()
        recv = _Exchange.apply(x[rows], recv_splits, send_splits)
        # The rows arrive by (source rank, local expert); the experts take them by (expert, source).
        block = torch.repeat_interleave(torch.arange(w * local, device=x.device), received,
                                        output_size=sum(recv_splits))
        perm = ((block % local) * w + block // local).argsort(stable=True)
        group_lens = received.view(w, local).sum(0)
        gate, up = self.up_gate(recv[perm], group_lens).chunk(2, dim=-1)
        out = self.down(F.silu(gate) * up, group_lens)
        back = _Exchange.apply(out.new_empty(out.shape).index_copy(0, perm, out), send_splits, recv_splits)
        weighted = back * top_probs.flatten()[order].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(x).index_add(0, rows, weighted)


@contextlib.contextmanager
def imposed_routing(router: torch.nn.Module, experts: torch.Tensor) -> Iterator[None]:
    """Within the block, ``router``'s logits are -inf outside each token's ``experts`` [T, k], so a
    top-k router picks exactly those, with the probabilities a softmax over the kept logits gives:
    what the full softmax, restricted to them and renormalised, gives too (the dropped logits'
    share cancels), gradients included."""
    keep = torch.zeros(experts.shape[0], router.weight.shape[0], dtype=torch.bool, device=experts.device)
    keep.scatter_(1, experts, True)
    handle = router.register_forward_hook(lambda module, args, out: out.masked_fill(~keep, float("-inf")))
    try:
        yield
    finally:
        handle.remove()


def build_layer(c: LayerConfig, world: int, device: torch.device, dtype: torch.dtype) -> TorchEPMoE:
    """An uninitialised ``TorchEPMoE`` in ``dtype`` on ``device`` (built on the meta device: no
    init cost, no float32 copy of a bf16 layer)."""
    with torch.device("meta"):
        layer = TorchEPMoE(c.hidden, c.ffn, c.experts, c.topk, world)
    return layer.to(dtype).to_empty(device=device)


def init_weights(layer: TorchEPMoE, seed: int, rank: int, rounded_to: torch.dtype) -> None:
    """nn.Linear's init (uniform within 1/sqrt(fan_in)): the router the same on every rank, the
    experts drawn per rank; values rounded to ``rounded_to``, the variants' dtype, so that the
    reference holds the weights the variants hold."""
    device = layer.router.weight.device
    draws = [(layer.router.weight, seed), (layer.up_gate.weight, (seed + 1) * 7919 + rank),
             (layer.down.weight, (seed + 2) * 7919 + rank)]
    with torch.no_grad():
        for weight, stream in draws:
            bound = 1.0 / math.sqrt(weight.shape[-1])
            weight.uniform_(-bound, bound, generator=torch.Generator(device).manual_seed(stream))
            weight.copy_(weight.to(rounded_to))


def turbo_layer(peer: TorchEPMoE, c: LayerConfig, recipe: str) -> MoE:
    """train_moe.MoE holding ``peer``'s parameter tensors, with fp8 experts for an fp8 ``recipe``."""
    with torch.device("meta"):
        layer = MoE(c.hidden, c.ffn, c.experts, c.topk, None, fp8_config(recipe))
    layer.router.weight, layer.up_gate.weight, layer.down.weight = (peer.router.weight, peer.up_gate.weight,
                                                                    peer.down.weight)
    return layer


def weights(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checked parameters by their report names (the same in both layer kinds)."""
    return {"router.weight": layer.router.weight, "up_gate.weight": layer.up_gate.weight,
            "down.weight": layer.down.weight}


# -- one config --------------------------------------------------------------------------------------
class AlignedTimer(H.Timer):
    """harness.Timer for collectives: before each timed call the ranks agree on the host time its
    GPU spin covers (the max over ranks, through an all-reduce that also lines the hosts up), so
    no rank's start event waits inside a collective for another rank's longer spin."""

    def __init__(self, g: Group, warmup: int, repeats: int):
        # a fixed number of calls: every rank must make the same collectives
        super().__init__(g.device, warmup=warmup, min_repeats=repeats, max_repeats=repeats)
        self.group = g

    def _one(self, call, i: int, setup, untimed_host: Sequence[float] = ()) -> tuple[float, float]:
        agreed = self.group.max(host_cover.typical_ms(untimed_host))
        return super()._one(call, i, setup, [agreed])


@dataclass
class Built:
    """One variant's layer, how to enter its settings, and what its check and memory step gave."""

    variant: Variant
    layer: torch.nn.Module
    enter: Callable[[], None]
    check: Optional[H.Check] = None
    errors: Optional[dict] = None
    peak_gib: Optional[float] = None


def step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """One forward+backward with the gradients in ``.grad`` (dropped first); returns the output."""
    layer.zero_grad(set_to_none=True)
    x.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach()


def checked(y: torch.Tensor, layer: torch.nn.Module, x: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
    """The tensors the check compares, by name."""
    return {"out": y, "x.grad": x.grad, **{f"{n}.grad": w.grad for n, w in weights(layer).items()}}


def reference(c: LayerConfig, g: Group, x: torch.Tensor, dy: torch.Tensor, seed: int, dtype: torch.dtype,
              ref_dtype: torch.dtype) -> tuple[TorchEPMoE, dict, torch.Tensor]:
    """The peer layer in ``dtype``, the plain-torch step in ``ref_dtype`` on its weights (tensors on
    the host when on a GPU: they wait there while the variants run) and the reference's routing."""
    ref = build_layer(c, g.world, g.device, ref_dtype)
    init_weights(ref, seed, g.rank, dtype)
    xr = x.detach().to(ref_dtype).requires_grad_()
    with torch.no_grad():
        routing = ref.router(xr).topk(c.topk, dim=-1).indices
    with imposed_routing(ref.router, routing):
        y = step(ref, xr, dy.to(ref_dtype))
    tensors = {k: t.detach().cpu() for k, t in checked(y, ref, xr).items()}
    ref.zero_grad(set_to_none=True)
    peer = build_layer(c, g.world, g.device, dtype)
    peer.load_state_dict(ref.state_dict())
    del ref, xr, y
    H.free_memory(g.device)
    return peer, tensors, routing


def agreed_check(g: Group, check: H.Check) -> H.Check:
    """``check`` over every rank: PASS only where every rank passed, the worst SNR and error, and
    each rank's reasons."""
    ok = g.all_true(check.ok)
    snr = -g.max(-check.snr_db if not math.isnan(check.snr_db) else -math.inf)  # NaN (nothing compared) counts as inf
    err = g.max(check.rel_err if not math.isnan(check.rel_err) else -1.0)
    reasons = g.notes("; ".join(check.reasons))
    return H.Check(ok=ok, snr_db=math.nan if snr == math.inf and not ok else snr, rel_err=math.nan if err < 0 else err,
                   reasons=[reasons] if reasons else [])


def gate_variant(b: Built, ref: dict, peer_err: dict, routing: torch.Tensor, x: torch.Tensor, dy: torch.Tensor,
                 g: Group, dtype: torch.dtype) -> None:
    """``b``'s check against ``ref`` on the reference's routing, then its peak memory (GPU)."""
    b.enter()
    try:
        with imposed_routing(b.layer.router, routing):
            y = step(b.layer, x, dy)
        check, b.errors = compare(b.variant, checked(y, b.layer, x), ref, peer_err, dtype)
    except Exception as exc:  # a crashing variant is a FAIL (on every rank, raised or not), the run goes on
        check, b.errors = H.failed("raised " + H.error_note(exc)), {}
    b.check = agreed_check(g, check)
    b.layer.zero_grad(set_to_none=True)
    x.grad = None
    if g.cuda and b.check.ok:
        torch.cuda.synchronize(g.device)
        torch.cuda.reset_peak_memory_stats(g.device)
        base = torch.cuda.memory_allocated(g.device)
        step(b.layer, x, dy)
        torch.cuda.synchronize(g.device)
        b.peak_gib = g.max((torch.cuda.max_memory_allocated(g.device) - base) / 2**30)
        b.layer.zero_grad(set_to_none=True)
        x.grad = None


def time_variants(live: list[Built], x: torch.Tensor, dy: torch.Tensor, timer: AlignedTimer,
                  g: Group) -> list[tuple[float, float, float]]:
    """(fwd_ms, step_ms, step_host_ms) of each of ``live``, timed in turns; the max over ranks."""
    def setup(b: Built) -> Callable[[], None]:
        def go() -> None:
            for other in live:  # shared weights: one variant's gradients alive at a time
                other.layer.zero_grad(set_to_none=True)
            x.grad = None
            b.enter()
        return go

    setups = [setup(b) for b in live]
    fwd = timer.time_interleaved([lambda b=b: b.layer(x) for b in live], setups)
    steps = timer.time_interleaved([lambda b=b: step(b.layer, x, dy) for b in live], setups)
    host = timer.last_host_ms
    for b in live:
        b.layer.zero_grad(set_to_none=True)
    x.grad = None
    return [(g.max(f), g.max(s), g.max(h)) for f, s, h in zip(fwd, steps, host)]


def config_rows(c: LayerConfig, variants: list[Variant], g: Group, args) -> list[H.Row]:
    """The rows of one config (see the module docstring)."""
    dtype = torch.bfloat16 if g.cuda else torch.float32
    ref_dtype = torch.float32 if g.cuda else torch.float64
    gen = torch.Generator(g.device).manual_seed(args.seed * 1009 + g.rank)
    x = torch.randn(c.tokens, c.hidden, generator=gen, device=g.device, dtype=dtype).requires_grad_()
    dy = torch.randn(c.tokens, c.hidden, generator=gen, device=g.device, dtype=dtype)
    peer, ref, routing = reference(c, g, x, dy, args.seed, dtype, ref_dtype)
    built = []
    for v in sorted(variants, key=lambda v: not v.peer):  # the peer first: the others' tolerance uses its error
        layer = peer if v.peer else turbo_layer(peer, c, v.recipe)
        built.append(Built(v, layer, GlobalBackendManager.reset if v.peer else settings(v, None)))
    peer_err: dict = {}
    for b in built:
        t0 = time.perf_counter()
        gate_variant(b, ref, peer_err, routing, x, dy, g, dtype)
        if b.variant.peer:
            peer_err = b.errors or {}
        if g.rank == 0:
            print(f"  {b.variant.label(dtype)}: {b.check.status}"
                  + (f" ({'; '.join(b.check.reasons)})" if b.check.reasons else "")
                  + f" [{time.perf_counter() - t0:.1f} s]", flush=True)
    del ref
    live = [b for b in built if b.check.ok]
    times = time_variants(live, x, dy, AlignedTimer(g, args.warmup, args.iters), g) if live else []
    timed = {id(b): t for b, t in zip(live, times)}
    fwd_flops, step_flops = c.flops()
    rows = []
    for b in built:
        fwd_ms, step_ms, host_ms = timed.get(id(b), (None, None, None))
        row = H.Row(op=OP, shape=c.shape(g.world), backend=b.variant.label(dtype), model=c.model, m=c.tokens,
                    n=c.hidden, k=c.ffn, flops=fwd_flops, step_flops=step_flops, check=b.check, fwd_ms=fwd_ms,
                    step_ms=step_ms, step_host_ms=host_ms, peer=b.variant.peer,
                    bwd_ms=None if step_ms is None else step_ms - fwd_ms)
        row.extra = {"variant": b.variant.spec, "world": g.world, "experts_per_rank": c.experts // g.world,
                     "topk": c.topk, "tokens_per_s": round(g.world * c.tokens / (step_ms * 1e-3)) if step_ms else "",
                     "peak_mem_gib": round(b.peak_gib, 3) if b.peak_gib is not None else ""}
        rows.append(row)
    GlobalBackendManager.reset()
    del built, live, peer
    H.free_memory(g.device)
    return rows


# -- reports ---------------------------------------------------------------------------------------
def target_line(rows: list[H.Row]) -> str:
    """Whether the run met the issue's target, or that it did not measure it."""
    spec, want, target_world, tokens, model = TARGET
    shape = replace(MODELS[model], tokens=tokens).shape(target_world)
    row = next((r for r in rows if (r.extra.get("variant"), r.model, r.shape) == (spec, model, shape)), None)
    what = (f"issue target: turbo fp8 blockwise >= {want}x the torch bf16 step at EP{target_world}, {tokens} tokens "
            f"per rank, {model} widths")
    if row is None:
        return f"{what}: not measured by this run"
    if row.ratio is None:
        return f"{what}: no ratio ({row.check.status if row.check else 'SKIP'})"
    return f"{what}: {'met' if row.ratio >= want else 'NOT met'} ({row.ratio:.3f}x)"


def headline(rows: list[H.Row]) -> list[str]:
    """A table per shape: the figures a reader looks for first."""
    lines = ["## Training step per config (ratio = the torch peer's step time / the variant's)", ""]
    for shape in dict.fromkeys(r.shape for r in rows):
        lines += [f"### {shape}", "", "| variant | check | ms/step | fwd ms | tokens/s | ratio vs torch | peak GiB | "
                  "SNR dB | rel err |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r.shape == shape):
            d = r.as_dict()
            cells = [r.backend, d["check"], H._fmt(r.step_ms, 2), H._fmt(r.fwd_ms, 2), r.extra.get("tokens_per_s", ""),
                     H._fmt(r.ratio, 3), r.extra.get("peak_mem_gib", ""), d["snr_db"], d["rel_err"]]
            lines.append("| " + " | ".join(str(x) for x in cells) + " |")
        lines.append("")
    return lines


def write(rows: list[H.Row], world: int, device: torch.device, args, notes: list[str]) -> dict[str, Path]:
    """The harness's reports, with the per-config tables and the target before the score."""
    comm = ("NCCL " + ".".join(map(str, torch.cuda.nccl.version()))) if device.type == "cuda" else "gloo"
    notes = [f"{world} ranks over {comm}, one {'GPU' if device.type == 'cuda' else 'CPU process'} each; "
             f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', 'unset')}", *notes,
             "check: output and the gradients of x, router, up_gate and down against the plain-torch layer in "
             f"{'float32' if device.type == 'cuda' else 'float64'} (same weights, tokens and routing; worst rank): "
             "torch peer rel err <= 0.1; turbo in the model dtype <= max(2e-2 bf16 / 5e-3 fp32, 2x the peer's); "
             "fp8 SNR >= 15 dB. A FAIL voids the timing",
             "fwd_ms / step_ms: forward and forward+backward (gradients set to None first), variants timed in turns, "
             f"{args.iters} timed calls each, every timed call started together on all ranks; the max over ranks "
             "of each rank's median. tokens_per_s: world x tokens per rank / step; peak_mem_gib: one step's most "
             "memory above the shared weights and inputs (max over ranks); TFLOPS: one rank's nominal GEMM work",
             target_line(rows)]
    paths = H.write_reports(rows, name=args.name, device=device, out_dir=args.out, notes=notes,
                            title=f"MoE layer training step under expert parallelism (EP{world}): plain torch vs "
                                  "turbo_dispatch")
    text = paths["md"].read_text()
    at = text.index("## Score")
    paths["md"].write_text(text[:at] + "\n".join(headline(rows)) + "\n" + text[at:])
    return paths


# -- processes -------------------------------------------------------------------------------------
def configs(args) -> list[LayerConfig]:
    """One config per ``--tokens`` value; ``model`` names the preset, and says where the widths are not its own."""
    base = MODELS[args.model]
    if args.device == "cpu":
        base = replace(base, model=f"{base.model} (CPU tiny)", **CPU_TINY)
    widths = {k: getattr(args, k) for k in ("hidden", "experts", "topk", "ffn") if getattr(args, k)}
    model = base.model if not widths else f"{args.model} (custom)"
    quick_tokens = 512 if args.quick and args.device == "cuda" else base.tokens
    tokens = args.tokens or [quick_tokens]
    return [replace(base, model=model, tokens=t, **widths) for t in tokens]


def run_rank(args, rank: int, world: int, local_rank: int, local_world: int) -> int:
    """One rank's run: join the group, measure every config, rank 0 writes the reports after each.
    Returns the number of turbo rows that FAILed (the same on every rank: checks are agreed)."""
    g = join_group(args.device, args.timeout, rank, world, local_rank, local_world)
    device = g.device
    try:
        torch.set_float32_matmul_precision("highest")  # the float32 reference must not run in TF32
        variants = [parse_variant(s) for s in args.variants]
        rows: list[H.Row] = []
        notes: list[str] = []
        t0 = time.time()
        for c in configs(args):
            if c.experts % world:
                raise SystemExit(f"bench_moe_layer: {c.experts} experts are not divisible by {world} ranks")
            if rank == 0:
                print(f"[bench_moe_layer] {c.shape(world)}", flush=True)
            rows += config_rows(c, variants, g, args)
            if rank == 0:
                write(rows, world, device, args, notes + [f"elapsed {time.time() - t0:.0f} s"])
        failed = [f"{r.shape} {r.backend}" for r in rows if r.check is not None and not r.check.ok]
        if rank == 0:
            for what in failed:
                print(f"bench_moe_layer: FAIL {what}")
        return sum(not r.peer for r in rows if r.check is not None and not r.check.ok)
    finally:
        dist.destroy_process_group()


def _spawned(index: int, args, world: int) -> None:
    if run_rank(args, index, world, index, world):
        sys.exit(1)


def skipped(args, world: int, why: str) -> int:
    """The report of a run that could not start: one SKIP row saying why."""
    print(f"bench_moe_layer: SKIPPED: {why}")
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    c = configs(args)[0]
    rows = [H.Row(op=OP, shape=c.shape(world), backend="all variants", model=c.model, note=why)]
    H.write_reports(rows, name=args.name, device=device, out_dir=args.out, notes=[f"SKIPPED: {why}"],
                    title=f"MoE layer training step under expert parallelism (EP{world})")
    return 0


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v3", choices=list(MODELS),
                        help="the widths (default deepseek-v3; a CPU run shrinks them to a tiny layer)")
    parser.add_argument("--hidden", type=int, default=None, help="overrides the model's hidden size")
    parser.add_argument("--experts", type=int, default=None, help="overrides the number of experts (all ranks)")
    parser.add_argument("--topk", type=int, default=None, help="overrides the experts per token")
    parser.add_argument("--expert-ffn", dest="ffn", type=int, default=None, help="overrides each expert's FFN width")
    parser.add_argument("--tokens", default=None,
                        help="tokens per rank, comma-separated: one config each (default 4096; --quick 512, CPU 16)")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated: torch, bf16, fp8-rowwise, fp8-blockwise, fp8-tensorwise "
                             f"(default {DEFAULT_VARIANTS})")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per variant (default 10; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed calls per variant first (default 2; --quick 1)")
    parser.add_argument("--nproc", type=int, default=2, help="without torchrun: processes to spawn (default 2)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when there is a GPU")
    parser.add_argument("--quick", action="store_true", help="smoke form: few tokens, few calls (CPU works)")
    parser.add_argument("--out", "--out-dir", dest="out", default=None,
                        help="report folder (default $TURBO_BENCH_OUT/moe_layer, else bench-out/moe_layer)")
    parser.add_argument("--name", default=None, help="report name (default moe_layer, moe_layer_quick with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    args = parser.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    args.variants = [s.strip() for s in args.variants.split(",") if s.strip()]
    for spec in args.variants:
        try:
            v = parse_variant(spec)
        except ValueError as exc:
            parser.error(str(exc))
        if v.tune or v.kit == "unfused":
            parser.error(f"--variants {spec}: the layer bench takes torch, bf16 and fp8-<recipe> without flags")
    args.iters = args.iters or (2 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out = Path(args.out) if args.out else H.resolve_out_dir(None) / "moe_layer"
    args.name = args.name or "moe_layer" + ("_quick" if args.quick else "")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (see the device notes)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        return 1 if run_rank(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                             int(os.environ.get("LOCAL_RANK", 0)), local_world) else 0
    world = args.nproc
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if world < 2:
        raise SystemExit("bench_moe_layer: --nproc must be at least 2 (expert parallelism over ranks)")
    if args.device == "cuda" and not gpus:
        raise SystemExit("bench_moe_layer: --device cuda: no GPU is visible to torch")
    if args.device == "cuda" and gpus < world:
        return skipped(args, world, f"needs {world} GPUs (one per rank); {gpus} visible")
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    context = mp.start_processes(_spawned, args=(args, world), nprocs=world, start_method="spawn", join=False)
    # SIGTERM (the suite's time limit) ends the ranks too; the reports of the configs done so far stay
    signal.signal(signal.SIGTERM, lambda *_: [p.terminate() for p in context.processes])
    try:
        while not context.join():
            pass
    except ProcessException as exc:  # a rank with turbo FAIL rows exits 1 (rank 0 lists them), or one crashed
        print(f"bench_moe_layer: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
