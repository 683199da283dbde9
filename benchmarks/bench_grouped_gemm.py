"""Grouped (MoE expert) GEMM benchmark on real MoE shapes: turbo_dispatch vs plain PyTorch.

Shapes (turbo_dispatch.presets.moe_grouped_shapes): the routed experts' up/gate (n = 2 *
moe_intermediate, k = hidden) and down (n = hidden, k = moe_intermediate) GEMMs of DeepSeek-V3,
DeepSeek-V2, Qwen3-30B-A3B, Mixtral-8x7B, Kimi-K2 and gpt-oss-20b on one rank under expert
parallelism (EP 8/16/32: local experts = experts // EP), with ``tokens_per_expert`` tokens per
expert on average, deduplicated. Weights are [G, N, K] (nn.Linear layout, ``trans_b=True``).
Three routings of the same token count, with ``group_lens`` on the device:

* ``balanced``: every expert gets the same number of tokens;
* ``skewed``: Zipf-like, expert i gets a share proportional to 1 / (i + 1)^1.2;
* ``empty``: a quarter of the experts get no token, the rest share evenly (needs G >= 4).

Modes:

* ``--dtype bf16``: peer ``torch._grouped_mm`` (forward, dgrad and wgrad in an autograd.Function
  written here; a per-group ``torch.mm`` loop where torch._grouped_mm cannot run, e.g. on the CPU)
  vs ``turbo_dispatch.ops.grouped_gemm`` with each registered backend pinned and autotuned.
  Forward, backward (dgrad + wgrad) and the step are timed.
* ``--dtype fp8 --granularity rowwise``: peer = rowwise quantisation in plain torch ops +
  ``torch._scaled_grouped_mm`` (forward; quantisation counted on both sides) vs
  ``turbo_dispatch.ops.grouped_gemm_fp8`` per backend / autotuned (forward, and the whole op's
  step); a bf16 ``torch._grouped_mm`` row gives ``vs_bf16_step``.
* ``--dtype fp8 --granularity blockwise``: turbo per backend, forward TFLOPS and the whole op
  (fwd + bwd); torch has no blockwise fp8 grouped GEMM, so the bf16 ``torch._grouped_mm`` step is
  the peer (the ratio is the speed-up over bf16 grouped).

Every timed step also gets ``step_wall_ms``: 20 back-to-back steps (``--wall-iters``) synchronised only at
the end, what a training loop sees where the host, not the GPU, bounds the step (fp8 rows add
``vs_bf16_wall``). ``--shapes GxTxNxK,...`` runs shapes no preset has; ``--profile N`` writes cProfile and
torch.profiler tables of N eager steps per turbo variant to ``<out>/profiles/``.

Group offsets are computed once per case, outside the timed region, and given to both sides
(turbo as ``group_offs``, torch as its int32 end offsets), as an MoE layer computes them once from
its routing for all its GEMMs.

Check column: SNR / relative error against a per-group fp32 (GPU) / float64 (CPU) reference of
the output and, where a step is timed, both gradients. See benchmarks/harness.py.

Usage:
    python benchmarks/bench_grouped_gemm.py                        # bf16, GPU
    python benchmarks/bench_grouped_gemm.py --dtype fp8 --granularity rowwise --quick
    python benchmarks/bench_grouped_gemm.py --quick --device cpu   # smoke run (tiny shapes)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import harness as H  # noqa: E402
from bench_out import resolve_out_dir  # noqa: E402
import turbo_dispatch as turbo  # noqa: E402
from turbo_dispatch.device_platform import platform_of  # noqa: E402
from turbo_dispatch.low_precision import Float8QuantConfig  # noqa: E402
from turbo_dispatch.presets import get_model, moe_grouped_shapes  # noqa: E402
from turbo_dispatch.registry import get_registry  # noqa: E402

DEFAULT_MODELS = ["deepseek-v3", "deepseek-v2", "qwen3-30b-a3b", "mixtral-8x7b", "kimi-k2", "gpt-oss-20b"]
QUICK_MODELS = ["deepseek-v3", "qwen3-30b-a3b"]
ROUTINGS = ("balanced", "skewed", "empty")
E4M3 = torch.float8_e4m3fn
#: Cases above this many routed tokens are skipped (memory of the fp32 reference, run time).
MAX_TOKENS = 1 << 17


@dataclass
class Case:
    label: str
    model: str
    ep: int
    tpe: int
    routing: str
    g: int
    m: int
    n: int
    k: int


def collect_cases(models, eps, tpes, routings) -> tuple[list[Case], list[str]]:
    cases, seen, skipped = [], set(), []
    for name in models:
        model = get_model(name)
        for ep in eps:
            for tpe in tpes:
                for s in moe_grouped_shapes(model, ep=ep, tokens_per_expert=tpe):
                    if s.m_total > MAX_TOKENS:
                        skipped.append(f"{model.name} EP{ep} {tpe} tok/expert {s.name} (M={s.m_total})")
                        continue
                    for routing in routings:
                        if routing == "empty" and s.groups < 4:
                            continue
                        key = (s.groups, s.m_total, s.n, s.k, routing)
                        if key in seen:
                            continue
                        seen.add(key)
                        cases.append(Case(f"{model.name}/{s.name}/EP{ep}/{tpe}tpe/{routing}", model.name, ep, tpe,
                                          routing, s.groups, s.m_total, s.n, s.k))
    notes = []
    if skipped:
        notes.append(f"skipped {len(skipped)} shape(s) above {MAX_TOKENS} routed tokens: "
                     + "; ".join(dict.fromkeys(skipped)))
    return cases, notes


def custom_cases(spec: str, routings) -> list[Case]:
    """Cases from ``--shapes``: comma-separated ``GxTxNxK`` (G experts of T tokens each on average,
    weights [G, N, K]), e.g. ``16x2048x4096x1536``; shapes no preset has, as a tuner meets them."""
    cases = []
    for g, t, n, k in H.parse_shapes(spec, "GxTxNxK"):
        for routing in routings:
            if routing == "empty" and g < 4:
                continue
            cases.append(Case(f"custom/G{g}xT{t}/N{n}/K{k}/{routing}", "custom", 0, t, routing, g, g * t, n, k))
    return cases


def group_lens(routing: str, g: int, total: int, device) -> torch.Tensor:
    """Tokens per expert summing to ``total`` (int64, on ``device``)."""
    if routing == "balanced":
        weights = torch.ones(g, dtype=torch.float64)
    elif routing == "skewed":
        weights = 1.0 / torch.arange(1, g + 1, dtype=torch.float64) ** 1.2
    elif routing == "empty":
        weights = torch.ones(g, dtype=torch.float64)
        weights[torch.randperm(g)[: g // 4]] = 0.0
    else:
        raise ValueError(f"unknown routing {routing!r}; valid: {', '.join(ROUTINGS)}")
    lens = torch.floor(weights / weights.sum() * total).to(torch.int64)
    lens[int(torch.argmax(weights))] += total - int(lens.sum())  # remainder to the busiest expert
    return lens.to(device)


# -- peers -----------------------------------------------------------------------------------------
def grouped_mm_usable(device, dtype=torch.bfloat16) -> str | None:
    if device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm needs an NVIDIA sm_90/sm_100 GPU"
    if torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return "torch._grouped_mm runs on sm_90/sm_100 only"
    return None


class TorchGroupedMM(torch.autograd.Function):
    """out = per-group a @ b[i]^T with torch._grouped_mm; dgrad and wgrad likewise (b is [G, N, K])."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return torch._grouped_mm(a, b.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, g):
        a, b, offs = ctx.saved_tensors
        dx = torch._grouped_mm(g, b, offs=offs)
        dw = torch._grouped_mm(g.t(), a, offs=offs)  # [G, N, K]; column-major lhs, as torch requires
        return dx, dw, None


def loop_grouped(a, b, lens_host: list[int]) -> torch.Tensor:
    """Per-group torch.mm (autograd records it); the portable peer."""
    outs, start = [], 0
    for i, n in enumerate(lens_host):
        outs.append(a[start:start + n] @ b[i].t())
        start += n
    return torch.cat(outs)


def torch_rowwise_fp8_forward(a, b, offs) -> torch.Tensor:
    """Rowwise fp8 forward in plain torch: quantise a per row and b per (group, output row), then
    torch._scaled_grouped_mm. Quantisation is part of what is timed."""
    tiny = torch.finfo(torch.float32).tiny
    sa = (a.abs().amax(dim=1, keepdim=True).float() / 448.0).clamp_min(tiny)
    sb = (b.abs().amax(dim=2, keepdim=True).float() / 448.0).clamp_min(tiny)
    aq = (a.float() / sa).clamp(-448, 448).to(E4M3)
    bq = (b.float() / sb).clamp(-448, 448).to(E4M3)
    return torch._scaled_grouped_mm(aq, bq.transpose(1, 2), sa.reshape(-1), sb.reshape(b.shape[0], b.shape[1]),
                                    offs=offs, out_dtype=torch.bfloat16)


# -- measurement -----------------------------------------------------------------------------------
@dataclass
class Variant:
    label: str
    fwd: Callable[[], torch.Tensor]
    enter: Callable[[], None]
    peer: bool = False
    gate_snr: float | None = None
    grads: bool = True  # time and check the backward too
    explain: Callable[[], str] | None = None


pin, plain = H.backend_pins("grouped_gemm")


def references(a, b, lens_host, grad, device):
    wide = torch.float64 if device.type == "cpu" else torch.float32
    out = torch.empty(a.shape[0], b.shape[1], dtype=wide, device=device)
    dx = torch.empty(a.shape, dtype=wide, device=device)
    dw = torch.zeros(b.shape, dtype=wide, device=device)
    start = 0
    for i, n in enumerate(lens_host):
        ai, gi, bi = a[start:start + n].detach().to(wide), grad[start:start + n].to(wide), b[i].detach().to(wide)
        out[start:start + n] = ai @ bi.t()
        dx[start:start + n] = gi @ bi
        if n:
            dw[i] = gi.t() @ ai
        start += n
    return out, dx, dw


def gate(v: Variant, row: H.Row, a, b, grad, refs) -> H.Row:
    """The correctness gate (output, and dgrad and wgrad where the variant has them)."""
    return H.gate_variant(row, v.enter, v.fwd, (a, b) if v.grads else (), grad, refs, ("out", "dgrad", "wgrad"),
                          v.gate_snr)


def variants_for(args, device, a, b, lens, offs, lens_host) -> list[Variant]:
    """``offs``: int32 group offsets [G + 1]; turbo takes them as ``group_offs``, the torch peers
    their end offsets ``offs[1:]`` (the form torch._grouped_mm reads)."""
    offs_end = offs[1:]
    op = "grouped_gemm" if args.dtype == "bf16" else "grouped_gemm_fp8"
    names = [e.name for e in get_registry().backends(op, platform_of(device.type))]
    if args.backends:
        names = [n for n in names if n in args.backends]
    why_not_gmm = grouped_mm_usable(device)
    if why_not_gmm is None:
        bf16_peer = Variant("torch._grouped_mm", lambda: TorchGroupedMM.apply(a, b, offs_end), plain)
    else:
        bf16_peer = Variant("torch per-group mm loop", lambda: loop_grouped(a, b, lens_host), plain)
    out: list[Variant] = []
    if args.dtype == "bf16":
        bf16_peer.peer = True
        out.append(bf16_peer)
        call = lambda: turbo.ops.grouped_gemm(a, b, lens, group_offs=offs, trans_b=True)
        snr, kw = None, {}
    else:
        cfg = Float8QuantConfig(granularity=args.granularity,
                                block_size=128 if args.granularity == "blockwise" else None)
        call = lambda: turbo.ops.grouped_gemm_fp8(a, b, lens, group_offs=offs, trans_b=True, config=cfg)
        snr, kw = 25.0, {"config": cfg}
        if args.granularity == "rowwise":
            if why_not_gmm is None and hasattr(torch, "_scaled_grouped_mm"):
                out.append(Variant("torch._scaled_grouped_mm rowwise (fwd)",
                                   lambda: torch_rowwise_fp8_forward(a, b, offs_end), plain, peer=True,
                                   gate_snr=25.0, grads=False))
            for name in names:
                out.append(Variant(f"turbo {name} (fwd)", call, pin(name), gate_snr=snr, grads=False))
        else:
            bf16_peer.peer = True  # no torch blockwise fp8 grouped GEMM: bf16 grouped is the bar
        bf16_peer.label = "bf16 " + bf16_peer.label
    for name in names:
        out.append(Variant(f"turbo {name}", call, pin(name), gate_snr=snr, explain=_explain(op, a, b, lens, kw)))
    out.append(Variant("turbo autotune", call, pin(None, auto=True), gate_snr=snr, explain=_explain(op, a, b, lens, kw)))
    if args.dtype == "fp8":
        out.append(bf16_peer)
    return out


def _explain(op, a, b, lens, kw):
    def text() -> str:
        d = turbo.explain(op, a, b, lens, trans_b=True, **kw)
        cfg = "" if d.config is None else f"[{d.config}]"
        return f"fwd -> {d.backend}{cfg} ({d.source})"
    return text


def profile_steps(args, device, case: Case, entries, a, b, grad) -> None:
    """``--profile N``: N eager steps of each variant under the profilers, one text file each."""
    folder = resolve_out_dir(args.out_dir) / "profiles"
    for row, v in entries:
        v.enter()
        H.profile_to_file(folder, f"{case.label}_{row.backend}",
                          lambda v=v: torch.autograd.grad(v.fwd(), (a, b), grad), args.profile, device,
                          f"{case.label}: {row.backend}, forward + backward")


def run(args, device, timer, cases: list[Case], rows: list[H.Row]) -> None:
    op_label = "grouped_gemm" if args.dtype == "bf16" else f"grouped_gemm_fp8_{args.granularity}"
    for i, c in enumerate(cases):
        t0 = time.time()
        a = torch.randn(c.m, c.k, device=device, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(c.g, c.n, c.k, device=device, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(c.m, c.n, device=device, dtype=torch.bfloat16)
        lens = group_lens(c.routing, c.g, c.m, device)
        lens_host = lens.tolist()
        # The offsets are computed once per step, outside what is timed, for the peer and for
        # turbo alike: an MoE layer derives them once from its routing for all its GEMMs.
        offs_end = torch.cumsum(lens, 0, dtype=torch.int32)
        offs = torch.nn.functional.pad(offs_end, (1, 0))
        refs = references(a, b, lens_host, grad, device)
        variants = variants_for(args, device, a, b, lens, offs, lens_host)
        shape_rows: list = [None] * len(variants)  # in variant order (the bf16 row stays last)
        for j in H.rotated(range(len(variants)), i):
            v = variants[j]
            row = H.Row(op=op_label, shape=c.label, backend=v.label, model=c.model, m=c.m, n=c.n, k=c.k,
                        flops=2.0 * c.m * c.n * c.k, peer=v.peer,
                        extra={"groups": c.g, "ep": c.ep, "tokens_per_expert": c.tpe, "routing": c.routing,
                               "max_group": max(lens_host), "empty_groups": sum(1 for n in lens_host if n == 0)})
            shape_rows[j] = gate(v, row, a, b, grad, refs)
        H.time_rows([(shape_rows[j], variants[j]) for j in H.rotated(range(len(variants)), i)], timer, (a, b), grad,
                    wants_grad=lambda v: v.grads)
        stepped = [(shape_rows[j], variants[j]) for j in H.rotated(range(len(variants)), i)
                   if variants[j].grads and shape_rows[j].passed and shape_rows[j].step_ms]
        if args.wall_iters > 0 and stepped:
            walls = H.wall_ms([lambda v=v: torch.autograd.grad(v.fwd(), (a, b), grad) for _, v in stepped],
                              [v.enter for _, v in stepped], device, iters=args.wall_iters)
            for (r, _), ms in zip(stepped, walls):
                r.extra["step_wall_ms"] = round(ms, 4)
        if args.profile > 0:
            profile_steps(args, device, c, [(r, v) for r, v in stepped if v.label.startswith("turbo")], a, b, grad)
        if args.dtype == "fp8":
            bf16 = shape_rows[-1]
            for r in shape_rows[:-1]:
                if r.passed and bf16.passed and r.step_ms:
                    r.extra["vs_bf16_step"] = round(bf16.step_ms / r.step_ms, 3)
                    if "step_wall_ms" in r.extra and "step_wall_ms" in bf16.extra:
                        r.extra["vs_bf16_wall"] = round(bf16.extra["step_wall_ms"] / r.extra["step_wall_ms"], 3)
        rows += shape_rows
        del a, b, grad, refs, lens, offs_end, variants
        plain()
        H.free_memory(device)
        print(f"[{i + 1}/{len(cases)}] {c.label} G={c.g} M={c.m} N={c.n} K={c.k}: " + ", ".join(
            f"{r.backend}={r.check.status if r.check else 'SKIP'}"
            + (f" {(r.step_ms or r.fwd_ms):.3f}ms" if (r.step_ms or r.fwd_ms) else "") for r in shape_rows)
            + f" ({time.time() - t0:.1f}s)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--granularity", choices=["rowwise", "blockwise"], default="rowwise")
    parser.add_argument("--models", default=None, help="comma-separated MoE presets (default: the 6 MoE models)")
    parser.add_argument("--ep", default=None, help="expert-parallel sizes, comma-separated (default 8,32)")
    parser.add_argument("--tokens-per-expert", default=None, help="comma-separated (default 512,4096)")
    parser.add_argument("--routings", default=None, help=f"comma-separated subset of {','.join(ROUTINGS)}")
    parser.add_argument("--backends", default=None,
                        help="comma-separated turbo backends to pin and time (default: all registered; the "
                             "autotuned row and the peers always run), e.g. TRITON to skip the TORCH blockwise "
                             "emulation, which takes minutes at large shapes")
    parser.add_argument("--shapes", default=None, metavar="GxTxNxK[,...]",
                        help="custom shapes instead of the presets: G experts x T tokens each x N x K")
    parser.add_argument("--wall-iters", type=int, default=20,
                        help="steps per round of the wall-time loop (step_wall_ms; 0: not measured)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile N eager steps of every turbo variant per case (cProfile + torch.profiler "
                             "tables, one text file per case and variant in the output folder)")
    H.add_common_args(parser)
    args = parser.parse_args(argv)
    device = H.pick_device(args.device)
    H.set_tune_budget(args.tune_budget_ms, args.quick)
    cpu = device.type == "cpu"
    models = args.models.split(",") if args.models else (["tiny"] if cpu else QUICK_MODELS if args.quick
                                                          else DEFAULT_MODELS)
    eps = [int(v) for v in args.ep.split(",")] if args.ep else ([1] if cpu else [8] if args.quick else [8, 32])
    tpes = ([int(v) for v in args.tokens_per_expert.split(",")] if args.tokens_per_expert
            else ([16] if cpu else [2048] if args.quick else [512, 4096]))
    routings = args.routings.split(",") if args.routings else list(ROUTINGS)
    known = [e.name for e in get_registry().backends("grouped_gemm_fp8" if args.dtype == "fp8" else "grouped_gemm")]
    args.backends = [b.strip().upper() for b in args.backends.split(",")] if args.backends else None
    for b in args.backends or []:
        if b not in known:
            raise SystemExit(f"--backends: unknown {b!r}; registered: {', '.join(known)}")
    for r in routings:
        if r not in ROUTINGS:
            raise SystemExit(f"--routings: unknown {r!r}; valid: {', '.join(ROUTINGS)}")
    if args.shapes is not None:
        cases, notes = custom_cases(args.shapes, routings), []
        models = ["custom"]
    else:
        cases, notes = collect_cases(models, eps, tpes, routings)
    timer = H.make_timer(device, args.quick, args.target_ms)
    torch.manual_seed(0)
    t0 = time.time()
    rows: list[H.Row] = []
    with H.interruptible() as stopped:
        run(args, device, timer, cases, rows)
    if stopped:
        notes = [f"INTERRUPTED ({stopped[0]}): partial results"] + notes
    plain()
    name = args.name or ("bf16" if args.dtype == "bf16" else f"fp8_{args.granularity}") + "_grouped_gemm" + (
        "_quick" if args.quick else "")
    notes = [f"models: {', '.join(models)}; EP {eps}; tokens per expert {tpes}; routings {routings}; "
             f"{len(cases)} cases", f"autotune budget per key: PRIMUS_TURBO_TUNE_BUDGET_MS="
             f"{os.environ.get('PRIMUS_TURBO_TUNE_BUDGET_MS')}", f"elapsed {time.time() - t0:.0f} s"] + notes
    H.write_reports(rows, name=name, device=device, out_dir=args.out_dir, notes=notes,
                    title=f"Grouped GEMM {args.dtype}" + ("" if args.dtype == "bf16" else f" {args.granularity}"),
                    breakdown=("routing",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
