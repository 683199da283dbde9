"""Fused fp8 producers (RMSNorm + quantise, SwiGLU + quantise) and the rotary embedding's split
against the copy bandwidth of the same GPU and against the unfused torch ops, in one run.

Cases: the activations a dense layer's fp8 GEMMs read, ``--tokens`` rows (default 8192):

* ``rms_norm``: RMSNorm over the hidden dim (``x [T, hidden]`` and its weight), quantised along it;
* ``swiglu``: ``silu(gate) * up`` of one ``[T, 2F]`` gate/up projection (the two halves as views),
  quantised along F;

for Llama-3.1-8B (hidden 4096, F 14336), Llama-3.1-70B at TP8 (hidden 8192, F 3584) and
Qwen2.5-7B (hidden 3584, F 18944); recipes e4m3 rowwise, blockwise (1 x 128) and tensorwise.

Rows per case, timed in turns (CUDA events, L2 flushed before each call; benchmarks/harness.py):

* ``turbo fused``: ``backends.triton.fused_producers`` (the kernels the fp8 modules run) as
  inference runs them: the fp8 data and scales only;
* ``turbo fused +out``: the same writing the high-precision output too, as a training step runs
  them (the wgrad quantises that output); its bytes count that write;
* ``turbo unfused``: the op in plain torch, then the library's own quantiser of its output (the
  Triton one on a GPU; the peer);
* ``torch copy``: ``dst.copy_(src)`` of a bf16 tensor the size of the case's input, the GPU's copy
  rate.

``gb_s`` is the bytes the op must move (its inputs read once, the fp8 data and the float32 scales
written once; the weight of RMSNorm counted too) over the time; ``of_copy`` is that rate over
the copy's rate on the same GPU (the issue's target: >= 0.8). Tensorwise needs the amax of the
whole output before any cast, so its kernels read the inputs twice (or, with the output, re-read
that): its bytes are counted at the same minimum, so its rate is what a caller gets.

Check: the fused result dequantised against the op computed in float32, SNR >= 25 dB (the
unfused row the same); a failing row is not timed and the script exits 1.

``rope`` cases (``--ops``): ``ops.split_qkv_rotary_emb`` of one layer's q/k/v projection output
``[T, (Hq + 2 Hkv) 128]`` (Llama-3.1-8B 32/8 heads, Llama-3.1-70B TP8 8/1, Qwen2.5-7B 28/4), forward
(split, rotate q and k, copy v) and backward (the three gradients into one packed gradient),
against the same step in torch ops (examples/train_llama.py's ``torch_split_rotary``, the bench's
torch peer) and the copy rate; bytes: the projection read and q, k, v written (backward alike);
checked against float64 at SNR >= 40 dB.

Usage:
    python benchmarks/bench_fused_producers.py [--tokens 8192] [--models ...] [--recipes ...] [--ops ...] [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import harness as H  # noqa: E402
from train_llama import torch_split_rotary  # noqa: E402
from turbo_dispatch.ops import split_qkv_rotary_emb  # noqa: E402
from turbo_dispatch.low_precision import ScalingGranularity, dequantize  # noqa: E402
from turbo_dispatch.low_precision.fast_quantize import quantize_rows  # noqa: E402

#: (hidden, FFN width per rank) of the models the cases come from.
MODELS = {"llama3.1-8b": (4096, 14336), "llama3.1-70b-tp8": (8192, 3584), "qwen2.5-7b": (3584, 18944)}
#: (q heads, kv heads) per rank of the same models, head dim 128.
HEADS = {"llama3.1-8b": (32, 8), "llama3.1-70b-tp8": (8, 1), "qwen2.5-7b": (28, 4)}
OPS = ("rms_norm", "swiglu", "rope")
ROPE_MIN_SNR_DB = 40.0
RECIPES = ("rowwise", "blockwise", "tensorwise")
E4M3 = torch.float8_e4m3fn
BLOCK = 128
EPS = 1e-5
MIN_SNR_DB = 25.0


def _producers():
    """The fused kernels' module, or (None, why not) where they cannot run here."""
    from turbo_dispatch.backends.triton import fused_producers as FP

    why = FP.available()
    return (FP, None) if why is None else (None, why)


def rms_norm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()


def swiglu_f32(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate.float()) * up.float()


def minimum_bytes(op: str, t: int, n: int, recipe: str) -> int:
    """Bytes the op must move: its bf16 inputs read once, the fp8 data and the scales written."""
    scales = {"rowwise": t, "blockwise": t * -(-n // BLOCK), "tensorwise": 1}[recipe] * 4
    reads = t * n * 2 * (2 if op == "swiglu" else 1) + (n * 2 if op == "rms_norm" else 0)
    return reads + t * n + scales


def case_calls(op: str, t: int, n: int, recipe: str, device, FP):
    """(inputs' float32 reference, fused call or None, fused call writing the output too or None,
    unfused call, copy call, input bytes)."""
    gran = ScalingGranularity(recipe)
    bs = BLOCK if recipe == "blockwise" else None
    if op == "rms_norm":
        x = torch.randn(t, n, device=device, dtype=torch.bfloat16)
        w = (1.0 + 0.1 * torch.randn(n, device=device)).to(torch.bfloat16)
        ref = rms_norm_f32(x, w)
        fused = None if FP is None else (lambda: FP.rms_norm_quantize(x, w, EPS, E4M3, gran, bs)[0])
        fused_out = None if FP is None else (lambda: FP.rms_norm_quantize(x, w, EPS, E4M3, gran, bs, True)[0])
        unfused = lambda: quantize_rows(F.rms_norm(x, (n,), w, EPS), E4M3, gran, bs)
        src = x
    else:
        gate_up = torch.randn(t, 2 * n, device=device, dtype=torch.bfloat16)
        gate, up = gate_up[:, :n], gate_up[:, n:]
        ref = swiglu_f32(gate, up)
        fused = None if FP is None else (lambda: FP.swiglu_quantize(gate, up, E4M3, gran, bs)[0])
        fused_out = None if FP is None else (lambda: FP.swiglu_quantize(gate, up, E4M3, gran, bs, True)[0])
        unfused = lambda: quantize_rows(F.silu(gate) * up, E4M3, gran, bs)
        src = gate_up
    dst = torch.empty_like(src)
    return ref, fused, fused_out, unfused, (lambda: dst.copy_(src)), src.numel() * src.element_size()


def check(call, ref: torch.Tensor) -> H.Check:
    try:
        q = call()
        out = dequantize(q).float()
    except Exception as exc:  # a failing kernel is a FAIL row, not a crash of the whole run
        return H.failed(H.error_note(exc))
    return H.gate([("out", out, ref)], min_snr_db=MIN_SNR_DB)


def time_rows(made: list, timer) -> None:
    """Times the ``(row, call)`` pairs of one case in turns: each row's ms, ``gb_s`` (its
    ``bytes_mb`` per ms) and ``of_copy`` (that rate over the case's ``torch copy`` row's)."""
    times = timer.time_interleaved([call for _, call in made]) if made else []
    for (row, _), ms in zip(made, times):
        row.fwd_ms = ms
        # four significant digits, not a fixed decimal: a CPU smoke run's rates are far below 0.1 GB/s
        row.extra["gb_s"] = float(f"{row.extra['bytes_mb'] / ms:.4g}")  # MB / ms = GB/s
    copy_row = next((r for r, _ in made if r.backend == "torch copy"), None)
    for row, _ in made:
        if copy_row is not None and row is not copy_row:
            rate = row.extra["bytes_mb"] / row.fwd_ms / (copy_row.extra["bytes_mb"] / copy_row.fwd_ms)
            row.extra["of_copy"] = float(f"{rate:.3g}")


def summary(rows: list[H.Row]) -> str:
    """``backend=status [GB/s]`` of each row, for the progress line."""
    return ", ".join(f"{r.backend}={r.check.status if r.check else 'SKIP'}"
                     + (f" {r.extra['gb_s']} GB/s" if "gb_s" in r.extra else "") for r in rows)


def rope_rows(model: str, t: int, device, timer, rows: list[H.Row]) -> bool:
    """The ``rope`` case of ``model`` (module docstring): forward and backward rows in turns."""
    hq, hkv = HEADS[model]
    dim = 128
    width = (hq + 2 * hkv) * dim
    qkv = torch.randn(1, t, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    angle = torch.outer(torch.arange(t, device=device, dtype=torch.float64),
                        500000.0 ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float64) / dim))
    cos, sin = angle.cos().float(), angle.sin().float()
    grads = [torch.randn(1, t, h, dim, device=device, dtype=torch.bfloat16) for h in (hq, hkv, hkv)]
    ref = [o.double() for o in torch_split_rotary(qkv.detach().double(), hq, hkv, cos.double(), sin.double())]
    qkv64 = qkv.detach().double().requires_grad_(True)
    ref_g = torch.autograd.grad(torch_split_rotary(qkv64, hq, hkv, cos.double(), sin.double()), qkv64,
                                [g.double() for g in grads])[0]
    moved = 2 * 2 * t * width
    dst = torch.empty_like(qkv)
    ok = True
    for direction in ("fwd", "bwd"):
        made = []
        for label, fn, peer in (("turbo split_qkv_rotary_emb", split_qkv_rotary_emb, False),
                                ("torch ops", torch_split_rotary, True), ("torch copy", None, False)):
            row = H.Row(op=f"rope_{direction}", shape=f"{model}/rope", backend=label, model=model, m=t, n=width,
                        peer=peer, extra={"recipe": "bf16", "bytes_mb": round(moved / 1e6, 2)})
            if fn is None:
                row.check, call = H.Check(), (lambda: dst.copy_(qkv.detach()))
            else:
                try:
                    outs = fn(qkv, hq, hkv, cos, sin)
                    grad = torch.autograd.grad(outs, qkv, grads, retain_graph=True)[0]
                    pairs = [("q", outs[0], ref[0]), ("k", outs[1], ref[1]), ("v", outs[2], ref[2])]
                    row.check = H.gate(pairs if direction == "fwd" else [("dqkv", grad, ref_g)],
                                       min_snr_db=ROPE_MIN_SNR_DB)
                except Exception as exc:  # a failing kernel is a FAIL row, not a crash of the whole run
                    row.check, outs = H.failed(H.error_note(exc)), None
                if direction == "fwd":
                    call = (lambda fn=fn: fn(qkv, hq, hkv, cos, sin))
                else:
                    call = (lambda outs=outs: torch.autograd.grad(outs, qkv, grads, retain_graph=True))
                ok = ok and row.check.ok
            rows.append(row)
            if row.passed:
                made.append((row, call))
        time_rows(made, timer)
        print(f"{model}/rope {direction} T={t}: " + summary(rows[-3:]), flush=True)
    return ok


def run(args, device, timer, rows: list[H.Row]) -> bool:
    FP, why_not = _producers()
    ok = True
    for model in args.models if "rope" in args.ops else ():
        ok = rope_rows(model, args.tokens, device, timer, rows) and ok
        H.free_memory(device)
    cases = [(op, model, args.tokens, MODELS[model][0 if op == "rms_norm" else 1], recipe)
             for model in args.models for op in ("rms_norm", "swiglu") if op in args.ops for recipe in args.recipes]
    for i, (op, model, t, n, recipe) in enumerate(cases):
        t0 = time.time()
        ref, fused, fused_out, unfused, copy, copy_in = case_calls(op, t, n, recipe, device, FP)
        shape = f"{model}/{op}/{recipe}"
        need = minimum_bytes(op, t, n, recipe)
        made = []
        runs = [("turbo fused", fused, False, need), ("turbo fused +out", fused_out, False, need + 2 * t * n),
                ("turbo unfused", unfused, True, need), ("torch copy", copy, False, 2 * copy_in)]
        if fused_out is None:  # where the kernels cannot run, the one fused SKIP row says why
            runs.pop(1)
        for label, call, peer, moved in runs:
            row = H.Row(op=f"{op}_quantize", shape=shape, backend=label, model=model, m=t, n=n, peer=peer,
                        extra={"recipe": recipe, "bytes_mb": round(moved / 1e6, 2)})
            if call is None:
                row.note = f"fused kernel not run: {why_not}"  # no check: a SKIP row
            elif label == "torch copy":
                row.check = H.Check()
            else:
                row.check = check(call, ref)
                ok = ok and row.check.ok
            rows.append(row)
            if row.passed:
                made.append((row, call))
        time_rows(made, timer)
        print(f"[{i + 1}/{len(cases)}] {shape} T={t} N={n}: " + summary(rows[-len(runs):])
              + f" ({time.time() - t0:.1f}s)", flush=True)
        del ref, fused, fused_out, unfused, copy
        H.free_memory(device)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None, help="rows per case (default 8192; 64 with --quick on CPU)")
    parser.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--recipes", default=None, help=f"comma-separated subset of {','.join(RECIPES)}")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    H.add_common_args(parser)
    args = parser.parse_args(argv)
    device = H.pick_device(args.device)
    cpu = device.type == "cpu"
    args.models = args.models.split(",") if args.models else (["llama3.1-8b"] if args.quick else list(MODELS))
    args.recipes = args.recipes.split(",") if args.recipes else list(RECIPES)
    args.ops = args.ops.split(",")
    for name, given, known in (("--models", args.models, MODELS), ("--recipes", args.recipes, RECIPES),
                               ("--ops", args.ops, OPS)):
        for v in given:
            if v not in known:
                raise SystemExit(f"{name}: unknown {v!r}; valid: {', '.join(known)}")
    if args.tokens is None:
        args.tokens = 64 if cpu else 8192
    if args.tokens <= 0:
        raise SystemExit(f"--tokens must be positive; got {args.tokens}")
    timer = H.make_timer(device, args.quick, args.target_ms)
    torch.manual_seed(0)
    t0 = time.time()
    rows: list[H.Row] = []
    with H.interruptible() as stopped:
        ok = run(args, device, timer, rows)
    notes = [f"models: {', '.join(args.models)}; ops {', '.join(args.ops)}; recipes {', '.join(args.recipes)}; "
             f"{args.tokens} tokens",
             "gb_s: the op's minimum bytes (inputs read, fp8 data and scales written; +out: and the bf16 output) "
             "per second; of_copy: over the copy row's rate; ratio: the unfused pair's time over this row's",
             f"elapsed {time.time() - t0:.0f} s"]
    if stopped:
        notes = [f"INTERRUPTED ({stopped[0]}): partial results"] + notes
    H.write_reports(rows, name=args.name or "fused_producers" + ("_quick" if args.quick else ""), device=device,
                    out_dir=args.out_dir, notes=notes, title="Fused fp8 producers and RoPE", plot_metric="gb_s",
                    breakdown=("recipe",))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
