"""GEMM benchmark on real model shapes: turbo_dispatch backends side by side with plain PyTorch.

Shapes: the linear layers (qkv, o_proj, gate_up, down) of Llama-2-7B/70B, Llama-3.1-8B/70B/405B,
Qwen2.5-7B/72B and Mistral-7B (turbo_dispatch.presets) at micro-batches 1, 2, 4 of 4096 tokens,
deduplicated (a shape shared by several models is measured once and lists them all).

``--shapes MxNxK[,...]`` measures the given shapes instead (rows ``custom/M<m>/N<n>/K<k>``; x is
[M, K], the weight [N, K]). ``--shapes unseen`` names a set of 8 LLM linear layers that no preset,
and no entry of the shipped tuned databases (turbo_dispatch/tuned/), has: token counts 3072, 5120,
6144 and 12288 (the presets run 4096 tokens per micro-batch: 4096, 8192, 16384) on the widths of
models that turbo_dispatch.presets lacks (their published Hugging Face configs; no (N, K) pair is a
preset's):

* Gemma-2-9B (hidden 3584, FFN 14336, 16 heads / 8 KV heads of dim 256): qkv (N 8192, K 3584),
  down (N 3584, K 14336);
* Phi-3-medium (hidden 5120, FFN 17920, 40 heads / 10 KV heads of dim 128): qkv (N 7680, K 5120),
  gate_up (N 35840, K 5120), down (N 5120, K 17920);
* Yi-34B (hidden 7168, FFN 20480, 56 heads of dim 128): o_proj (N 7168, K 7168), gate_up
  (N 40960, K 7168);
* Falcon-40B (hidden 8192, ungated FFN 32768): dense_h_to_4h (N 32768, K 8192).

The step runs each layer's forward (M, N, K), dgrad (M, K, N) and wgrad (N, K, M): none of them is
a preset's or a shipped tuned key, so the autotuned row meets all three as a new user's model would.

Modes:

* ``--dtype bf16``: peer ``torch.matmul`` vs ``turbo_dispatch.ops.gemm`` with each registered
  backend pinned (TORCH, CUBLASLT, TRITON, ... whatever serves this GPU) and the dispatched op with
  autotuning on. Forward, backward (dgrad + wgrad) and the combined step are timed.
* ``--dtype fp8 --granularity tensorwise|rowwise``: the whole fp8 op (quantisation included) with
  E4M3 operands everywhere. Peer: PyTorch's own recipe written in plain torch ops (amax, scale,
  saturating cast) + ``torch._scaled_mm``, forward and backward in an autograd.Function defined
  here; vs ``turbo_dispatch.ops.gemm_fp8`` per backend and autotuned. A bf16 ``torch.matmul`` row is
  timed too, and every fp8 row's ``vs_bf16_step`` column is bf16 step time / its step time.
* ``--dtype fp8 --granularity blockwise``: GEMM only, on operands quantised beforehand (1x128
  activations, 128x128 weights): ``F.scaled_mm`` blockwise (peer) vs the TRITON blockwise kernel
  when the Triton backend exposes one (best tile), and ``turbo_dispatch.ops.gemm_fp8`` called on
  the same quantised operands, pinned to each backend and autotuned; plus the single shape
  M=4096, N=7168, K=16384. The activation's scales are stored M-major for every candidate (the
  layout our quantiser writes and cuBLASLt reads) and the passing rows are timed in turns.

fp8 modes add a memory line: peak GPU memory of ``turbo_dispatch.modules.Linear`` fp8 vs bf16,
forward + backward.

Each row's Check is the gate against an fp32 reference (float64 on the CPU) of the same bf16
inputs, for the output and both gradients: bf16 rel. error <= 2e-2, fp8 SNR >= 25 dB. FAIL voids
the timing. See benchmarks/harness.py for timing and report conventions.

Usage:
    python benchmarks/bench_gemm.py --dtype bf16                  # full run, GPU
    python benchmarks/bench_gemm.py --dtype fp8 --granularity rowwise --quick
    python benchmarks/bench_gemm.py --quick --device cpu          # smoke run (tiny shapes)
    python benchmarks/bench_gemm.py --dtype bf16 --shapes unseen --tune-budget-ms 300
    python benchmarks/bench_gemm.py --shapes 8x16x32,24x40x56 --quick --device cpu
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import harness as H  # noqa: E402
import turbo_dispatch as turbo  # noqa: E402
from turbo_dispatch.device_platform import platform_of  # noqa: E402
from turbo_dispatch.errors import BackendUnsupportedError, NoBackendError  # noqa: E402
from turbo_dispatch.low_precision import Float8QuantConfig, ScalingGranularity, quantize  # noqa: E402
from turbo_dispatch.presets import dense_linear_shapes, get_model  # noqa: E402
from turbo_dispatch.registry import get_registry  # noqa: E402

DEFAULT_MODELS = ["llama2-7b", "llama2-70b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "qwen2.5-7b",
                  "qwen2.5-72b", "mistral-7b"]
QUICK_MODELS = ["llama3.1-8b", "qwen2.5-7b"]
E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
NOT_SERVED = (BackendUnsupportedError, NoBackendError)


@dataclass
class Shape:
    label: str
    models: list[str]
    mb: int | str  # "" for --shapes: no micro-batch
    m: int
    n: int
    k: int


#: ``--shapes unseen``: (model, layer, M, N, K) of LLM linear layers that no preset has (see the
#: module docstring for where the widths come from).
UNSEEN = (
    ("gemma-2-9b", "qkv", 3072, 8192, 3584),
    ("gemma-2-9b", "down", 6144, 3584, 14336),
    ("phi-3-medium", "qkv", 5120, 7680, 5120),
    ("phi-3-medium", "gate_up", 3072, 35840, 5120),
    ("phi-3-medium", "down", 12288, 5120, 17920),
    ("yi-34b", "o_proj", 6144, 7168, 7168),
    ("yi-34b", "gate_up", 5120, 40960, 7168),
    ("falcon-40b", "dense_h_to_4h", 12288, 32768, 8192),
)
SHAPE_SETS = {"unseen": UNSEEN}


def collect_shapes(models: list[str], mbs: list[int], seq_len: int | None) -> list[Shape]:
    """Preset linear shapes, deduplicated on (m, n, k); the first model names the row."""
    shapes: dict[tuple[int, int, int], Shape] = {}
    for name in models:
        model = get_model(name)
        for mb in mbs:
            for s in dense_linear_shapes(model, mb, seq_len):
                key = (s.m, s.n, s.k)
                if key in shapes:
                    shapes[key].models.append(model.name)
                else:
                    shapes[key] = Shape(f"{model.name}/{s.name}/mb{mb}", [model.name], mb, s.m, s.n, s.k)
    return list(shapes.values())


def custom_shapes(spec: str) -> list[Shape]:
    """Shapes from ``--shapes``: comma-separated ``MxNxK`` items (``custom/M<m>/N<n>/K<k>``) and
    names of ``SHAPE_SETS`` (``unseen/<model>/<layer>/M<m>``), deduplicated on (m, n, k) in the
    order given. Bad text raises SystemExit naming ``--shapes`` and the item."""
    shapes: dict[tuple[int, int, int], Shape] = {}
    for item in H.parse_shapes(spec, "MxNxK", names=SHAPE_SETS):
        if isinstance(item, str):
            found = [Shape(f"{item}/{model}/{layer}/M{m}", [model], "", m, n, k)
                     for model, layer, m, n, k in SHAPE_SETS[item]]
        else:
            m, n, k = item
            found = [Shape(f"custom/M{m}/N{n}/K{k}", ["custom"], "", m, n, k)]
        for s in found:
            shapes.setdefault((s.m, s.n, s.k), s)
    return list(shapes.values())


# -- PyTorch's own fp8 recipe (the peer) -----------------------------------------------------------
def torch_quant(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 with the dequant scale amax/448, per tensor (dim None) or per slice along ``dim``."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = (amax.float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(E4M3), scale


def _col_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


class TorchFp8Linear(torch.autograd.Function):
    """y = x @ w^T in fp8 with torch ops only: the recipe a PyTorch user writes by hand.
    Rowwise: scales per row of x / w (forward), per row of the gradient and per column of the
    other operand (backward); tensorwise: one scale per tensor. Everything E4M3."""

    @staticmethod
    def forward(ctx, x, w, rowwise: bool):
        ctx.save_for_backward(x, w)
        ctx.rowwise = rowwise
        d = 1 if rowwise else None
        xq, sx = torch_quant(x, d)
        wq, sw = torch_quant(w, d)
        return torch._scaled_mm(xq, wq.t(), sx, sw.t() if rowwise else sw, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        rw = ctx.rowwise
        gq, sg = torch_quant(g, 1 if rw else None)  # dgrad: reduce over N
        wq, sw = torch_quant(w, 0 if rw else None)
        dx = torch._scaled_mm(gq, _col_major(wq), sg, sw, out_dtype=x.dtype)
        gtq, sgt = torch_quant(g.t(), 1 if rw else None)  # wgrad: reduce over M
        xq, sx = torch_quant(x, 0 if rw else None)
        dw = torch._scaled_mm(gtq.contiguous(), _col_major(xq), sgt, sx, out_dtype=w.dtype)
        return dx, dw, None


# -- variants and measurement ----------------------------------------------------------------------
@dataclass
class Variant:
    label: str
    fwd: Callable[[], torch.Tensor]
    enter: Callable[[], None]
    peer: bool = False
    gate_snr: float | None = None  # None: bf16 relative-error gate
    explain: Callable[[], str] | None = None


pin, plain = H.backend_pins("gemm")


def gate(v: Variant, row: H.Row, x, w, grad, refs) -> H.Row:
    """The correctness gate (output, dgrad, wgrad)."""
    return H.gate_variant(row, v.enter, v.fwd, (x, w), grad, refs, ("out", "dgrad", "wgrad"), v.gate_snr)


def references(x, w, grad, device):
    wide = torch.float64 if device.type == "cpu" else torch.float32
    xf, wf, gf = x.detach().to(wide), w.detach().to(wide), grad.to(wide)
    refs = (xf @ wf.t(), gf @ wf, gf.t() @ xf)
    del xf, wf, gf
    return refs


def registered(op: str, device: torch.device) -> list[str]:
    return [e.name for e in get_registry().backends(op, platform_of(device.type))]


def _explain_fwd(op: str, x, w, **kw) -> Callable[[], str]:
    def text() -> str:
        d = turbo.explain(op, x, w, trans_b=True, **kw)
        cfg = "" if d.config is None else f"[{d.config}]"
        return f"fwd -> {d.backend}{cfg} ({d.source})"
    return text


def dense_variants(op: str, x, w, fp8: Float8QuantConfig | None, device) -> list[Variant]:
    out: list[Variant] = []
    if fp8 is None:
        out.append(Variant("torch.matmul", lambda: torch.matmul(x, w.t()), plain, peer=True))
        call = lambda: turbo.ops.gemm(x, w, trans_b=True)
        snr, kw = None, {}
    else:
        rowwise = fp8.granularity is ScalingGranularity.ROWWISE
        out.append(Variant(f"torch fp8 recipe ({fp8.granularity.value})",
                           lambda: TorchFp8Linear.apply(x, w, rowwise), plain, peer=True, gate_snr=25.0))
        call = lambda: turbo.ops.gemm_fp8(x, w, trans_b=True, config=fp8)
        snr, kw = 25.0, {"config": fp8}
    for name in registered(op, device):
        out.append(Variant(f"turbo {name}", call, pin(name), gate_snr=snr, explain=_explain_fwd(op, x, w, **kw)))
    out.append(Variant("turbo autotune", call, pin(None, auto=True), gate_snr=snr, explain=_explain_fwd(op, x, w, **kw)))
    return out


def run_dense(args, device, timer, shapes: list[Shape], rows: list[H.Row]) -> list[str]:
    fp8 = None if args.dtype == "bf16" else Float8QuantConfig(granularity=args.granularity)
    op = "gemm" if fp8 is None else "gemm_fp8"
    label = op if fp8 is None else f"gemm_fp8_{args.granularity}"
    dtype = torch.bfloat16
    for i, s in enumerate(shapes):
        t0 = time.time()
        x = torch.randn(s.m, s.k, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(s.n, s.k, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(s.m, s.n, device=device, dtype=dtype)
        refs = references(x, w, grad, device)
        variants = dense_variants(op, x, w, fp8, device)
        if fp8 is not None:
            variants.append(Variant("bf16 torch.matmul", lambda: torch.matmul(x, w.t()), plain))
        shape_rows: list = [None] * len(variants)  # in variant order (the bf16 row stays last)
        for j in H.rotated(range(len(variants)), i):
            v = variants[j]
            row = H.Row(op=label, shape=s.label, backend=v.label, model="+".join(s.models), mb=s.mb, m=s.m, n=s.n,
                        k=s.k, flops=2.0 * s.m * s.n * s.k, peer=v.peer)
            shape_rows[j] = gate(v, row, x, w, grad, refs)
        H.time_rows([(shape_rows[j], variants[j]) for j in H.rotated(range(len(variants)), i)], timer, (x, w), grad)
        if fp8 is not None:
            bf16 = shape_rows[-1]
            for r in shape_rows[:-1]:
                if r.passed and bf16.passed and r.step_ms:
                    r.extra["vs_bf16_step"] = round(bf16.step_ms / r.step_ms, 3)
        rows += shape_rows
        del x, w, grad, refs, variants
        plain()
        H.free_memory(device)
        print(f"[{i + 1}/{len(shapes)}] {s.label} m={s.m} n={s.n} k={s.k}: "
              + ", ".join(f"{r.backend}={r.check.status if r.check else 'SKIP'}"
                          + (f" {r.step_ms:.3f}ms" if r.step_ms else "") for r in shape_rows)
              + f" ({time.time() - t0:.1f}s)", flush=True)
    return []


# -- blockwise: GEMM only on pre-quantised operands -------------------------------------------------
def triton_blockwise_gemm():
    """The TRITON blockwise fp8 GEMM on pre-quantised operands, as (fn, "") or (None, why not).

    ``fn(qa, qb, out_dtype, tile)`` takes qa = the 1 x 128 quantised [M, K] activations and qb =
    the 128 x 128 quantised [N, K] weight (QuantizedTensors) and runs the kernel the tile's
    ``kernel`` field names: the Triton kernel of ``backends/triton/fp8_gemm_kernels.py`` or a Gluon
    one (``gemm.gluon_kernel``). ``tiles(m, n, k)`` lists the Triton adapter's candidate tiles on
    this machine (its default first; Gluon tiles only where they can run).
    """
    try:
        from turbo_dispatch.backends.triton import configs as tcfg
        from turbo_dispatch.backends.triton import fp8_gemm_kernels as kernels
        from turbo_dispatch.backends.triton.gemm import TritonGemmFp8, gluon_kernel
        from turbo_dispatch.ops.gemm import GemmFp8Problem
    except Exception as exc:
        return None, f"not available: turbo_dispatch.backends.triton fp8 kernels ({type(exc).__name__}: {exc})"
    adapter = TritonGemmFp8()
    reason = adapter.available()
    if reason:
        return None, f"not available: {reason}"

    def fn(qa, qb, out_dtype, tile):
        if tile.kernel in tcfg.GLUON_KERNELS:
            return gluon_kernel(tile.kernel).fp8_blockwise_gemm(qa.data, qb.data, qa.scale, qb.scale, out_dtype, tile,
                                                                a_group=1, b_group=qb.block_size)
        return kernels.fp8_gemm(qa.data, qb.data, qa.scale, qb.scale, kernels.SCALE_BLOCK, out_dtype, tile,
                                a_group=1, b_group=qb.block_size)

    def tiles(m, n, k):
        p = GemmFp8Problem(m, n, k, False, True, torch.bfloat16, torch.bfloat16, torch.bfloat16, E4M3, E4M3,
                           ScalingGranularity.BLOCKWISE, 128, False, True, "cuda")
        return [tcfg.from_tuple(c) for c in adapter.configs(p)]

    fn.tiles = tiles
    return fn, ""


def _best_tile(fn, qa, qb, ref, s, timer) -> tuple[H.Check, object, str]:
    """Gates every candidate tile and times the passing ones one after another; returns the
    fastest tile (None if none passed). The caller times it again, in turns with the other rows,
    so that neither the order nor the pick of a lucky sample favours it."""
    best, worst_check = None, None
    for tile in fn.tiles(s.m, s.n, s.k):
        try:
            out = fn(qa, qb, torch.bfloat16, tile)
            check = H.gate([("out", out, ref)], min_snr_db=25.0)
            del out
        except Exception as exc:
            check = H.failed("raised " + H.error_note(exc))
        if not check.ok:
            worst_check = check
            continue
        ms = timer.time_ms(lambda: fn(qa, qb, torch.bfloat16, tile))
        if best is None or ms < best[1]:
            best = (check, ms, tile)
    if best is None:
        return worst_check or H.failed("no candidate tile"), None, ""
    failed = f"; {worst_check.reasons[0]} on another tile" if worst_check else ""
    return best[0], best[2], f"tile {tuple(best[2])}" + failed


def run_blockwise(args, device, timer, shapes: list[Shape], rows: list[H.Row]) -> list[str]:
    from turbo_dispatch.backends.torch.gemm import _f_scaled_mm, _row_major, _scaled_mm_unsupported, blockwise_scales
    from turbo_dispatch.ops.gemm import GemmFp8Problem

    extra = Shape("single M=4096 N=7168 K=16384", ["-"], 1, 4096, 7168, 16384)
    if (device.type == "cuda" and args.shapes is None
            and all((s.m, s.n, s.k) != (extra.m, extra.n, extra.k) for s in shapes)):
        shapes = [extra] + shapes  # first: the target shape survives a time-limited run
    triton_fn, triton_why = triton_blockwise_gemm()
    plat = platform_of(device.type)
    cfg = Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=128)
    fp8_backends = registered("gemm_fp8", device)
    for i, s in enumerate(shapes):
        x = torch.randn(s.m, s.k, device=device, dtype=torch.bfloat16)
        w = torch.randn(s.n, s.k, device=device, dtype=torch.bfloat16)
        wide = torch.float64 if device.type == "cpu" else torch.float32
        ref = x.to(wide) @ w.to(wide).t()
        qa = quantize(x, E4M3, ScalingGranularity.BLOCKWISE, axis=1, block_size=128)
        # The activation's 1x128 scales stored M-major, as our quantiser writes them for the GEMM
        # and as cuBLASLt reads them: no candidate copies them inside its timing.
        qa = dataclasses.replace(qa, scale=qa.scale.t().contiguous().t())
        qb = quantize(w, E4M3, ScalingGranularity.BLOCKWISE, axis=1, block_size=128, block_2d=True)
        p = GemmFp8Problem(s.m, s.n, s.k, False, True, torch.bfloat16, torch.bfloat16, torch.bfloat16, E4M3, E4M3,
                           ScalingGranularity.BLOCKWISE, 128, False, True, plat)
        peer_why = (_scaled_mm_unsupported(p) if plat == "cuda"
                    else f"F.scaled_mm blockwise needs an NVIDIA GPU (platform {plat})")
        peer = peer_args = None
        if peer_why is None:  # the peer's operands and scales laid out once: its timing is the GEMM alone
            peer_args = (_row_major(qa.data), _row_major(qb.data).t(), *blockwise_scales(p, qa, qb))
            peer = lambda scaled_mm=_f_scaled_mm()[0]: scaled_mm(*peer_args, output_dtype=torch.bfloat16)
        dispatched = lambda: turbo.ops.gemm_fp8(qa, qb, trans_b=True, out_dtype=torch.bfloat16, config=cfg)
        candidates = [("F.scaled_mm blockwise", True, peer_why, peer, plain),
                      ("turbo TRITON blockwise kernel (best tile)", False, None if triton_fn else triton_why,
                       None, plain),
                      # The op users call, on the same pre-quantised operands: pinned to each
                      # backend (its default config), and with the autotuner choosing per shape.
                      # Pinned, not left to the default: once the autotuned row has stored its
                      # pick, an unpinned call resolves to that pick too.
                      *[(f"turbo {name}", False, None, dispatched, pin(name)) for name in fp8_backends],
                      ("turbo autotune", False, None, dispatched, pin(None, auto=True))]
        live = []  # (row, fn, enter) of the rows that passed their gate, timed below in turns
        for label, is_peer, why_not, fn, enter in candidates:
            enter()
            row = H.Row(op="gemm_fp8_blockwise_gemm_only", shape=s.label, backend=label, model="+".join(s.models),
                        mb=s.mb, m=s.m, n=s.n, k=s.k, flops=2.0 * s.m * s.n * s.k, peer=is_peer)
            rows.append(row)
            if why_not:
                row.note = f"not run: {why_not}"
                continue
            if fn is None:
                row.check, tile, row.note = _best_tile(triton_fn, qa, qb, ref, s, timer)
                fn = None if tile is None else (lambda tile=tile: triton_fn(qa, qb, torch.bfloat16, tile))
            else:
                try:
                    out = fn()
                    row.check = H.gate([("out", out, ref)], min_snr_db=25.0)
                    del out
                    if fn is dispatched:
                        row.note = _explain_fwd("gemm_fp8", qa, qb, out_dtype=torch.bfloat16, config=cfg)()
                except NOT_SERVED as exc:
                    row.note = "not served: " + H.error_note(exc)
                except Exception as exc:
                    row.check = H.failed("raised " + H.error_note(exc))
            if row.check is not None and row.check.ok and fn is not None:
                live.append((row, fn, enter))
        if live:
            for (row, _, _), ms in zip(live, timer.time_interleaved([f for _, f, _ in live],
                                                                      setups=[e for _, _, e in live])):
                row.fwd_ms = ms
        plain()
        del x, w, ref, qa, qb, peer, peer_args, live
        H.free_memory(device)
        print(f"[{i + 1}/{len(shapes)}] {s.label}: " + ", ".join(
            f"{r.backend}={r.check.status if r.check else 'SKIP'}" + (f" {r.fwd_ms:.3f}ms" if r.fwd_ms else "")
            for r in rows[-len(candidates):]), flush=True)
    return [f"TRITON blockwise kernel: {triton_why or 'found'}"]


# -- memory line -----------------------------------------------------------------------------------
def memory_rows(args, device) -> tuple[list[H.Row], list[str]]:
    """Peak memory of Linear fwd+bwd, fp8 vs bf16 (Llama-3.1-8B gate_up, 4096 tokens)."""
    if device.type != "cuda":
        return [], ["memory line skipped: needs a CUDA device (torch.cuda.max_memory_allocated)"]
    m, k, n = (4096, 4096, 28672) if not args.quick else (4096, 4096, 14336)
    cfg = Float8QuantConfig(granularity=args.granularity, block_size=128 if args.granularity == "blockwise" else None)
    rows = []
    plain()
    for label, fp8 in (("Linear bf16", None), (f"Linear fp8 {args.granularity}", cfg)):
        layer = turbo.modules.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16, fp8_config=fp8)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        try:
            # x * 1.0: the Linear's input is an activation, as in a network, alive during the backward
            # only if autograd saves it (a leaf x would be alive anyway and hide what the op saves).
            layer(x * 1.0).sum().backward()  # warm-up (workspaces, autotuned keys)
            x.grad = None
            layer.weight.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            layer(x * 1.0).sum().backward()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            note, status = "", None
        except Exception as exc:
            peak, note, status = None, H.error_note(exc), H.failed(H.error_note(exc))
        row = H.Row(op="linear_peak_memory", shape=f"llama3.1-8b/gate_up m={m}", backend=label, m=m, n=n, k=k,
                    note=note or "peak allocated during fwd+bwd above the live tensors before it (input: an activation)",
                    check=status)
        row.extra["peak_mem_mib"] = round(peak, 1) if peak is not None else ""
        rows.append(row)
        del layer, x
        torch.cuda.empty_cache()
    return rows, [f"memory: {r.backend} peak {r.extra['peak_mem_mib']} MiB" for r in rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--granularity", choices=["tensorwise", "rowwise", "blockwise"], default="tensorwise")
    parser.add_argument("--models", default=None, help="comma-separated presets (default: the 8 dense models)")
    parser.add_argument("--mb", default=None, help="micro-batches, comma-separated (default 1,2,4)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per micro-batch (default: preset's)")
    parser.add_argument("--shapes", default=None, metavar="MxNxK[,...]",
                        help="shapes instead of the presets (x [M, K], weight [N, K]); 'unseen': 8 LLM layers "
                             "no preset has (the module docstring lists them); replaces --models/--mb/--seq-len")
    H.add_common_args(parser)
    args = parser.parse_args(argv)
    device = H.pick_device(args.device)
    H.set_tune_budget(args.tune_budget_ms, args.quick)
    cpu = device.type == "cpu"
    models = args.models.split(",") if args.models else (["tiny"] if cpu else QUICK_MODELS if args.quick
                                                          else DEFAULT_MODELS)
    mbs = [int(v) for v in args.mb.split(",")] if args.mb else ([1] if args.quick else [1, 2, 4])
    if args.shapes is not None:
        shapes = custom_shapes(args.shapes)
        ignored = [o for o, v in (("--models", args.models), ("--mb", args.mb), ("--seq-len", args.seq_len))
                   if v is not None]
        source = (f"shapes: --shapes {args.shapes}; {len(shapes)} unique shapes"
                  + (f" ({', '.join(ignored)} ignored)" if ignored else ""))
    else:
        shapes = collect_shapes(models, mbs, args.seq_len)
        source = f"models: {', '.join(models)}; micro-batches {mbs}; {len(shapes)} unique shapes"
    timer = H.make_timer(device, args.quick, args.target_ms)
    torch.manual_seed(0)
    t0 = time.time()
    rows: list[H.Row] = []
    notes: list[str] = []
    with H.interruptible() as stopped:
        if args.dtype == "fp8":  # first: a few seconds, and it survives a time-limited run
            mem_rows, mem_notes = memory_rows(args, device)
            rows += mem_rows
            notes += mem_notes
        if args.dtype == "fp8" and args.granularity == "blockwise":
            notes += run_blockwise(args, device, timer, shapes, rows)
        else:
            notes += run_dense(args, device, timer, shapes, rows)
    if stopped:
        notes = [f"INTERRUPTED ({stopped[0]}): partial results"] + notes
    plain()
    name = args.name or (args.dtype if args.dtype == "bf16" else f"fp8_{args.granularity}") + "_gemm" + (
        "_quick" if args.quick else "")
    notes = [source,
             f"autotune budget per key: PRIMUS_TURBO_TUNE_BUDGET_MS={os.environ.get('PRIMUS_TURBO_TUNE_BUDGET_MS')}",
             f"elapsed {time.time() - t0:.0f} s"] + notes
    H.write_reports(rows, name=name, device=device, out_dir=args.out_dir, notes=notes,
                    title=f"GEMM {args.dtype}" + ("" if args.dtype == "bf16" else f" {args.granularity}"),
                    plot_metric="fwd" if args.granularity == "blockwise" and args.dtype == "fp8" else "step",
                    lowest=("turbo autotune",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
