"""Where the host time of one eager blockwise fp8 grouped step goes, layer by layer (GPU probe).

Each layer is timed on the host alone, in batches of back-to-back calls issued behind one GPU
spin, so the launches queue and the host never waits on the GPU; reported in microseconds per
call, the median (and minimum) over ``--reps`` batches. From the top down:

* ``step``: the public op forward + backward (TRITON pinned, the default configs), and ``bf16_step``
  on torch._grouped_mm for scale;
* ``forward`` and ``backward`` of that step alone;
* the forward's pieces: ``quantize_runs_both`` (activation), ``quantize_tiles_both`` (weight),
  ``run_fp8`` (resolve + the adapter), ``adapter_run`` (the adapter with its config),
  ``ws_gemm`` (the Gluon kernel's wrapper), ``ws_launch_args`` (descriptors and arguments),
  ``ws_launch`` (the Triton launch of prepared arguments), ``ws_binder`` (Triton's argument binding
  alone), ``ws_launch_direct`` (the compiled kernel's launcher, arguments bound once), ``runs_launch`` (the activation
  quantiser's launch into prepared outputs), ``side_by_side_nothing`` (the two-stream fork and join
  around nothing), ``empty`` (one output allocation);
* floors: ``triton_noop`` (a one-argument Triton kernel) and ``torch_add`` (one torch op).

Usage (repo installed):
``python3 tools/probe_host_layers.py --shape qwen3_down [--layers step,forward] --out FILE``.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

import turbo_dispatch as turbo
from turbo_dispatch import BackendType, GlobalBackendManager
from turbo_dispatch.backends import quantizer
from turbo_dispatch.backends.triton import dual_quantize as DQ
from turbo_dispatch.backends.triton import dual_quantize_gluon as DQG
from turbo_dispatch.backends.triton import fp8_blockwise_gluon_ws as GWS
from turbo_dispatch.resolver import resolve

sys.path.insert(0, str(Path(__file__).parent))
from probe_grouped_step import OUT, emit, step_fn, step_operands  # noqa: E402  (sibling in tools/)

_grouped = importlib.import_module("turbo_dispatch.ops.grouped_gemm")
#: GPU spin before each timed batch, in cycles (about 100 ms on an H100): longer than any batch's host time.
SPIN_CYCLES = 200_000_000
#: Calls per timed batch.
BATCH = 10


@triton.jit
def _noop(x_ptr):
    tl.store(x_ptr, 1.0)


def host_us(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None,
            batch: int = BATCH) -> tuple[float, float]:
    """(median, min) over ``reps`` batches of the mean host time of ``batch`` back-to-back calls of
    ``fn``, in microseconds. Each batch is issued behind one GPU spin, so the host never waits on
    the GPU; calls are not separated by synchronisations (a call right after one runs several
    times slower on the host, which would time the wake-up rather than the call). ``setup``,
    where given, runs untimed once per call before each batch (the forwards a backward needs)."""
    prepare = setup or (lambda: None)
    for _ in range(3):
        prepare()
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(reps):
        for _ in range(batch):
            prepare()
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        per_call.append((time.perf_counter() - t0) * 1e6 / batch)
        torch.cuda.synchronize()
    return statistics.median(per_call), min(per_call)


def aten_profile(fn: Callable[[], object], calls: int = 5, rows: int = 40, stacks: bool = False) -> str:
    """The aten operators ``calls`` calls of ``fn`` dispatch (CPU side only), by count and by their
    own CPU time: how many tensor operations a step makes on the host. With ``stacks``, grouped by
    the innermost Python frames that made them, so each operator's count names its callers."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    with profile(activities=[ProfilerActivity.CPU], with_stack=stacks) as prof:
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    if stacks:
        averages = prof.key_averages(group_by_stack_n=6)
        return averages.table(sort_by="count", row_limit=rows, max_src_column_width=120)
    averages = prof.key_averages()
    return "\n".join(averages.table(sort_by=key, row_limit=rows) for key in ("count", "self_cpu_time_total"))


def _direct_launch(jit, grid: tuple, args: tuple, kwargs: dict) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the compiled kernel's own launcher called with arguments bound once, Triton's argument
    binder alone) for ``jit[grid](*args, **kwargs)``: what a launch costs without Triton's
    per-call binding, cache lookup and knob reads (Triton 3.6's ``JITFunction.run``)."""
    from triton.runtime.driver import driver

    kernel = jit[grid](*args, **kwargs)
    device = driver.active.get_current_device()
    binder = jit.device_caches[device][4]
    bound = tuple(binder(*args, **kwargs)[0].values())
    g = tuple(grid) + (1,) * (3 - len(grid))

    def run():
        stream = driver.active.get_current_stream(device)
        kernel.run(*g, stream, kernel.function, kernel.packed_metadata, None, None, None, *bound)

    return run, lambda: binder(*args, **kwargs)


def layers(shape: str) -> dict[str, Callable[[], object]]:
    """name -> a call of that layer at ``shape``'s blockwise step, operands prepared once."""
    _, n, k, lens, offs, a, w, grad, cfg = step_operands(shape)
    fp8 = torch.float8_e4m3fn
    GlobalBackendManager.reset()
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    step = step_fn(a, w, lens, offs, cfg, grad)

    def forward():
        a.grad = w.grad = None
        return turbo.ops.grouped_gemm_fp8(a, w, lens, offs, trans_b=True, config=cfg)

    outs = []

    def backward():
        outs.pop(0).backward(grad)

    def forward_then_queue():  # the backward's untimed forward
        outs.append(forward())

    x, wd = a.detach(), w.detach()
    qa, _ = quantizer.quantize_runs_both(x, fp8, 128)
    qb, _ = quantizer.quantize_tiles_both(wd, fp8, 128)
    problem = _grouped._forward_fp8_problem(a, w, lens, offs, True, None, cfg)
    p = _grouped._step_forward_problem(problem, qa, qb)
    decision = resolve(_grouped.GROUPED_GEMM_FP8, p)
    adapter, config = decision.entry.adapter, decision.config
    out = torch.empty((p.m, p.n), dtype=p.out_dtype, device="cuda")
    sa, sb = qa.scale, qb.scale
    ws_cfg = (128, 256, 128, 8, 4, 8)
    ws_args = (qa.data, qb.data, out, offs, sa, (sa.stride(0), sa.stride(1)), sb, sb.stride(), ws_cfg)
    b_rows = qb.data.as_strided((p.g * n, k), (qb.data.stride(1), 1))
    progs = 132
    launch = GWS.launch_args(qa.data, b_rows, out, offs, p.g, n, sa, (sa.stride(0), sa.stride(1)), sb, sb.stride(),
                             ws_cfg, 1, 128, progs)
    flag = torch.zeros(1, device="cuda")
    x3 = x.unsqueeze(0)
    runs_out = DQ.dual_quantize(x3, fp8, 128, False)
    dev = torch.device("cuda")
    ws_run, ws_binder = _direct_launch(GWS._fp8_blockwise_ws_kernel, (progs,), *launch)
    return {
        "config": str(config),
        "step": step,
        "forward": forward,
        "backward": (forward_then_queue, backward),
        "quantize_runs_both": lambda: quantizer.quantize_runs_both(x, fp8, 128),
        "quantize_tiles_both": lambda: quantizer.quantize_tiles_both(wd, fp8, 128),
        "run_fp8": lambda: _grouped._run_fp8(p, qa, qb, lens, offs),
        "adapter_run": lambda: adapter.run(p, qa, qb, lens, offs, config=config),
        "ws_gemm": lambda: GWS.fp8_blockwise_grouped_gemm(*ws_args, b_group=128),
        "ws_launch_args": lambda: GWS.launch_args(qa.data, b_rows, out, offs, p.g, n, sa,
                                                  (sa.stride(0), sa.stride(1)), sb, sb.stride(), ws_cfg, 1, 128,
                                                  progs),
        "ws_launch": lambda: GWS._fp8_blockwise_ws_kernel[(progs,)](*launch[0], **launch[1]),
        "ws_binder": ws_binder,
        "ws_launch_direct": ws_run,
        "runs_launch": lambda: DQG.launch(x3, runs_out[0], runs_out[2], runs_out[1], runs_out[3], DQ.FP8_MAX[fp8],
                                          DQ._TINY, False),
        "side_by_side_nothing": lambda: quantizer.side_by_side(lambda: None, lambda: None, dev),
        "empty": lambda: torch.empty((p.m, p.n), dtype=p.out_dtype, device="cuda"),
        "triton_noop": lambda: _noop[(1,)](flag),
        "torch_add": lambda: flag.add_(1.0),
        "bf16_step": ("bf16", step_fn(a, w, lens, offs, None, grad)),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3_down")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--aten", action="store_true", help="also list the aten operators of 5 fp8 steps and 5 bf16 steps")
    ap.add_argument("--aten-stacks", action="store_true",
                    help="also list the aten operators of 5 fp8 steps grouped by the Python frames that made them")
    ap.add_argument("--layers", default=None, help="comma-separated layer names to time (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.out:
        OUT.append(open(args.out, "w"))
    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    calls = layers(args.shape)  # leaves TRITON pinned for fp8
    emit(probe="host_config", shape=args.shape, forward_config=calls.pop("config"))
    wanted = None if args.layers is None else set(args.layers.split(","))
    unknown = (wanted or set()) - set(calls)
    if unknown:
        raise SystemExit(f"--layers: no layer named {sorted(unknown)}; layers are {sorted(calls)}")
    for name, call in calls.items():
        if wanted is not None and name not in wanted:
            continue
        if isinstance(call, tuple) and call[0] == "bf16":
            GlobalBackendManager.reset()
            GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH, precision="bf16")
            med, low = host_us(call[1], args.reps)
        elif isinstance(call, tuple):  # (untimed setup, timed call): one forward queued per backward
            med, low = host_us(call[1], args.reps, setup=call[0])
        else:
            med, low = host_us(call, args.reps)
        emit(probe="host_layer", shape=args.shape, layer=name, median_us=round(med, 1), min_us=round(low, 1))
    if args.aten:
        GlobalBackendManager.reset()
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
        print(aten_profile(calls["step"]), flush=True)
        GlobalBackendManager.reset()
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH, precision="bf16")
        print(aten_profile(calls["bf16_step"][1]), flush=True)
    if args.aten_stacks:
        GlobalBackendManager.reset()
        GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
        print(aten_profile(calls["step"], rows=80, stacks=True), flush=True)
    GlobalBackendManager.reset()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
