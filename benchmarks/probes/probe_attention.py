"""GPU probe for the attention backends: what SDPA's cuDNN kernel accepts on this machine, which
kernel the TORCH backend reaches per mask kind, and forward+backward timings of each path.

Run on a GPU: ``python3 benchmarks/probes/probe_attention.py [--only compiled]``. It changes
nothing; its timings back docs/performance.md's attention tables and CUDNN's ``supports()`` limits
(backends/cudnn/attention.py). Each timed row sets the shipped path beside the same call with one
of its fast paths forced off in the same process: the FlashAttention-2 and cuDNN-lse kernels, the
compiled op pair whose backward starts from the forward's out and lse, and cuDNN's GQA.
``--only compiled`` times the torch.compile'd calls alone.
"""
from __future__ import annotations

import argparse
import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import turbo_dispatch as turbo

dev, bf16 = "cuda", torch.bfloat16
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--only", choices=["compiled"], help="run one section alone")
ARGS = parser.parse_args()
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())


def t(b, h, s, d, hk=None, sk=None, dv=None):
    hk, sk, dv = hk or h, sk or s, dv or d
    q = torch.randn(b, h, s, d, device=dev, dtype=bf16, requires_grad=True)
    k = torch.randn(b, hk, sk, d, device=dev, dtype=bf16, requires_grad=True)
    v = torch.randn(b, hk, sk, dv, device=dev, dtype=bf16, requires_grad=True)
    return q, k, v


def event_ms(fn, reps):
    """Mean milliseconds of ``reps`` back-to-back calls of ``fn`` between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return event_ms(fn, reps)


def timed_step(call, q, k, v, g):
    def step():
        r = call(q, k, v)
        (r[0] if isinstance(r, tuple) else r).backward(g)

    return bench(step)


@contextlib.contextmanager
def compiled_pair_off():
    """The compiled path without the adapters' compiled_forward/compiled_backward pair: the backward
    op gets q/k/v alone and recomputes the forward (the ops look the pair up on every call, so no
    recompilation is needed)."""
    from turbo_dispatch.backends.torch.attention import TorchAttention

    shipped = TorchAttention.compiled_forward, TorchAttention.compiled_backward
    del TorchAttention.compiled_forward, TorchAttention.compiled_backward
    try:
        yield
    finally:
        TorchAttention.compiled_forward, TorchAttention.compiled_backward = shipped


@contextlib.contextmanager
def cudnn_gqa_off():
    """cuDNN refusing GQA/MQA (as on torch releases before 2.11), so GQA lse calls run FlashAttention-2."""
    from turbo_dispatch.backends.cudnn import attention as cudnn_attention

    shipped = cudnn_attention._gqa_verified
    cudnn_attention._gqa_verified = lambda: False
    try:
        yield
    finally:
        cudnn_attention._gqa_verified = shipped


def covered_or_nan(call, q, k, v, g):
    """``covered``, or NaNs with the error printed: one failing variant leaves the row's others."""
    try:
        return covered(call, q, k, v, g)
    except Exception as exc:  # noqa: BLE001
        print(f"  ({type(exc).__name__}: {str(exc).splitlines()[0][:150]})")
        return float("nan"), float("nan")


def covered(call, q, k, v, g):
    """(GPU ms with the host's issue time covered by a spin, host ms) of one fwd+bwd step."""
    from turbo_dispatch.host_cover import median_gpu_ms, typical_ms, untimed_host_ms

    def step():
        r = call(q, k, v)
        (r[0] if isinstance(r, tuple) else r).backward(g)

    gpu = median_gpu_ms(step, q.device, reps=15)
    return gpu, typical_ms([untimed_host_ms(step, q.device) for _ in range(5)])


def reduce_overhead(fn):
    """fn compiled with CUDA graphs, on a fresh dynamo: the rows compile one closure's code
    several ways, which the recompile limit (a hard failure under fullgraph) would stop."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, mode="reduce-overhead")


def compiled_section():
    from turbo_dispatch.backends.torch.attention import TorchAttention
    from turbo_dispatch.ops.attention import attention_problem, attention_varlen_problem

    print("\n== fwd+bwd, TORCH, bf16, H=32, D=128: GPU ms (host issue time covered by a spin) / host ms ==")
    print("  eager | compiled (fullgraph) | compiled, recomputing backward | compiled reduce-overhead "
          "(CUDA graphs) [| eager, cuDNN refusing GQA]")
    b, s_, h, d = 2, 4096, 32, 128
    dense = {
        "causal": (h, dict(causal=True)),
        "full": (h, {}),
        "causal + lse": (h, dict(causal=True, return_lse=True)),
        "gqa 32/8 causal": (8, dict(causal=True)),
        "gqa 32/8 causal + lse": (8, dict(causal=True, return_lse=True)),
        "window (1024,0)": (8, dict(window_size=(1024, 0))),
    }

    def row(label, call, q, k, v, g, problem, gqa):
        """One line: eager, compiled, compiled recomputing, reduce-overhead [, eager with cuDNN refusing GQA]."""
        torch._dynamo.reset()
        compiled = torch.compile(call, fullgraph=True)
        ms = [covered(call, q, k, v, g), covered(compiled, q, k, v, g)]
        with compiled_pair_off():
            ms.append(covered(compiled, q, k, v, g))
        ms.append(covered_or_nan(reduce_overhead(call), q, k, v, g))
        if gqa:
            with cudnn_gqa_off():
                ms.append(covered(call, q, k, v, g))
        path = TorchAttention()._saving_path(problem, q, k, v)
        print(f"  {label:33s} " + " | ".join(f"{gpu:.3f}/{host:.2f}" for gpu, host in ms) +
              f"  (compiled recomputing/now {ms[2][0] / ms[1][0]:.2f}x, path {path})")

    turbo.GlobalBackendManager.set_attn_backend("TORCH")
    for name, (hk, kw) in dense.items():
        q = torch.randn(b, s_, h, d, device=dev, dtype=bf16, requires_grad=True)
        k, v = (torch.randn(b, s_, hk, d, device=dev, dtype=bf16, requires_grad=True) for _ in range(2))
        g = torch.randn(b, s_, h, d, device=dev, dtype=bf16)

        def call(q, k, v, kw=kw):
            return turbo.ops.flash_attn_func(q, k, v, **kw)

        row(f"B={b} S={s_} {name}", call, q, k, v, g, attention_problem(q, k, v, **kw), hk != h)
    n, L = 8, 1024
    q = torch.randn(n * L, h, d, device=dev, dtype=bf16, requires_grad=True)
    cu = torch.arange(0, n * L + 1, L, device=dev, dtype=torch.int32)
    g = torch.randn(n * L, h, d, device=dev, dtype=bf16)
    for name, kw in (("causal", dict(causal=True)), ("causal + lse", dict(causal=True, return_lse=True))):
        def varlen(q, k, v, kw=kw):
            return turbo.ops.flash_attn_varlen_func(q, k, v, cu, cu, L, L, **kw)

        row(f"varlen {n}x{L} {name}", varlen, q, q, q, g, attention_varlen_problem(q, q, q, cu, cu, L, L, **kw),
            False)
    turbo.GlobalBackendManager.set_attn_backend(None)


if ARGS.only == "compiled":
    compiled_section()
    raise SystemExit(0)

print("\n== SDPA forced onto cuDNN (fwd+bwd) ==")
cases = {
    "base 256 d128": (t(2, 8, 256, 128), {}),
    "causal 256 d128": (t(2, 8, 256, 128), dict(is_causal=True)),
    "odd seqlen 129": (t(2, 8, 129, 128), {}),
    "sq!=sk 96/320": (t(1, 4, 96, 128, sk=320), {}),
    "gqa 8/2": (t(2, 8, 256, 128, hk=2), dict(enable_gqa=True)),
    "dv!=d 192/128": (t(1, 4, 128, 192, dv=128), {}),
    "d256": (t(1, 4, 128, 256), {}),
    "d40": (t(1, 4, 128, 40), {}),
    "dropout": (t(1, 4, 128, 64), dict(dropout_p=0.1)),
    "bool mask": (t(1, 4, 128, 64), dict(attn_mask=torch.ones(128, 128, device=dev, dtype=torch.bool).tril())),
}
for name, ((q, k, v), kw) in cases.items():
    try:
        with warnings.catch_warnings(record=True) as w, sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            warnings.simplefilter("always")
            out = F.scaled_dot_product_attention(q, k, v, **kw)
            out.sum().backward()
        torch.cuda.synchronize()
        print(f"  {name:18s} OK")
    except Exception as exc:  # noqa: BLE001
        print(f"  {name:18s} REFUSED: {str(exc).splitlines()[0][:110]}")
        for x in w[:2]:
            print(f"  {'':18s}   warning: {str(x.message).splitlines()[0][:110]}")


from turbo_dispatch.backends.torch import cudnn_lse, flash_native  # noqa: E402
from turbo_dispatch.backends.torch.attention import TorchAttention  # noqa: E402
from turbo_dispatch.ops.attention import attention_problem, attention_varlen_problem  # noqa: E402


@contextlib.contextmanager
def flash_path_off():
    """The TORCH adapter with its FlashAttention-2 and cuDNN-lse paths forced off: SDPA with a
    separate lse pass or an explicit mask, and varlen padded."""
    shipped = flash_native.reason, cudnn_lse.reason
    flash_native.reason = lambda p, kernels: "forced off by the probe"
    cudnn_lse.reason = lambda p: "forced off by the probe"
    try:
        yield
    finally:
        flash_native.reason, cudnn_lse.reason = shipped


print("\n== flash_attn_func fwd+bwd, bf16, B=2 S=4096 Hq=32 D=128, ms (TFLOP/s) ==")
print("  TORCH: shipped; TORCH-sdpa-only: its FlashAttention-2 and cuDNN-lse paths forced off; CUDNN: pinned")
B, S, H, D = 2, 4096, 32, 128
shapes = {
    "causal": dict(hk=H, kw=dict(causal=True)),
    "full": dict(hk=H, kw={}),
    "gqa 32/8 causal": dict(hk=8, kw=dict(causal=True)),
    "window (1024,0)": dict(hk=H, kw=dict(window_size=(1024, 0))),
    "window (512,512)": dict(hk=H, kw=dict(window_size=(512, 512))),
    "causal + lse": dict(hk=H, kw=dict(causal=True, return_lse=True)),
    "gqa 32/8 causal + lse": dict(hk=8, kw=dict(causal=True, return_lse=True)),
    "window (1024,0) + lse": dict(hk=H, kw=dict(window_size=(1024, 0), return_lse=True)),
}
for name, cfg in shapes.items():
    q = torch.randn(B, S, H, D, device=dev, dtype=bf16, requires_grad=True)
    k = torch.randn(B, S, cfg["hk"], D, device=dev, dtype=bf16, requires_grad=True)
    v = torch.randn(B, S, cfg["hk"], D, device=dev, dtype=bf16, requires_grad=True)
    g = torch.randn(B, S, H, D, device=dev, dtype=bf16)
    kw = cfg["kw"]
    wl, wr = kw.get("window_size", (-1, 0 if kw.get("causal") else -1))
    pairs = sum(min(S - 1, i + wr if wr >= 0 else S) - max(0, i - wl if wl >= 0 else 0) + 1 for i in range(S))
    flops = 3.5 * 4 * B * H * pairs * D  # fwd + bwd over the (query, key) pairs the mask allows
    row = []
    variants = (("TORCH", "TORCH", False), ("TORCH-sdpa-only", "TORCH", True), ("CUDNN", "CUDNN", False))
    for label, backend, off in variants:
        turbo.GlobalBackendManager.set_attn_backend(backend)
        try:
            with flash_path_off() if off else contextlib.nullcontext():
                ms = timed_step(lambda q, k, v: turbo.ops.flash_attn_func(q, k, v, **kw), q, k, v, g)
            row.append(f"{label} {ms:7.3f} ({flops / ms / 1e9:4.0f})")
        except Exception:  # noqa: BLE001  (CUDNN refuses lse and windows)
            row.append(f"{label} refused")
    turbo.GlobalBackendManager.set_attn_backend(None)
    print(f"  {name:22s} " + " | ".join(row))
    print(f"  {'':22s} TORCH: {TorchAttention().describe(attention_problem(q, k, v, **kw))}")
turbo.GlobalBackendManager.set_attn_backend(None)

print("\n== varlen (TORCH) vs dense, 8 x 1024 tokens, H=32, D=128, fwd+bwd ms ==")
n, L = 8, 1024
q = torch.randn(n * L, H, D, device=dev, dtype=bf16, requires_grad=True)
cu = torch.arange(0, n * L + 1, L, device=dev, dtype=torch.int32)
g = torch.randn(n * L, H, D, device=dev, dtype=bf16)
qd = q.detach().view(n, L, H, D).requires_grad_()
for label, kw in (("causal", dict(causal=True)), ("window (256,0)", dict(window_size=(256, 0))),
                  ("causal + lse", dict(causal=True, return_lse=True))):
    def varlen(q, k, v, kw=kw):
        return turbo.ops.flash_attn_varlen_func(q, k, v, cu, cu, L, L, **kw)

    ms_var = timed_step(varlen, q, q, q, g)
    with flash_path_off():
        ms_pad = timed_step(varlen, q, q, q, g)
    ms_compiled = timed_step(torch.compile(varlen, fullgraph=True), q, q, q, g)
    ms_dense = timed_step(lambda q, k, v, kw=kw: turbo.ops.flash_attn_func(q, k, v, **kw), qd, qd, qd,
                          g.view(n, L, H, D))
    print(f"  {label:16s} varlen {ms_var:.3f} ms, compiled {ms_compiled:.3f}, padded path {ms_pad:.3f}, "
          f"dense {ms_dense:.3f}")
    print(f"  {'':16s} TORCH: {TorchAttention().describe(attention_varlen_problem(q, q, q, cu, cu, L, L, **kw))}")
try:
    from torch.nn.attention import varlen as tv
    import inspect

    params = inspect.signature(tv.varlen_attn).parameters
    print("  torch.nn.attention.varlen.varlen_attn", inspect.signature(tv.varlen_attn))
    # Older releases take is_causal; newer ones spell causal as a (-1, 0) window.
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    ms_tv = bench(lambda: tv.varlen_attn(q, q, q, cu, cu, L, L, **causal).backward(g))
    print(f"  torch varlen_attn causal ({next(iter(causal))}) {ms_tv:.3f} ms")
except Exception as exc:  # noqa: BLE001
    print("  torch varlen_attn:", type(exc).__name__, str(exc)[:120])

print("\n== the kernels that return an lse, by shape: causal, H=32, D=128, bf16, fwd+bwd ms ==")
print("  SDPA auto / flash / cuDNN: F.scaled_dot_product_attention (no lse) on its own choice and forced;")
print("  cuDNN+lse: cudnn_lse.attend; FA2+lse: flash_native.attend")
for b, s_ in ((2, 4096), (8, 1024), (16, 512), (1, 8192), (4, 2048)):
    q, k, v = (torch.randn(b, s_, H, D, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))
    g = torch.randn(b, s_, H, D, device=dev, dtype=bf16)
    p = attention_problem(q, k, v, causal=True, return_lse=True)

    def sdpa(q, k, v, backends=None):
        call = lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # noqa: E731
                                                      is_causal=True).transpose(1, 2)
        if backends is None:
            return call()
        with sdpa_kernel(backends):
            return call()

    row = {
        "SDPA auto": timed_step(sdpa, q, k, v, g),
        "flash": timed_step(lambda q, k, v: sdpa(q, k, v, [SDPBackend.FLASH_ATTENTION]), q, k, v, g),
        "cuDNN": timed_step(lambda q, k, v: sdpa(q, k, v, [SDPBackend.CUDNN_ATTENTION]), q, k, v, g),
        "cuDNN+lse": timed_step(lambda q, k, v: cudnn_lse.attend(p, q, k, v), q, k, v, g),
        "FA2+lse": timed_step(lambda q, k, v: flash_native.attend(p, q, k, v, None, None), q, k, v, g),
    }
    fwd = {
        "cuDNN+lse fwd": bench(lambda: cudnn_lse.attend(p, q.detach(), k.detach(), v.detach())),
        "FA2+lse fwd": bench(lambda: flash_native.attend(p, q.detach(), k.detach(), v.detach(), None, None)),
    }
    print(f"  B={b:2d} S={s_:5d} " + " | ".join(f"{name} {ms:.3f}" for name, ms in {**row, **fwd}.items()))

compiled_section()
