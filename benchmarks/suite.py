"""One entry point for every benchmark family: runs each family's scripts under a time limit and
collects their reports in one output folder.

A family is a list of runs of the scripts in this folder (bench_gemm.py, bench_grouped_gemm.py,
bench_dispatch_overhead.py, bench_blaslt_switch.py, bench_wrappers.py, bench_fused_producers.py,
bench_attention.py, probes/probe_attention.py, probes/probe_step_host.py, bench_model.py,
bench_moe_layer.py),
each with the arguments that produce the figures in docs/performance.md. Every run is a
subprocess: its stdout and stderr go to ``<out>/<run>.log``, the harness benches write their
CSV/markdown/PNG reports into ``<out>`` too, and one JSON line per run (status, seconds, command)
is appended to ``<out>/suite.jsonl``. A run fails when its script exits non-zero or a row of a
turbo_dispatch backend in its report failed the correctness gate.

The family's ``--time-limit`` is shared by its runs: each run may take the time left divided by
the runs left. A run that reaches its share gets SIGTERM, upon which the harness benches stop
and write the rows measured so far (their report says INTERRUPTED); such a run's status is
``partial``. A run still alive ``GRACE_S`` seconds later is killed.

``--quick`` runs each script's smoke form (few shapes, few repeats; on a CPU-only machine the
benches' tiny CPU shapes, whose timings mean nothing but prove the scripts, the gate and the
reports work). Without ``--quick`` the runs need a GPU, except dispatch_overhead (the host cost
of a call is a CPU figure too); families that need one are reported as ``skipped`` with that
reason. The exit status is 1 when any run failed, else 0.

Usage:
    python benchmarks/suite.py --family gemm_fp8 --time-limit 540           # GPU, full runs
    python benchmarks/suite.py --family all --quick --out /tmp/smoke         # CPU or GPU smoke
    python benchmarks/suite.py --family grouped_gemm_fp8 --only fp8_blockwise_grouped_gemm_ep8_tpe4096 \\
        -- --models deepseek-v3                # arguments after -- go to every selected run
    python benchmarks/suite.py --list          # the families, their runs and full commands
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench_out import resolve_out_dir

HERE = Path(__file__).resolve().parent
GRACE_S = 60.0
#: The autotune budget per key that every published figure used.
TUNE_BUDGET = ("--tune-budget-ms", "300")


@dataclass(frozen=True)
class Run:
    """One script run of a family.

    ``args`` are always passed; ``full`` only without ``--quick`` (problem sizes and budgets: a
    quick run takes the script's own quick sizes); ``quick`` only with it. ``kind`` says what the
    script takes: ``report`` (a harness bench: ``--quick``, ``--device``, ``--out``, ``--name``),
    ``json`` (``--json PATH``), ``log`` (nothing: its stdout is the result). ``needs_gpu``:
    ``always``, ``full`` (a CPU machine runs only the quick form) or ``never``. ``env``: variables
    set for this run only (an A/B of a library switch is two runs that differ in it)."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    kind: str = "report"
    needs_gpu: str = "full"
    device_arg: bool = True
    env: tuple[tuple[str, str], ...] = ()


def _gemm(granularity: str | None) -> Run:
    dtype = ("--dtype", "bf16") if granularity is None else ("--dtype", "fp8", "--granularity", granularity)
    return Run("bf16_gemm" if granularity is None else f"fp8_{granularity}_gemm", "bench_gemm.py", dtype,
               full=("--mb", "1", *TUNE_BUDGET))


def _grouped(name: str, dtype: tuple[str, ...], ep: str, tokens: str, *more: str) -> Run:
    return Run(name, "bench_grouped_gemm.py", dtype,
               full=("--ep", ep, "--tokens-per-expert", tokens, *more, "--target-ms", "60", *TUNE_BUDGET))


BF16 = ("--dtype", "bf16")
ROWWISE = ("--dtype", "fp8", "--granularity", "rowwise")
BLOCKWISE = ("--dtype", "fp8", "--granularity", "blockwise")

#: Expert layers no preset has (Qwen3-235B-like and GPT-OSS-120B-like at EP8), as a tuner meets them.
NEW_MOE_SHAPES = "16x2048x3072x4096,16x2048x4096x1536,16x1024x5760x2880,16x1024x2880x2880"

FAMILIES: dict[str, tuple[Run, ...]] = {
    # the presets, then 8 linear layers no preset or shipped DB has (bench_gemm.py --shapes unseen)
    "gemm": (_gemm(None), Run("bf16_gemm_unseen", "bench_gemm.py", BF16, full=("--shapes", "unseen", *TUNE_BUDGET))),
    "gemm_fp8": tuple(_gemm(g) for g in ("tensorwise", "rowwise", "blockwise")),
    "grouped_gemm": (
        _grouped("bf16_grouped_gemm_tpe512", BF16, "8,16,32", "512"),
        _grouped("bf16_grouped_gemm_tpe4096", BF16, "8,16,32", "4096"),
        _grouped("bf16_grouped_gemm_tpe16384", BF16, "16,32", "16384"),
    ),
    "grouped_gemm_fp8": (
        _grouped("fp8_rowwise_grouped_gemm_ep8_tpe4096", ROWWISE, "8", "4096"),
        # TRITON alone among the pinned backends: TORCH's blockwise emulation takes minutes per case
        _grouped("fp8_blockwise_grouped_gemm_ep8_tpe4096", BLOCKWISE, "8", "4096", "--backends", "TRITON"),
        # the eager step against bf16's on shapes no preset has, wall time per step included
        Run("fp8_blockwise_grouped_gemm_new_shapes", "bench_grouped_gemm.py", BLOCKWISE,
            full=("--shapes", NEW_MOE_SHAPES, "--routings", "balanced,skewed", "--backends", "TRITON",
                  "--tune-budget-ms", "100")),
    ),
    "dispatch_overhead": (Run("dispatch_overhead", "bench_dispatch_overhead.py", kind="json", needs_gpu="never",
                              quick=("--iters", "2000", "--rounds", "3")),),
    "blaslt_switch": (Run("blaslt_switch", "bench_blaslt_switch.py", kind="log", needs_gpu="always",
                          device_arg=False),),
    "wrappers": (Run("wrappers", "bench_wrappers.py", kind="json", needs_gpu="always", device_arg=False),),
    "fused_producers": (Run("fused_producers", "bench_fused_producers.py"),),
    "attention": (Run("attention", "bench_attention.py", full=TUNE_BUDGET),
                  Run("attention_paths", "probes/probe_attention.py", kind="log", needs_gpu="always",
                      device_arg=False)),
    # one run per config, so that each writes its report even when a later one runs out of time
    "model": tuple(Run(f"model_{config}", "bench_model.py", ("--config", config), full=TUNE_BUDGET)
                   for config in ("llama3.1-8b", "llama3.1-70b-tp8", "deepseek-v3-ep8")),
    # the script spawns one process per rank itself (gloo on a CPU); too few GPUs give a SKIP row
    "moe_layer": tuple(Run(f"moe_layer_ep{ep}", "bench_moe_layer.py", full=("--nproc", str(ep))) for ep in (2, 4)),
    # where the eager fp8 step's host time goes (the probe, with Triton's C launch and with its launcher
    # object: the A/B of prebound.c_launcher), and the step's wall time at Qwen3-30B-A3B down against bf16's
    "step_host": (
        Run("step_host", "probes/probe_step_host.py", kind="log", needs_gpu="always"),
        Run("step_host_launcher_object", "probes/probe_step_host.py", ("--launcher-object",), kind="log",
            needs_gpu="always"),
        Run("step_wall_qwen3_down", "bench_grouped_gemm.py", BLOCKWISE,
            full=("--models", "qwen3-30b-a3b", "--ep", "8", "--tokens-per-expert", "4096", "--routings", "balanced",
                  "--backends", "TRITON", "--tune-budget-ms", "100")),
    ),
    # the Gluon attention backward with and without its dQ kernel's own delta (varlen and dense d128 rows)
    "attention_self_delta": tuple(
        Run(name, "bench_attention.py", ("--only", "varlen-8x,-d128-full,-d128-causal"), full=("--quick",),
            env=env)
        for name, env in (("attention_delta_preprocess", (("PRIMUS_TURBO_ATTN_GLUON_BWD_SELF_DELTA", "0"),)),
                          ("attention_self_delta", (("PRIMUS_TURBO_ATTN_GLUON_BWD_SELF_DELTA", "1"),)))),
}


@dataclass
class Context:
    out: Path
    quick: bool
    device: str | None  # as given; None: the scripts pick
    gpu: bool
    extra: tuple[str, ...]


def report_name(run: Run, ctx: Context) -> str:
    """The stem of a run's report, JSON and log files: quick runs apart from full ones."""
    return run.name + ("_quick" if ctx.quick else "")


def command(run: Run, ctx: Context) -> list[str]:
    """The argv of one run."""
    cmd = [sys.executable, str(HERE / run.script), *run.args, *(run.quick if ctx.quick else run.full)]
    if run.kind == "report":
        cmd += ["--quick"] if ctx.quick else []
        cmd += ["--device", ctx.device] if ctx.device else []
        cmd += ["--out", str(ctx.out), "--name", report_name(run, ctx)]
    elif run.device_arg:  # bench_dispatch_overhead.py defaults to the CPU: name the GPU when there is one
        cmd += ["--device", ctx.device or ("cuda" if ctx.gpu else "cpu")]
    if run.kind == "json":
        cmd += ["--json", str(ctx.out / f"{report_name(run, ctx)}.json")]
    return cmd + list(ctx.extra)


def skip_reason(run: Run, ctx: Context, earlier: list[Run]) -> str | None:
    """Why ``run`` does not run here, or None. ``earlier``: the family's runs before it; a quick run
    identical to one of theirs (the grouped sweeps differ only in the sizes a quick run drops) runs
    once."""
    if not ctx.gpu and run.needs_gpu == "always":
        return "needs a CUDA/ROCm GPU (none visible)"
    if not ctx.gpu and run.needs_gpu == "full" and not ctx.quick:
        return "a full run needs a GPU; --quick runs its CPU smoke form"
    if ctx.quick:
        same = next((e for e in earlier if (e.script, e.args, e.quick, e.env) == (run.script, run.args, run.quick,
                                                                                 run.env)), None)
        if same is not None:
            return f"its quick form is {same.name}'s"
    return None


def command_line(cmd: list[str], env: tuple[tuple[str, str], ...]) -> str:
    """``cmd`` as a shell line, prefixed with the run's own variables."""
    return " ".join([*(f"{k}={v}" for k, v in env), *cmd])


def execute(cmd: list[str], log: Path, limit_s: float, env: tuple[tuple[str, str], ...] = ()) -> tuple[int, bool]:
    """Runs ``cmd`` (with the variables ``env`` set on top of this process's) with its output in
    ``log``; SIGTERM at ``limit_s``, a kill ``GRACE_S`` later. Returns (exit status, whether the
    limit was reached)."""
    with open(log, "w") as fh:
        fh.write("$ " + command_line(cmd, env) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=HERE.parent,
                                env={**os.environ, **dict(env)} if env else None)
        try:
            return proc.wait(timeout=max(limit_s, 1.0)), False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=GRACE_S), True
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait(), True


def failed_rows(out: Path, report: str, since: float) -> tuple[int, int]:
    """(rows of turbo_dispatch's own backends, other rows) with check FAIL in the CSVs that the run
    named ``report`` wrote into ``out`` after ``since`` (a time.time()). A turbo FAIL row is a
    wrong result or an exception from the library, so it fails the run; a peer's FAIL row (e.g.
    a torch kernel this machine's torch lacks) is only counted."""
    pattern = re.compile(r"[^_]+_\d{4}-\d{2}-\d{2}_" + re.escape(report) + r"\.csv")
    turbo = other = 0
    for path in out.glob(f"*_{report}.csv"):
        if pattern.fullmatch(path.name) and path.stat().st_mtime >= since:
            with open(path, newline="") as fh:
                for row in csv.DictReader(fh):
                    if row.get("check") == "FAIL":
                        turbo += row.get("backend", "").startswith("turbo")
                        other += not row.get("backend", "").startswith("turbo")
    return turbo, other


def run_family(family: str, runs: list[Run], ctx: Context, time_limit: float, dry_run: bool) -> list[dict]:
    """Runs ``runs`` in order, each under its share of ``time_limit``; one record per run."""
    records = []
    deadline = time.monotonic() + time_limit
    for i, run in enumerate(runs):
        cmd = command(run, ctx)
        share = max(deadline - time.monotonic(), 0.0) / (len(runs) - i)
        record = {"family": family, "run": run.name, "cmd": command_line(cmd, run.env), "limit_s": round(share)}
        reason = skip_reason(run, ctx, runs[:i])
        if reason:
            record.update(status="skipped", reason=reason)
        elif dry_run:
            record.update(status="dry-run")
        else:
            report = report_name(run, ctx)
            log = ctx.out / f"{report}.log"
            print(f"[suite] {family}/{run.name}: running, limit {share:.0f} s, log {log}", flush=True)
            t0, started = time.monotonic(), time.time() - 1.0
            rc, limited = execute(cmd, log, share, run.env)
            turbo_fails, other_fails = failed_rows(ctx.out, report, started)
            status = "failed" if (rc != 0 and not limited) or turbo_fails else ("partial" if limited else "ok")
            record.update(status=status, rc=rc, seconds=round(time.monotonic() - t0, 1), log=str(log),
                          turbo_fail_rows=turbo_fails, peer_fail_rows=other_fails)
        print(f"[suite] {family}/{run.name}: {record['status']}"
              + (f" ({record['reason']})" if "reason" in record else "")
              + (f" rc={record['rc']} in {record['seconds']} s" if "rc" in record else "")
              + (f", FAIL rows: {record['turbo_fail_rows']} turbo, {record['peer_fail_rows']} peer"
                 if record.get("turbo_fail_rows") or record.get("peer_fail_rows") else "")
              + ("" if record["status"] in ("ok", "partial", "failed") else f": {record['cmd']}"), flush=True)
        records.append(record)
    return records


def _gpu_visible(device: str | None) -> bool:
    if device is not None:
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Arguments after -- go to every selected run's script.")
    parser.add_argument("--family", action="append", choices=[*FAMILIES, "all"],
                        help="a family to run; repeat for several (default: all)")
    parser.add_argument("--only", default=None, metavar="RUN[,RUN]", help="run only these runs of the families")
    parser.add_argument("--out", default=None,
                        help="output folder (default $TURBO_BENCH_OUT, else bench-out/ at the repository root)")
    parser.add_argument("--time-limit", type=float, default=540.0, metavar="SECONDS",
                        help="per family, shared by its runs (default 540)")
    parser.add_argument("--quick", action="store_true", help="each script's smoke form (runs on a CPU too)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="default: cuda when torch sees a GPU (ROCm included), else cpu")
    parser.add_argument("--dry-run", action="store_true", help="print each run's command; run nothing")
    parser.add_argument("--list", action="store_true", help="print 'family<TAB>run,run,...' lines and exit")
    args = parser.parse_args(argv)
    if args.list:
        for family, runs in FAMILIES.items():
            print(f"{family}\t{','.join(r.name for r in runs)}")
        return 0
    families = list(FAMILIES) if not args.family or "all" in args.family else list(dict.fromkeys(args.family))
    selected = {f: list(FAMILIES[f]) for f in families}
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {r.name for runs in selected.values() for r in runs}
        if unknown:
            parser.error(f"--only: no run named {', '.join(sorted(unknown))} in {', '.join(families)} (see --list)")
        selected = {f: [r for r in runs if r.name in wanted] for f, runs in selected.items()}
        selected = {f: runs for f, runs in selected.items() if runs}

    out = resolve_out_dir(args.out)
    ctx = Context(out=out, quick=args.quick, device=args.device, gpu=_gpu_visible(args.device), extra=tuple(extra))
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    records = []
    for family, runs in selected.items():
        records += run_family(family, runs, ctx, args.time_limit, args.dry_run)
    if not args.dry_run:
        with open(out / "suite.jsonl", "a") as fh:
            for r in records:
                fh.write(json.dumps({**r, "quick": args.quick, "time": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    counts = {s: sum(r["status"] == s for r in records) for s in dict.fromkeys(r["status"] for r in records)}
    print("[suite] " + ", ".join(f"{n} {s}" for s, n in counts.items()) + f"; output in {out}")
    return 1 if counts.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
