"""GPU probe of the blockwise fp8 grouped training step (forward + dgrad + wgrad through the public
op, quantisation included) with and without the step's quantisation reuse, against the bf16 op on
torch._grouped_mm, all in one process. Usage (repo installed):
``python3 tools/probe_grouped_step.py [--shapes dsv3_up,dsv3_down] [--graphs] [--out FILE]``; ``--graphs``
also times each step replayed from one CUDA graph (the GPU time without the host's dispatch).

Checks first, each printed as PASS/FAIL:

* the one-read dual quantiser against ``grouped_quantize.quantize_cells`` (the adapters' own
  quantiser) at odd sizes, both fp8 formats, all-zero runs and a NaN: bit-identical data and scales;
* the step with reuse against the step without it (TRITON pinned): bit-identical output and
  gradients (the kernels read the same values in the same layouts).

Then times, per shape: each variant's fwd+bwd step (CUDA events, median), and the quantisers
alone (dual vs the two separate quantisations it replaces), as GB/s of bf16 read + fp8 written.

``--kernels dsv3_up,qwen3_down`` does only this: the GPU time of each kernel one fp8 step runs
(and one bf16 step), from torch.profiler.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import turbo_dispatch as turbo
from turbo_dispatch import BackendType, GlobalBackendManager, host_cover
from turbo_dispatch.backends.triton.dual_quantize import dual_quantize
from turbo_dispatch.backends.triton.grouped_quantize import quantize_cells
from turbo_dispatch.low_precision import Float8QuantConfig

from probe_triton_grouped import bench_routing  # sibling in tools/
from probe_record import capture_graph  # sibling in tools/

_grouped = importlib.import_module("turbo_dispatch.ops.grouped_gemm")
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
#: name -> (G local experts, tokens, N, K): DeepSeek-V3 EP8 at 4096 tokens per expert (up_gate:
#: 2 x 2048 outputs from hidden 7168; down: 7168 from 2048), Qwen3-30B-A3B EP8 (16 local experts,
#: hidden 2048, FFN 768), Mixtral EP8 (1 local expert of 8, hidden 4096, FFN 14336).
SHAPES = {"dsv3_up": (8, 32768, 4096, 7168), "dsv3_down": (8, 32768, 7168, 2048),
          "qwen3_up": (16, 65536, 1536, 2048), "qwen3_down": (16, 65536, 2048, 768),
          "mixtral_up": (1, 4096, 28672, 4096),
          # The EP8 bench's sizes (4096 tokens per local expert): DeepSeek-V3's 32 local experts,
          # GPT-OSS-20B's 4 (hidden 2880, FFN 2880).
          "dsv3_up_ep8": (32, 131072, 4096, 7168), "dsv3_down_ep8": (32, 131072, 7168, 2048),
          "gptoss_down_ep8": (4, 16384, 2880, 2880),
          # 512 tokens per local expert at EP8: the weight outweighs the activation.
          "dsv3_up_ep8_512": (32, 16384, 4096, 7168), "dsv3_down_ep8_512": (32, 16384, 7168, 2048),
          "qwen3_up_ep8_512": (16, 8192, 1536, 2048), "kimi_up_ep8_512": (48, 24576, 4096, 7168)}
#: --routing: the bench's routing for step_operands (balanced, skewed or empty).
ROUTING = ["balanced"]
OUT: list = []


def emit(**kw):
    if OUT:
        OUT[0].write(json.dumps(kw, default=str) + "\n")
        OUT[0].flush()
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)


def time_ms(fn, reps: int = 20) -> float:
    """Median GPU time of ``fn``, its host issue time covered by a GPU spin
    (``turbo_dispatch.host_cover``): without it a short kernel times its launch path (the dual
    quantiser's small operands did, before round 39)."""
    return host_cover.median_gpu_ms(fn, torch.device("cuda"), reps)


#: Launches (dual_quantize.LAUNCH values, (rows per chunk, warps)) of the Triton kernel the sweep
#: times and the check covers.
RUNS_LAUNCHES = [(64, 4), (32, 4)]
TILES_LAUNCHES = [(64, 4), (32, 4)]
#: dual_quantize_gluon.LAUNCH values (rows per read chunk, rows per transposed chunk, warps,
#: maxnreg or 0) of its runs kernel, and TILES_LAUNCH values (rows per thread, warps, maxnreg or 0)
#: of its tiles kernel.
GLUON_LAUNCHES = [(32, 32, 4, 96), (32, 32, 4, 0)]
GLUON_TILES_LAUNCHES = [(16, 4, 0), (16, 4, 168), (8, 8, 0)]
#: dual_quantize_gluon.TMA_RUNS values (ring stages, programs per SM, maxnreg or 0) of its persistent
#: TMA runs kernel.
GLUON_TMA_RUNS = [(1, 4, 96), (1, 5, 96), (1, 6, 80), (2, 3, 96)]


def _gluon_setups(tile: bool = False) -> list[tuple[str, dict]]:
    """(name, dual_quantize_gluon attributes) of every Gluon variant the sweep times and the
    check covers, for token runs or (``tile``) 2-D tiles. (Earlier rounds also listed kernels and
    options since dropped; dual_quantize_gluon's docstring names them and what they measured.)"""
    if tile:
        return [(f"tiles {la}", dict(SERVES_TILES=True, TILES_LAUNCH=la)) for la in GLUON_TILES_LAUNCHES]
    return ([(f"runs {la}", dict(LAUNCH=la, TMA_RUNS=None)) for la in GLUON_LAUNCHES]
            + [(f"runs tma {tma}", dict(TMA_RUNS=tma)) for tma in GLUON_TMA_RUNS])


def _apply_gluon(setup: dict) -> dict:
    """Sets ``setup`` on dual_quantize_gluon and returns what it replaced, for
    ``_apply_gluon(saved)`` to restore."""
    import turbo_dispatch.backends.triton.dual_quantize_gluon as DG

    saved = {}
    for key, value in setup.items():
        saved[key] = getattr(DG, key)
        setattr(DG, key, value)
    return saved


def check_gluon_variants() -> bool:
    """Every Gluon variant of _gluon_setups against the Triton kernel's bits (GLUON off), e4m3
    (the default variant also in e5m2): ragged rows and last column block, strided rows, groups,
    zero/NaN/inf/subnormal-sized/near-overflow cells, and a tall operand."""
    import turbo_dispatch.backends.triton.dual_quantize as DQ

    big = torch.randn(3, 1000, 352, device="cuda", dtype=torch.bfloat16) * 7
    x = big[:, :, 16:336]  # 320 columns: last block 64 wide; rows strided by 352
    x[0, :, 128:256] = 0
    x[1, 517, 3] = float("nan")
    x[2, 0:128, 0:128] *= 1e-38
    x[2, 200:300, :] = -0.0
    x[1, 300:400, 200:300] *= -1e-30  # small, not subnormal: scales around 1e-32, rescaled
    x[2, 900, 290] = float("inf")
    x[0, 700:800, 40:60] *= 3e37
    tall = torch.randn(1, 20000 + 77, 2048, device="cuda", dtype=torch.bfloat16) * 3
    ok = True
    cases = [(name, src, tile) for name, src in (("ragged", x), ("tall", tall)) for tile in (False, True)]
    for name, src, tile in cases:
        for dt in (E4, E5):
            DQ.GLUON = False
            ref = DQ.dual_quantize(src, dt, 128, tile)
            DQ.GLUON = True
            setups = _gluon_setups(tile)
            for label, setup in setups if dt == E4 else [("default", {})] + setups[-1:]:
                saved = _apply_gluon(setup)
                try:
                    got = DQ.dual_quantize(src, dt, 128, tile)
                    same = all(torch.equal(torch.nan_to_num(a.view(torch.uint8).float() if a.element_size() == 1
                                                            else a, nan=-1.0),
                                           torch.nan_to_num(b.view(torch.uint8).float() if b.element_size() == 1
                                                            else b, nan=-1.0)) for a, b in zip(got, ref))
                    err = ""
                except Exception as exc:  # a launch that does not compile is reported, not fatal
                    same, err = False, f"{type(exc).__name__}: {str(exc)[:300]}"
                finally:
                    _apply_gluon(saved)
                emit(check="dual_gluon", operand=name, tiles=tile, dtype=str(dt), variant=label,
                     result="PASS" if same else "FAIL",
                     error=err)
                ok = ok and same
    return ok


def check_dual() -> bool:
    """Bit-exactness of every launch in RUNS_LAUNCHES / TILES_LAUNCHES and both FAST_DIV modes."""
    import turbo_dispatch.backends.triton.dual_quantize as DQ

    ok, default = True, (DQ.FAST_DIV, dict(DQ.LAUNCH))
    import turbo_dispatch.backends.triton.dual_quantize_gluon as DG

    gluon_default = DG.LAUNCH
    # Triton kernel (GLUON off): every launch in e4m3 with FAST_DIV (each is a compile); e5m2 and
    # div_rn at the default launch. Gluon kernel (block 128; block 64 still takes Triton): every
    # launch in e4m3, the default in e5m2.
    combos = [(E4, True, r, t, False, gluon_default) for r, t in zip(RUNS_LAUNCHES, TILES_LAUNCHES)]
    combos += [(dt, fast, DQ.LAUNCH[False], DQ.LAUNCH[True], False, gluon_default)
               for dt, fast in ((E5, True), (E4, False))]
    combos += [(E4, True, DQ.LAUNCH[False], DQ.LAUNCH[True], True, gl) for gl in GLUON_LAUNCHES]
    combos += [(E5, True, DQ.LAUNCH[False], DQ.LAUNCH[True], True, gluon_default)]
    for dt, fast, runs_launch, tiles_launch, use_gluon, gluon_launch in combos:
        DQ.FAST_DIV = fast
        DQ.LAUNCH.update({False: runs_launch, True: tiles_launch})
        DQ.GLUON, DG.LAUNCH = use_gluon, gluon_launch
        x = torch.randn(3, 1000, 300, device="cuda", dtype=torch.bfloat16) * 7
        x[0, :, 128:256] = 0
        x[1, 517, 3] = float("nan")
        x[2, 0:128, 0:128] *= 1e-38  # subnormal-sized cells: the scaled path of _quotient
        x[2, 200:300, :] = -0.0  # signed zeros
        x[2, 900, 290] = float("inf")
        x[0, 700:800, 40:60] *= 3e37  # near the top of the range
        for block in (128, 64):
            d, s, d_t, s_t = dual_quantize(x, dt, block, False)
            r, rs = quantize_cells(x, dt, 1, block)
            c, cs = quantize_cells(x.transpose(1, 2), dt, 1, block, scale_rows_inner=True)
            same = (torch.equal(d.view(torch.uint8), r.view(torch.uint8)) and torch.equal(s, rs, )
                    and torch.equal(d_t.view(torch.uint8), c.view(torch.uint8))
                    and torch.equal(s_t.transpose(1, 2), cs, ))
            same = same or _equal_nan(d, s, d_t, s_t, r, rs, c, cs)
            w = x.transpose(1, 2)
            d, s, d_t, s_t = dual_quantize(w, dt, block, True)
            q, qs = quantize_cells(w, dt, block, block)
            qt, _ = quantize_cells(w.transpose(1, 2), dt, block, block)
            tiles = (torch.equal(d.view(torch.uint8), q.view(torch.uint8)) and _eq(s, qs)
                     and torch.equal(d_t.view(torch.uint8), qt.view(torch.uint8)))
            emit(check="dual_quantize", dtype=str(dt), fast_div=fast, block=block, runs="PASS" if same else "FAIL",
                 tiles="PASS" if tiles else "FAIL", runs_launch=runs_launch, tiles_launch=tiles_launch,
                 gluon_runs=use_gluon and block == 128, gluon_launch=gluon_launch)
            ok = ok and same and tiles
    DQ.FAST_DIV = default[0]
    DQ.LAUNCH.update(default[1])
    DQ.GLUON, DG.LAUNCH = True, gluon_default
    return ok


def _eq(a, b) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=-1.0), torch.nan_to_num(b, nan=-1.0))


def _equal_nan(d, s, d_t, s_t, r, rs, c, cs) -> bool:
    return (torch.equal(d.view(torch.uint8), r.view(torch.uint8)) and _eq(s, rs)
            and torch.equal(d_t.view(torch.uint8), c.view(torch.uint8)) and _eq(s_t.transpose(1, 2), cs))


#: Operands the sweep times: (name, tensor shape, tiles?). Runs: DeepSeek-V3 up_gate's x (hidden
#: 7168), Qwen3-30B-A3B down's x and gradient (768 and 2048 wide), GPT-OSS-20B's (2880: a ragged
#: last block). Tiles: the matching expert weights.
SWEEP_OPERANDS = [("dsv3_x", (1, 32768, 7168), False), ("qwen3_down_x", (1, 65536, 768), False),
                  ("qwen3_down_grad", (1, 65536, 2048), False), ("gptoss_x", (1, 16384, 2880), False),
                  ("dsv3_w", (8, 4096, 7168), True), ("qwen3_down_w", (16, 2048, 768), True),
                  ("gptoss_w", (4, 2880, 2880), True)]


def sweep_dual() -> None:
    """Times every Triton launch in RUNS_LAUNCHES / TILES_LAUNCHES and, for runs, every Gluon
    variant (_gluon_setups, launch orders) on SWEEP_OPERANDS, next to the two quantize_cells calls
    a launch replaces and to a clone and a cast of the same operands; names the best geomean per
    mode and leaves the module defaults in place."""
    import math

    import turbo_dispatch.backends.triton.dual_quantize as DQ

    triton_default = dict(DQ.LAUNCH)
    for tile, launches in ((False, RUNS_LAUNCHES), (True, TILES_LAUNCHES)):
        ops = [(name, torch.randn(*shape, device="cuda", dtype=torch.bfloat16))
               for name, shape, t in SWEEP_OPERANDS if t == tile]
        two = {}
        for name, src in ops:
            if tile:
                two[name] = time_ms(lambda: (quantize_cells(src, E4, 128, 128),
                                             quantize_cells(src.transpose(1, 2), E4, 128, 128)))
            else:
                two[name] = time_ms(lambda: (quantize_cells(src, E4, 1, 128),
                                             quantize_cells(src.transpose(1, 2), E4, 1, 128, scale_rows_inner=True)))
        best = None
        variants = [("triton", la, {}) for la in launches]
        variants += [("gluon", label, setup) for label, setup in _gluon_setups(tile)]
        for kernel, launch, setup in variants:
            DQ.GLUON = kernel != "triton"
            if kernel == "triton":
                DQ.LAUNCH[tile] = launch
            saved = _apply_gluon(setup)
            logs = []
            for name, src in ops:
                try:
                    ms = time_ms(lambda: dual_quantize(src, E4, 128, tile))
                except Exception as exc:
                    emit(probe="dual_sweep", tiles=tile, kernel=kernel, operand=name, launch=launch,
                         error=f"{type(exc).__name__}: {str(exc)[:300]}")
                    logs = []
                    break
                logs.append(math.log(ms))
                emit(probe="dual_sweep", tiles=tile, kernel=kernel, operand=name, launch=launch, ms=ms,
                     two_ms=two[name], tbs=src.numel() * 4 / ms * 1e-9, vs_two=two[name] / ms)
            _apply_gluon(saved)
            if not logs:
                continue
            geo = math.exp(sum(logs) / len(logs))
            emit(probe="dual_sweep_geomean", tiles=tile, kernel=kernel, launch=launch, geomean_ms=geo)
            if best is None or geo < best[0]:
                best = (geo, kernel, launch)
        emit(probe="dual_best", tiles=tile, kernel=best[1], launch=best[2], geomean_ms=best[0])
        for name, src in ops:  # what the memory system gives simpler kernels on the same operands
            copy_ms = time_ms(lambda: src.clone())
            cast_ms = time_ms(lambda: src.to(E4))
            emit(probe="bandwidth_reference", tiles=tile, operand=name, clone_ms=copy_ms,
                 clone_tbs=src.numel() * 4 / copy_ms * 1e-9, cast_ms=cast_ms, cast_tbs=src.numel() * 3 / cast_ms * 1e-9)
        DQ.GLUON = True  # the defaults for the rest of the run
        DQ.LAUNCH.update(triton_default)
        del ops
        torch.cuda.empty_cache()


#: Variants of ``--spans`` (label, the ``dual_quantize_gluon`` settings): one tile per unit (the
#: kernel up to round 92), the shipped rule, and each strip width forced.
SPAN_VARIANTS = [("tile", {"RUNS_SPANS": (), "RUNS_MIN_UNITS": 12}),
                 ("rule", {"RUNS_SPANS": (8, 4, 2), "RUNS_MIN_UNITS": 12}),
                 ("2", {"RUNS_SPANS": (2,), "RUNS_MIN_UNITS": 0}), ("4", {"RUNS_SPANS": (4,), "RUNS_MIN_UNITS": 0}),
                 ("8", {"RUNS_SPANS": (8,), "RUNS_MIN_UNITS": 0})]
#: Token-run operands of ``quantiser_settings_sweep``: the sweep's, and the EP8 bench's
#: DeepSeek-V3 x and up_gate gradient (32 local experts x 4096 tokens).
ORDER_OPERANDS = [(n, s) for n, s, t in SWEEP_OPERANDS if not t] + [("dsv3_x_ep8", (1, 131072, 7168)),
                                                                     ("dsv3_grad_ep8", (1, 131072, 4096))]
#: Expert weights of ``quantiser_settings_sweep(..., tile=True)``: the sweep's, and the EP8 bench's
#: DeepSeek-V3 and Qwen3-30B-A3B up_gate weights.
TILE_OPERANDS = [(n, s) for n, s, t in SWEEP_OPERANDS if t] + [("dsv3_w_ep8", (32, 4096, 7168)),
                                                                 ("qwen3_up_w", (16, 1536, 2048))]


def quantiser_variants(spec: str) -> tuple[list, list]:
    """``--quantiser-sweep`` SPEC, ``runs=S,P,R/...;tiles=ROWS,WARPS,R/...``, as the runs and tiles
    variants of ``quantiser_settings_sweep``: TMA_RUNS (ring stages, programs per SM, maxnreg) and
    TILES_LAUNCH (rows per thread, warps, maxnreg); the first of each is its baseline."""
    attrs = {"runs": "TMA_RUNS", "tiles": "TILES_LAUNCH"}
    out = {kind: [] for kind in attrs}
    for part in filter(None, spec.split(";")):
        kind, _, values = (p.strip() for p in part.partition("="))
        if kind not in attrs:
            raise SystemExit(f"--quantiser-sweep: {kind!r} must be 'runs' or 'tiles' (spec {spec!r})")
        for v in filter(None, values.split("/")):
            launch = tuple(int(x) for x in v.split(","))
            out[kind].append((f"{kind} {launch}", {attrs[kind]: launch}))
    return out["runs"], out["tiles"]


def medians_in_turns(calls: dict, rounds: int, reps: int = 20) -> dict:
    """Median GPU time (``time_ms`` over ``reps`` calls) of each call, the calls timed in turns for
    ``rounds`` rounds: ``calls`` maps a name to (prepare, fn), prepare() (setting a module switch,
    say) run untimed before each timing of fn."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (prepare, fn) in calls.items():
            prepare()
            times[name].append(time_ms(fn, reps))
    return {name: statistics.median(v) for name, v in times.items()}


def _nothing() -> None:
    pass


def quantiser_settings_sweep(variants: list, probe: str, rounds: int = 5, tile: bool = False) -> None:
    """Settings of the Gluon dual quantiser (``variants``: label and the ``dual_quantize_gluon``
    attributes it sets, the first the baseline), timed in turns next to a clone on ORDER_OPERANDS
    (token runs, the persistent TMA runs kernel) or, with ``tile``, on TILE_OPERANDS (expert
    weights, the 2-D tiles kernel); every variant is checked bit for bit (data, scales) against
    the first. For runs, names the strip width the shipped rule (``_span``) takes."""
    import turbo_dispatch.backends.triton.dual_quantize_gluon as DG
    from turbo_dispatch.backends.triton.gemm_kernels import num_programs

    shipped = {name: getattr(DG, name) for _, attrs in variants for name in attrs}

    def setting(attrs):
        def prepare():
            for name, value in {**shipped, **attrs}.items():
                setattr(DG, name, value)
        return prepare

    for name, shape in (TILE_OPERANDS if tile else ORDER_OPERANDS):
        src = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
        src[0, 5, 3] = float("nan")  # a NaN scale in one cell
        src[0, 200:300, :] *= 1e-30  # tiny scales
        ref = None
        same = {}
        for label, attrs in variants:
            setting(attrs)()
            out = dual_quantize(src, E4, 128, tile)
            if ref is None:
                ref = out
            same[label] = _equal_nan(out[0], out[1], out[2], out[3].transpose(1, 2), ref[0], ref[1], ref[2],
                                     ref[3]) and (tile or out[1].stride(1) % 16 == 0)
            del out
        setting({})()
        rule = None if tile else DG._span(ref[1], shape[0] * -(-shape[1] // 128), DG.TMA_RUNS[1] * num_programs(0))
        del ref
        calls = {label: (setting(attrs), lambda: dual_quantize(src, E4, 128, tile)) for label, attrs in variants}
        calls["clone"] = (_nothing, lambda: src.clone())
        med = medians_in_turns(calls, rounds)
        setting({})()
        base = variants[0][0]
        for label, ms in med.items():
            if label != "clone":
                emit(probe=probe, operand=name, variant=label, rule_takes=rule, ms=ms,
                     tbs=src.numel() * 4 / ms * 1e-9, vs_first=med[base] / ms, bits_equal=same[label])
        emit(probe=probe + "_clone", operand=name, ms=med["clone"], tbs=src.numel() * 4 / med["clone"] * 1e-9)
        del src
        torch.cuda.empty_cache()


#: (name, x [T, K], w [G, N, K]) of ``pair_sweep``: the EP8 bench's forward operands at 4096
#: tokens per local expert.
PAIR_OPERANDS = [("dsv3_up_ep8", (131072, 7168), (32, 4096, 7168)),
                 ("dsv2_up_ep8", (81920, 5120), (20, 3072, 5120)),
                 ("qwen3_up_ep8", (65536, 2048), (16, 1536, 2048)),
                 ("qwen3_down_ep8", (65536, 768), (16, 2048, 768)),
                 ("gptoss_down_ep8", (16384, 2880), (4, 2880, 2880)),
                 ("mixtral_up_ep8", (4096, 4096), (1, 28672, 4096))]


def pair_sweep(rounds: int = 5) -> None:
    """The forward's two quantisations (x's token runs, w's tiles) one after the other against
    w's on a second stream while x's runs (``backends.quantizer.side_by_side``, as the step runs
    them: both memory-bound, neither at the memory's rate alone), in turns; and each alone."""
    from turbo_dispatch.backends.quantizer import side_by_side

    for name, xs, ws in PAIR_OPERANDS:
        x = torch.randn(1, *xs, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(*ws, device="cuda", dtype=torch.bfloat16)

        def x_alone():
            return dual_quantize(x, E4, 128, False)

        def w_alone():
            return dual_quantize(w, E4, 128, True)

        med = medians_in_turns({"serial": (_nothing, lambda: (x_alone(), w_alone())),
                                "concurrent": (_nothing, lambda: side_by_side(x_alone, w_alone, x.device)),
                                "x_alone": (_nothing, x_alone), "w_alone": (_nothing, w_alone)}, rounds)
        moved = (x.numel() + w.numel()) * 4
        emit(probe="pair_sweep", operand=name, **{f"{k}_ms": v for k, v in med.items()},
             serial_tbs=moved / med["serial"] * 1e-9, concurrent_tbs=moved / med["concurrent"] * 1e-9,
             concurrent_vs_serial=med["serial"] / med["concurrent"])
        del x, w
        torch.cuda.empty_cache()


def backward_pair_sweep(shapes: list[str], rounds: int = 5) -> None:
    """The blockwise step (forward + backward through the public op) with the backward's dgrad on
    a side stream beside its wgrad (``grouped_gemm.BACKWARD_SIDE_BY_SIDE``) and without, in turns,
    at ``shapes`` and ROUTING's group sizes; the two steps' outputs and gradients compared."""
    shipped = _grouped.BACKWARD_SIDE_BY_SIDE
    for shape in shapes:
        t, n, k, lens, offs, a, w, grad, cfg = step_operands(shape)
        run = step_fn(a, w, lens, offs, cfg, grad)
        results = {}
        for flag in (False, True):
            _grouped.BACKWARD_SIDE_BY_SIDE = flag
            out = run()
            results[flag] = (out.detach().clone(), a.grad.clone(), w.grad.clone())
        same = all(torch.equal(x, y) for x, y in zip(results[False], results[True]))
        del results
        def switch(flag):
            def prepare():
                _grouped.BACKWARD_SIDE_BY_SIDE = flag
            return prepare

        med = medians_in_turns({"serial": (switch(False), run), "pair": (switch(True), run)}, rounds)
        _grouped.BACKWARD_SIDE_BY_SIDE = shipped
        serial, pair = med["serial"], med["pair"]
        flops = 3 * 2.0 * t * n * k
        emit(probe="backward_pair", shape=shape, routing=ROUTING[0], serial_ms=serial, pair_ms=pair,
             pair_vs_serial=serial / pair, serial_tflops=flops / serial * 1e-9, pair_tflops=flops / pair * 1e-9,
             bits_equal=same)
        del a, w, grad
        torch.cuda.empty_cache()


def step_fn(a, w, lens, offs, cfg, grad):
    def run():
        a.grad = w.grad = None
        if cfg is None:
            out = turbo.ops.grouped_gemm(a, w, lens, offs, trans_b=True)
        else:
            out = turbo.ops.grouped_gemm_fp8(a, w, lens, offs, trans_b=True, config=cfg)
        out.backward(grad)
        return out
    return run


def reuse_sweep(shapes: list[str], micro_batches: int, rounds: int = 3, reps: int = 5) -> None:
    """``micro_batches`` blockwise fp8 steps on one weight (gradient accumulation) with its tiles
    made once (``low_precision.reuse_quantized_weights``) against made every step, and the bf16
    ``torch._grouped_mm`` peer's steps (the bench's autograd.Function), in turns; time per
    micro-batch. The reused steps' outputs and gradients are checked against the fresh ones."""
    from turbo_dispatch.low_precision import reuse_quantized_weights

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_grouped_gemm import TorchGroupedMM  # the bench's bf16 peer

    ratios = []
    for shape in shapes:
        t, n, k, lens, offs, a, w, grad, cfg = step_operands(shape)
        fp8_step = step_fn(a, w, lens, offs, cfg, grad)
        ends = offs[1:].contiguous()

        def bf16_step():
            a.grad = w.grad = None
            TorchGroupedMM.apply(a, w, ends).backward(grad)

        def steps(reuse: bool, step=fp8_step):
            def run():
                if reuse:
                    with reuse_quantized_weights():
                        outs = [step() for _ in range(micro_batches)]
                else:
                    outs = [step() for _ in range(micro_batches)]
                return outs
            return run

        fresh = steps(False)()[-1].detach().clone(), a.grad.clone(), w.grad.clone()
        kept = steps(True)()[-1].detach().clone(), a.grad.clone(), w.grad.clone()
        same = all(torch.equal(x, y) for x, y in zip(fresh, kept))
        del fresh, kept
        med = medians_in_turns({"fresh": (_nothing, steps(False)), "reused": (_nothing, steps(True)),
                                "bf16": (_nothing, steps(False, bf16_step))}, rounds, reps)
        per = {name: ms / micro_batches for name, ms in med.items()}
        flops = 3 * 2.0 * t * n * k
        emit(probe="weight_reuse", shape=shape, routing=ROUTING[0], micro_batches=micro_batches,
             fresh_ms=per["fresh"], reused_ms=per["reused"], bf16_ms=per["bf16"],
             fresh_vs_bf16=per["bf16"] / per["fresh"], reused_vs_bf16=per["bf16"] / per["reused"],
             reused_tflops=flops / per["reused"] * 1e-9, bits_equal=same)
        ratios.append((per["bf16"] / per["fresh"], per["bf16"] / per["reused"]))
        del a, w, grad
        torch.cuda.empty_cache()
    if ratios:
        emit(probe="weight_reuse_geomean", routing=ROUTING[0], micro_batches=micro_batches, shapes=len(ratios),
             fresh_vs_bf16=statistics.geometric_mean(r[0] for r in ratios),
             reused_vs_bf16=statistics.geometric_mean(r[1] for r in ratios))


def preset_shapes(spec: str) -> list[str]:
    """``presets:EP:TOKENS`` -> the names of the bench's MoE shapes at that expert parallelism and
    tokens per local expert (every preset of bench_grouped_gemm, up_gate and down, cases above its
    routed-token limit left out), added to ``SHAPES``; any other spec is a comma-separated list
    of ``SHAPES`` names."""
    if not spec.startswith("presets:"):
        return spec.split(",")
    _, ep, tpe = spec.split(":")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_grouped_gemm import DEFAULT_MODELS, MAX_TOKENS

    from turbo_dispatch.presets import get_model, moe_grouped_shapes

    names = []
    for model in DEFAULT_MODELS:
        for s in moe_grouped_shapes(get_model(model), ep=int(ep), tokens_per_expert=int(tpe)):
            name = f"{model}_{s.name}_ep{ep}_{tpe}"
            if s.m_total <= MAX_TOKENS and name not in SHAPES:
                SHAPES[name] = (s.groups, s.m_total, s.n, s.k)
                names.append(name)
    return names


GRAPHS = False  # --graphs


def step_graph(a, w, lens, offs, cfg, grad) -> torch.cuda.CUDAGraph:
    """A whole step (``step_fn``) captured in a CUDA graph, on fresh leaves sharing a and w's memory.

    A leaf's AccumulateGrad node keeps the stream of its first backward; a and w had theirs on the
    legacy default stream in the eager runs, so the captured backward would have made the legacy
    stream wait on the capture ("operation would make the legacy stream depend on a capturing
    blocking stream", cudaErrorStreamCaptureImplicit: rounds 27, 28 and 136). Fresh leaves get
    theirs in the warm-ups on the capture helper's side stream, as in a fresh process
    (probe_step_capture.py)."""
    a, w = (x.detach().requires_grad_() for x in (a, w))
    return capture_graph(step_fn(a, w, lens, offs, cfg, grad), warmups=2, empty_cache=True)


def graph_ms(a, w, lens, offs, cfg, grad) -> float:
    """Time of one replay of a whole step captured in a CUDA graph (``step_graph``): the GPU time
    alone, without the host's launch and dispatch overhead that the eager time includes."""
    graph = step_graph(a, w, lens, offs, cfg, grad)
    ms = time_ms(graph.replay)
    del graph
    return ms


def with_reuse(flag: bool, fn):
    saved = _grouped._step_reuses_quantization
    if not flag:
        _grouped._step_reuses_quantization = lambda cfg: False
    try:
        return fn()
    finally:
        _grouped._step_reuses_quantization = saved


def step_operands(shape: str):
    """(tokens, N, K, lens, offs, a, w, grad, cfg) of ``shape``'s blockwise step, ``ROUTING``'s
    group sizes, random operands (seeded)."""
    g, t, n, k = SHAPES[shape]
    lens = torch.tensor(bench_routing(ROUTING[0], t, g), dtype=torch.int64, device="cuda")
    offs = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    torch.manual_seed(0)
    a = torch.randn(t, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    grad = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    return t, n, k, lens, offs, a, w, grad, Float8QuantConfig(granularity="blockwise", block_size=128)


def probe(shape: str) -> bool:
    t, n, k, lens, offs, a, w, grad, cfg = step_operands(shape)
    GlobalBackendManager.reset()
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    results = {}
    for reuse in (True, False):
        out = with_reuse(reuse, step_fn(a, w, lens, offs, cfg, grad))
        results[reuse] = (out.detach().clone(), a.grad.clone(), w.grad.clone())
    same = all(torch.equal(x, y) for x, y in zip(results[True], results[False]))
    emit(check="step_reuse_vs_not", shape=shape, result="PASS" if same else "FAIL",
         max_diff=max((x.float() - y.float()).abs().max().item() for x, y in zip(results[True], results[False])))
    flops = 3 * 2.0 * t * n * k
    t_fp8 = with_reuse(True, lambda: time_ms(step_fn(a, w, lens, offs, cfg, grad)))
    t_old = with_reuse(False, lambda: time_ms(step_fn(a, w, lens, offs, cfg, grad)))
    g_fp8 = with_reuse(True, lambda: graph_ms(a, w, lens, offs, cfg, grad)) if GRAPHS else float("nan")
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TORCH, precision="bf16")
    t_bf16 = time_ms(step_fn(a, w, lens, offs, None, grad))
    g_bf16 = graph_ms(a, w, lens, offs, None, grad) if GRAPHS else float("nan")
    GlobalBackendManager.reset()
    emit(probe="step", shape=shape, bf16_ms=t_bf16, fp8_reuse_ms=t_fp8, fp8_per_gemm_ms=t_old,
         reuse_vs_bf16=t_bf16 / t_fp8, per_gemm_vs_bf16=t_bf16 / t_old, reuse_gain=t_old / t_fp8,
         bf16_tflops=flops / t_bf16 * 1e-9, fp8_reuse_tflops=flops / t_fp8 * 1e-9)
    if GRAPHS:
        emit(probe="step_graph", shape=shape, bf16_ms=g_bf16, fp8_reuse_ms=g_fp8, reuse_vs_bf16=g_bf16 / g_fp8,
             fp8_host_share=1 - g_fp8 / t_fp8, bf16_host_share=1 - g_bf16 / t_bf16)
    # The quantisers alone: what the step does now vs what the three GEMMs did.
    x2 = a.detach()
    w3 = w.detach()
    dual_x = time_ms(lambda: dual_quantize(x2.unsqueeze(0), E4, 128, False))
    two_x = time_ms(lambda: (quantize_cells(x2.unsqueeze(0), E4, 1, 128),
                             quantize_cells(x2.t().unsqueeze(0), E4, 1, 128, scale_rows_inner=True)))
    dual_w = time_ms(lambda: dual_quantize(w3, E4, 128, True))
    two_w = time_ms(lambda: (quantize_cells(w3, E4, 128, 128), quantize_cells(w3.transpose(1, 2), E4, 128, 128)))
    emit(probe="quantisers", shape=shape, dual_x_ms=dual_x, two_x_ms=two_x, dual_x_gbs=x2.numel() * 4 / dual_x * 1e-6,
         dual_w_ms=dual_w, two_w_ms=two_w, dual_w_gbs=w3.numel() * 4 / dual_w * 1e-6)
    return same


def host_profile(shape: str, pstats_file: str | None = None) -> None:
    """Where the host time of the fp8 blockwise step goes: 30 steps (TRITON pinned, no autotune)
    under cProfile, the top functions by own time and by cumulative time (and the whole profile
    in ``pstats_file``)."""
    import cProfile
    import io
    import pstats

    _, _, _, lens, offs, a, w, grad, cfg = step_operands(shape)
    GlobalBackendManager.reset()
    GlobalBackendManager.set_grouped_gemm_backend(BackendType.TRITON, precision="fp8")
    run = step_fn(a, w, lens, offs, cfg, grad)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    host = []
    for _ in range(30):
        torch.cuda._sleep(20_000_000)  # the GPU stays busy: the host never waits on it
        t0 = time.perf_counter()
        run()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    emit(probe="host_ms", shape=shape, median=statistics.median(host), min=min(host))
    prof = cProfile.Profile()
    for _ in range(30):
        torch.cuda._sleep(20_000_000)
        prof.enable()
        run()
        prof.disable()
        torch.cuda.synchronize()
    if pstats_file:
        prof.dump_stats(pstats_file)
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
        print(buf.getvalue(), flush=True)
    GlobalBackendManager.reset()


def _in_step(name: str) -> bool:
    """Whether a profiled kernel belongs to the step: the GPU spin that lets the host run ahead
    (torch.cuda._sleep) does not."""
    return "sleep" not in name and "spin_kernel" not in name


def _profiled_steps(run, steps: int):
    """``steps`` calls of ``run`` back to back under torch.profiler (a GPU spin before each lets
    the host run ahead): (per-kernel rows (ms per step, launches per step, name), largest first;
    a step's kernels in launch order as (median ms over the steps, name))."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda._sleep(20_000_000)
            run()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = evt.self_cuda_time_total
        if us > 0 and _in_step(evt.key):
            rows.append((us / steps / 1e3, evt.count // steps, evt.key))
    rows.sort(reverse=True)
    # The forward and dgrad share a kernel name: they are told apart by their place in the step.
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and _in_step(e.name)),
                     key=lambda e: e.time_range.start)
    per_step = len(kernels) // steps
    seq = [(statistics.median(kernels[i].time_range.elapsed_us() / 1e3 for i in range(o, per_step * steps, per_step)),
            kernels[o].name) for o in range(per_step)]
    return rows, seq, _spans(kernels, per_step, steps)


def _spans(kernels: list, per_step: int, steps: int) -> dict:
    """Median over the steps of (first kernel's start to last kernel's end, the time at least one
    kernel runs, the kernels' summed durations), in ms: span above busy is time the GPU idled
    inside the step; summed above busy is time two streams' kernels overlapped."""
    spans, busy, summed = [], [], []
    for i in range(0, per_step * steps, per_step):
        ivs = sorted((k.time_range.start, k.time_range.end) for k in kernels[i:i + per_step])
        spans.append((max(e for _, e in ivs) - ivs[0][0]) / 1e3)
        summed.append(sum(e - b for b, e in ivs) / 1e3)
        covered, cur_b, cur_e = 0.0, *ivs[0]
        for b, e in ivs[1:]:
            if b > cur_e:
                covered += cur_e - cur_b
                cur_b, cur_e = b, e
            else:
                cur_e = max(cur_e, e)
        busy.append((covered + cur_e - cur_b) / 1e3)
    return {"span_ms": statistics.median(spans), "busy_ms": statistics.median(busy),
            "summed_ms": statistics.median(summed)}


def kernel_profile(shape: str, steps: int = 10) -> None:
    """Which GPU kernels one step runs and for how long: ``steps`` steps of the fp8 blockwise op
    (TRITON pinned) and of the bf16 op (TORCH) under torch.profiler, each kernel's GPU time per
    step, largest first, one line each (``probe=kernels``), and each kernel of a step in launch
    order, the median over the steps (``probe=kernel_seq``)."""
    _, _, _, lens, offs, a, w, grad, cfg = step_operands(shape)
    variants = (("fp8", BackendType.TRITON, "fp8", cfg), ("bf16", BackendType.TORCH, "bf16", None))
    for label, backend, precision, c in variants:
        GlobalBackendManager.reset()
        GlobalBackendManager.set_grouped_gemm_backend(backend, precision=precision)
        run = step_fn(a, w, lens, offs, c, grad)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        rows, seq, spans = _profiled_steps(run, steps)
        total = sum(r[0] for r in rows)
        # the step timed as the bench times it (host covered), right after the profile
        emit(probe="kernels_span", shape=shape, routing=ROUTING[0], variant=label, **spans,
             timed_step_ms=time_ms(run))
        for order, (ms, name) in enumerate(seq):
            emit(probe="kernel_seq", shape=shape, routing=ROUTING[0], variant=label, order=order, ms=ms,
                 kernel=name[:60])
        emit(probe="kernels_total", shape=shape, routing=ROUTING[0], variant=label, gpu_ms_per_step=total)
        for ms, count, name in rows[:14]:
            emit(probe="kernels", shape=shape, variant=label, ms=ms, per_step=count, share=ms / total,
                 kernel=name[:110])
    GlobalBackendManager.reset()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="dsv3_up,dsv3_down,qwen3_up,mixtral_up")
    ap.add_argument("--out", default=None)
    ap.add_argument("--graphs", action="store_true", help="also time each step replayed from a CUDA graph")
    ap.add_argument("--sweep", action="store_true", help="sweep the dual quantiser's launches first (and keep "
                    "the fastest for the rest of the run)")
    ap.add_argument("--host-profile", default=None, metavar="SHAPE",
                    help="cProfile the host side of 30 fp8 blockwise steps at SHAPE (top functions)")
    ap.add_argument("--pstats", default=None, metavar="FILE", help="with --host-profile: the whole cProfile here")
    ap.add_argument("--host-only", action="store_true",
                    help="with --host-profile: only that profile (no checks, no shapes), and stop")
    ap.add_argument("--routing", default="balanced", choices=["balanced", "skewed", "empty"],
                    help="group sizes of the step (the bench's routings; default balanced)")
    ap.add_argument("--pairs", action="store_true",
                    help="only time the forward's two quantisations serial and on two streams (pair_sweep) and stop")
    ap.add_argument("--backward-pairs", default=None, metavar="SHAPES",
                    help="only time the step with the dgrad beside the wgrad on two streams and without "
                         "(backward_pair_sweep) at these shapes, and stop")
    ap.add_argument("--spans", action="store_true",
                    help="only time the TMA runs quantiser's strip widths (span_sweep) and stop")
    ap.add_argument("--reuse", default=None, metavar="SHAPES",
                    help="only time --micro-batches steps with the weight's tiles reused against made every step "
                         "and against bf16 (reuse_sweep) at these shapes (or presets:EP:TOKENS, the bench's "
                         "shapes), and stop")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--quantiser-sweep", default=None, metavar="SPEC",
                    help="only time launches of the Gluon dual quantiser in turns, bit-checked against the first: "
                         "'runs=S,P,R/...;tiles=ROWS,WARPS,R/...' (quantiser_variants), and stop")
    ap.add_argument("--kernels", default=None, metavar="SHAPES",
                    help="only profile the GPU kernels of one step at these shapes (fp8 and bf16) and stop")
    args = ap.parse_args()
    global GRAPHS
    GRAPHS = args.graphs
    ROUTING[0] = args.routing
    if args.out:
        OUT.append(open(args.out, "w"))
    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    if args.reuse:
        reuse_sweep(preset_shapes(args.reuse), args.micro_batches)
        return 0
    if args.spans:
        quantiser_settings_sweep(SPAN_VARIANTS, "span_sweep")
        return 0
    if args.host_profile and args.host_only:
        host_profile(args.host_profile, args.pstats)
        return 0
    if args.quantiser_sweep:
        runs, tiles = quantiser_variants(args.quantiser_sweep)
        if runs:
            quantiser_settings_sweep(runs, "runs_sweep")
        if tiles:
            quantiser_settings_sweep(tiles, "tiles_sweep", tile=True)
        return 0
    if args.pairs:
        pair_sweep()
        return 0
    if args.backward_pairs:
        backward_pair_sweep(args.backward_pairs.split(","))
        return 0
    if args.kernels:
        for shape in args.kernels.split(","):
            kernel_profile(shape)
            torch.cuda.empty_cache()
        return 0
    if args.sweep:
        sweep_dual()
        torch.cuda.empty_cache()
    ok = check_dual()
    ok = check_gluon_variants() and ok
    if args.host_profile:
        host_profile(args.host_profile, args.pstats)
    for shape in args.shapes.split(","):
        ok = probe(shape) and ok
        torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
