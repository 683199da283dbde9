"""Attention benchmark: the ``attention`` op's backends side by side, forward, backward and step.

Every case runs ``turbo_dispatch.ops.flash_attn_func`` (dense ``[B, S, H, D]``) or
``flash_attn_varlen_func`` (packed sequences) with each registered attention backend pinned in
turn (TORCH: PyTorch's SDPA / FlashAttention-2 kernels; CUDNN: cuDNN's fused attention; TRITON:
our flash attention kernels) and once autotuned; TORCH and CUDNN are the peers, so a ratio above 1
means faster than the best of them. A backend that refuses a case (CUDNN: windows, varlen) gets a
"not served" row. Metrics are timed in turns (benchmarks/harness.py), so the GPU's clock drift
reaches every backend alike.

Cases: dense full and causal (MHA 32 heads; GQA 64 q / 8 kv heads), sliding windows (left 1024),
head dims 64, 128, 192 (q/k) with 128 (v), and 256, sequence lengths 1k-32k at about 16k tokens
per batch, and varlen batches (equal and mixed lengths, causal and windowed). ``--quick`` takes a
subset that covers each kind once (the issue's anchor shapes among them).

FLOPs: the forward counts 2 * (attended query-key pairs) * heads * (Dqk + Dv), the pairs counted
exactly for causal and windowed masks (bottom-right aligned) and per sequence for varlen; the
backward counts 2.5 times the forward (five matmuls against two) and the step 3.5 times. TFLOPS
columns: ``fwd_tflops``, ``bwd_tflops`` (extra column) and ``step_tflops``.

Check: SNR >= 40 dB of out, dq, dk and dv against a float32 reference of the same bf16/fp16
inputs (PyTorch SDPA on float32 copies, float64 on the CPU); a FAIL voids the row's timing.

Usage:
    python benchmarks/bench_attention.py --quick                 # subset, GPU
    python benchmarks/bench_attention.py                         # every case, GPU
    python benchmarks/bench_attention.py --only gqa,varlen       # cases whose label holds a word
    python benchmarks/bench_attention.py --quick --device cpu    # smoke run (tiny shapes)
    python benchmarks/bench_attention.py --quick --only varlen --profile 10   # + profiler tables per backend
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import harness as H  # noqa: E402
from bench_out import resolve_out_dir  # noqa: E402
import turbo_dispatch as turbo  # noqa: E402
from turbo_dispatch.device_platform import platform_of  # noqa: E402
from turbo_dispatch.registry import get_registry  # noqa: E402

PEERS = ("TORCH", "CUDNN")
TOKENS = 16384  # query tokens per dense batch: B = TOKENS // S (at least 1)
MIN_SNR_DB = 40.0


@dataclass(frozen=True)
class Case:
    """One attention call. Dense: ``batch`` sequences of ``seqlen``; varlen: ``lens`` (q and k
    alike), ``seqlen`` their max."""

    kind: str  # the score breakdown's column: dense-full, dense-causal, window, varlen
    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    d: int
    dv: int
    causal: bool = False
    window: tuple = (-1, -1)
    lens: Optional[tuple] = None

    @property
    def label(self) -> str:
        heads = f"h{self.heads_q}" if self.heads_q == self.heads_kv else f"gqa{self.heads_q}/{self.heads_kv}"
        dims = f"d{self.d}" if self.d == self.dv else f"d{self.d}-{self.dv}"
        mask = "causal" if self.causal else "full"
        if self.window != (-1, -1):
            mask = f"win{self.window[0]},{self.window[1]}" + ("-causal" if self.causal else "")
        if self.lens is not None:
            lens = f"{len(self.lens)}x{self.lens[0]}" if len(set(self.lens)) == 1 else f"{len(self.lens)}seq-mixed"
            return f"varlen-{lens}-{heads}-{dims}-{mask}"
        return f"b{self.batch}-s{self.seqlen}-{heads}-{dims}-{mask}"

    @property
    def kwargs(self) -> dict:
        return dict(causal=self.causal, window_size=self.window)


def dense(s: int, hq: int, hk: int, d: int, dv: int | None = None, causal=False, window=(-1, -1),
          batch: int | None = None) -> Case:
    kind = "window" if window != (-1, -1) else ("dense-causal" if causal else "dense-full")
    return Case(kind, batch or max(1, TOKENS // s), s, hq, hk, d, dv or d, causal, tuple(window))


def varlen(lens, hq: int, hk: int, d: int, causal=False, window=(-1, -1)) -> Case:
    return Case("varlen", len(lens), max(lens), hq, hk, d, d, causal, tuple(window), tuple(lens))


MIXED = (512, 3072, 1024, 4096, 256, 2048, 1536, 3584)


def all_cases() -> list[Case]:
    cases = []
    for s in (1024, 2048, 4096, 8192, 16384, 32768):
        for causal in (False, True):
            cases.append(dense(s, 32, 32, 128, causal=causal))
    for d in (64, 256):
        for s in (2048, 8192):
            for causal in (False, True):
                cases.append(dense(s, 32 if d == 64 else 16, 32 if d == 64 else 16, d, causal=causal))
    for s in (4096, 8192):
        for causal in (False, True):
            cases.append(dense(s, 32, 32, 192, 128, causal=causal))
    for s in (4096, 8192, 16384):
        for causal in (False, True):
            cases.append(dense(s, 64, 8, 128, causal=causal))
    for s in (4096, 8192, 32768):
        cases.append(dense(s, 32, 32, 128, causal=True, window=(1024, 0)))
    cases.append(dense(8192, 64, 8, 128, causal=True, window=(1024, 0)))
    cases.append(dense(8192, 32, 32, 128, window=(512, 512)))
    cases += [varlen([1024] * 8, 32, 32, 128, causal=True), varlen([2048] * 16, 64, 8, 128, causal=True),
              varlen(MIXED, 32, 32, 128), varlen(MIXED, 32, 32, 128, causal=True),
              varlen([8192] * 4, 32, 32, 128, causal=True, window=(1024, 0))]
    return cases


def quick_cases() -> list[Case]:
    return [dense(4096, 32, 32, 128, batch=2), dense(4096, 32, 32, 128, causal=True, batch=2),
            dense(8192, 64, 8, 128, causal=True, batch=1), dense(4096, 32, 32, 192, 128, causal=True, batch=2),
            dense(2048, 32, 32, 64, causal=True), dense(2048, 16, 16, 256),
            dense(8192, 32, 32, 128, causal=True, window=(1024, 0), batch=1),
            varlen([1024] * 8, 32, 32, 128, causal=True), varlen(MIXED, 32, 32, 128)]


def cpu_cases() -> list[Case]:
    return [dense(64, 2, 2, 32, causal=True, batch=2), dense(48, 4, 2, 32, 16, window=(8, 0), batch=1),
            varlen([17, 40, 9], 2, 1, 32, causal=True)]


# -- FLOPs ---------------------------------------------------------------------------------------------
def attended_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """Query-key pairs a bottom-right aligned (left, right) window lets through (-1 = unbounded)."""
    i = torch.arange(sq, dtype=torch.int64)
    off = sk - sq
    hi = (i + off + right).clamp(max=sk - 1) if right >= 0 else torch.full_like(i, sk - 1)
    lo = (i + off - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    return int((hi - lo + 1).clamp(min=0).sum())


def forward_flops(c: Case) -> float:
    right = 0 if c.causal else c.window[1]
    lens = c.lens if c.lens is not None else [c.seqlen] * c.batch
    pairs = sum(attended_pairs(n, n, c.window[0], right) for n in lens)
    return 2.0 * pairs * c.heads_q * (c.d + c.dv)


# -- inputs and reference ---------------------------------------------------------------------------
@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor
    cu: Optional[torch.Tensor]

    @property
    def leaves(self) -> tuple:
        return self.q, self.k, self.v


def make_inputs(c: Case, dtype: torch.dtype, device: torch.device) -> Inputs:
    if c.lens is None:
        lead_q, lead_k = (c.batch, c.seqlen), (c.batch, c.seqlen)
        cu = None
    else:
        lead_q = lead_k = (sum(c.lens),)
        cu = torch.tensor([0] + [sum(c.lens[:i + 1]) for i in range(len(c.lens))], dtype=torch.int32, device=device)

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()

    q, k, v = leaf(*lead_q, c.heads_q, c.d), leaf(*lead_k, c.heads_kv, c.d), leaf(*lead_k, c.heads_kv, c.dv)
    return Inputs(q, k, v, torch.randn(*lead_q, c.heads_q, c.dv, device=device, dtype=dtype), cu)


def _reference_one(c: Case, q, k, v, grad):
    """Wide-precision (out, dq, dk, dv) of one dense [B, S, H, D] batch through SDPA."""
    wide = torch.float64 if q.device.type == "cpu" else torch.float32
    qf, kf, vf = (x.detach().to(wide).requires_grad_() for x in (q, k, v))
    rep = c.heads_q // c.heads_kv
    qt, kt, vt = qf.transpose(1, 2), kf.repeat_interleave(rep, 2).transpose(1, 2), vf.repeat_interleave(rep, 2).transpose(1, 2)
    sq, sk = q.shape[1], k.shape[1]
    left, right = c.window[0], 0 if c.causal else c.window[1]
    mask, is_causal = None, False
    if left < 0 and right == 0 and sq == sk:
        is_causal = True
    elif left >= 0 or right >= 0:
        i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        j = torch.arange(sk, device=q.device)[None]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if right >= 0:
            mask &= j <= i + right
        if left >= 0:
            mask &= j >= i - left
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=is_causal).transpose(1, 2)
    grads = torch.autograd.grad(out, (qf, kf, vf), grad.to(wide))
    return (out.detach(), *grads)


def reference(c: Case, x: Inputs):
    if c.lens is None:
        return _reference_one(c, x.q, x.k, x.v, x.grad)
    parts = []
    start = 0
    for n in c.lens:
        s = slice(start, start + n)
        parts.append(_reference_one(c, *(t[None, s] for t in (x.q, x.k, x.v, x.grad))))
        start += n
    return tuple(torch.cat([p[i][0] for p in parts]) for i in range(4))


# -- variants ---------------------------------------------------------------------------------------
@dataclass
class Variant:
    label: str
    backend: Optional[str]  # None: autotuned
    fwd: Callable[[], torch.Tensor]
    enter: Callable[[], None]
    explain: Callable[[], str]
    peer: bool = False


pin, plain = H.backend_pins("attn")


def variants(c: Case, x: Inputs, device: torch.device) -> list[Variant]:
    if c.lens is None:
        call = lambda: turbo.ops.flash_attn_func(x.q, x.k, x.v, **c.kwargs)  # noqa: E731
        args = (x.q, x.k, x.v)
    else:
        call = lambda: turbo.ops.flash_attn_varlen_func(x.q, x.k, x.v, x.cu, x.cu, c.seqlen, c.seqlen,  # noqa: E731
                                                        **c.kwargs)
        args = (x.q, x.k, x.v, x.cu, x.cu, c.seqlen, c.seqlen)

    def explain() -> str:
        d = turbo.explain("attention", *args, **c.kwargs)
        return f"fwd -> {d.backend}" + ("" if d.config is None else f"[{d.config}]") + f" ({d.source})"

    names = [e.name for e in get_registry().backends("attention", platform_of(device.type))]
    out = [Variant(f"turbo {n}", n, call, pin(n), explain, peer=n in PEERS) for n in names]
    out.append(Variant("turbo autotune", None, call, pin(None, auto=True), explain))
    return out


def gate(v: Variant, row: H.Row, x: Inputs, refs) -> H.Row:
    """The correctness gate (out and the three gradients)."""
    return H.gate_variant(row, v.enter, v.fwd, x.leaves, x.grad, refs, ("out", "dq", "dk", "dv"), MIN_SNR_DB)


def profile_case(c: Case, x: Inputs, vs: list[Variant], rows: list[H.Row], iters: int, device, folder: Path) -> None:
    """``--profile N``: N forward+backward steps of every variant that passed, under cProfile and
    torch.profiler (where the step's host and GPU time go), one text file each in ``folder``."""
    for v, r in zip(vs, rows):
        if r.passed:
            v.enter()
            step = lambda v=v: torch.autograd.grad(v.fwd(), x.leaves, x.grad)  # noqa: E731
            H.profile_to_file(folder, f"{c.label}_{v.label}", step, iters, device,
                              f"{c.label}: {v.label}, forward + backward")


def run_case(i: int, c: Case, dtype, device, timer, profile: int = 0, folder: Optional[Path] = None) -> list[H.Row]:
    x = make_inputs(c, dtype, device)
    refs = reference(c, x)
    vs = variants(c, x, device)
    flops = forward_flops(c)
    rows: list = [None] * len(vs)
    for j in H.rotated(range(len(vs)), i):
        v = vs[j]
        row = H.Row(op="attention", shape=c.label, backend=v.label, m=c.seqlen, n=c.heads_q, k=c.d, flops=flops,
                    step_flops=3.5 * flops, peer=v.peer, extra={"case": c.kind, "bwd_tflops": ""})
        rows[j] = gate(v, row, x, refs)
    del refs
    H.time_rows([(rows[j], vs[j]) for j in H.rotated(range(len(vs)), i)], timer, x.leaves, x.grad)
    for r in rows:
        if r.passed and r.bwd_ms:
            r.extra["bwd_tflops"] = round(2.5 * flops / (r.bwd_ms * 1e-3) / 1e12, 1)
    if profile > 0:
        profile_case(c, x, vs, rows, profile, device, folder)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--only", default=None,
                        help="comma-separated words; runs the cases whose label contains one (e.g. gqa,varlen,d256)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing a case, profile N forward+backward steps of each backend that passed "
                             "(cProfile + torch.profiler tables, one text file each under <out>/profiles/)")
    H.add_common_args(parser)
    args = parser.parse_args(argv)
    device = H.pick_device(args.device)
    H.set_tune_budget(args.tune_budget_ms, args.quick)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    cases = cpu_cases() if device.type == "cpu" else (quick_cases() if args.quick else all_cases())
    if args.only:
        words = [w for w in args.only.split(",") if w]
        cases = [c for c in cases if any(w in c.label for w in words)]
    timer = H.make_timer(device, args.quick, args.target_ms)
    torch.manual_seed(0)
    t0 = time.time()
    rows: list[H.Row] = []
    notes: list[str] = []
    with H.interruptible() as stopped:
        for i, c in enumerate(cases):
            t1 = time.time()
            shape_rows = run_case(i, c, dtype, device, timer, args.profile, resolve_out_dir(args.out_dir) / "profiles")
            rows += shape_rows
            plain()
            H.free_memory(device)
            print(f"[{i + 1}/{len(cases)}] {c.label}: "
                  + ", ".join(f"{r.backend}={r.check.status if r.check else 'SKIP'}"
                              + (f" {r.step_ms:.3f}ms" if r.step_ms else "") for r in shape_rows)
                  + f" ({time.time() - t1:.1f}s)", flush=True)
    if stopped:
        notes.append(f"INTERRUPTED ({stopped[0]}): partial results")
    plain()
    name = args.name or f"{args.dtype}_attention" + ("_quick" if args.quick else "")
    notes = [f"{len(cases)} cases, {args.dtype}; peers: {', '.join(PEERS)} (ratio > 1: faster than the best of them)",
             "FLOPs: forward 2 * attended pairs * heads * (Dqk + Dv) (causal/window pairs counted exactly); "
             "backward 2.5x, step 3.5x the forward",
             f"check: SNR >= {MIN_SNR_DB} dB of out, dq, dk, dv against a float32 reference of the same inputs",
             f"autotune budget per key: PRIMUS_TURBO_TUNE_BUDGET_MS={os.environ.get('PRIMUS_TURBO_TUNE_BUDGET_MS')}",
             f"elapsed {time.time() - t0:.0f} s"] + notes
    H.write_reports(rows, name=name, device=device, out_dir=args.out_dir, notes=notes,
                    title=f"Attention {args.dtype}", breakdown=["case"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
