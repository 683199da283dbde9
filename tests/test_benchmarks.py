"""The benchmark scripts run end to end on the CPU (tiny shapes, --quick) and write their reports.

CPU timings are meaningless; this checks the plumbing: the presets feed the scripts, every row
carries a PASS/FAIL/SKIP Check, FAIL voids TFLOPS, the markdown has its header and score table,
the PNG exists exactly when matplotlib is importable, and the reports land where ``--out``,
``--out-dir`` or ``$TURBO_BENCH_OUT`` say. Each script runs in a subprocess (as users run it), with
the env vars that would pin a backend removed. benchmarks/suite.py, which runs the scripts by
family, is checked here too.
"""
from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cpu_caps import cpu_scaled_mm_takes

from turbo_dispatch.low_precision import ScalingGranularity

REPO = Path(__file__).resolve().parent.parent
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMUS_TURBO_") and k != "TURBO_BENCH_OUT"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run(script: str, args: list[str], out_dir: Path, how: str = "--out") -> list[dict]:
    """Runs ``script`` --quick on the CPU with its reports sent to ``out_dir`` by ``how``: the
    ``--out`` or ``--out-dir`` option, or ``env`` ($TURBO_BENCH_OUT)."""
    env = _env()
    cmd = [sys.executable, str(REPO / "benchmarks" / script), "--quick", "--device", "cpu", *args]
    if how == "env":
        env["TURBO_BENCH_OUT"] = str(out_dir)
    else:
        cmd += [how, str(out_dir)]
    # Generous: a loaded 2-core machine runs the model bench's smoke (every config and variant) slowly.
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    csvs = list(out_dir.glob("cpu_*.csv"))
    mds = list(out_dir.glob("cpu_*.md"))
    assert len(csvs) == 1 and len(mds) == 1, proc.stdout
    text = mds[0].read_text()
    assert "CPU smoke run: the timings below are meaningless" in text
    assert "## Score" in text and "torch " in text
    assert (len(list(out_dir.glob("cpu_*.png"))) == 1) == HAS_MPL
    if not HAS_MPL:
        assert "matplotlib is not installed" in proc.stdout
    with open(csvs[0]) as fh:
        rows = list(csv.DictReader(fh))
    assert rows and {"check", "snr_db", "fwd_tflops", "step_tflops", "step_host_ms",
                     "ratio_vs_best_peer"} <= set(rows[0])
    for r in rows:
        assert r["check"] in ("PASS", "FAIL", "SKIP")
        if r["check"] != "PASS":
            assert r["fwd_tflops"] == "" and r["step_tflops"] == "" and r["ratio_vs_best_peer"] == ""
    return rows


@pytest.mark.parametrize("args,how", [(["--dtype", "bf16"], "--out"),
                                      (["--dtype", "fp8", "--granularity", "rowwise"], "--out-dir")])
def test_bench_gemm_cpu_smoke(tmp_path, args, how):
    if "rowwise" in args and not cpu_scaled_mm_takes(ScalingGranularity.ROWWISE):
        pytest.skip("the rowwise peer is torch._scaled_mm, which this torch's CPU path runs per-tensor only")
    rows = _run("bench_gemm.py", args, tmp_path, how)
    peers = [r for r in rows if r["peer"] == "yes"]
    assert peers and all(r["check"] == "PASS" and r["ratio_vs_best_peer"] for r in peers)
    assert any(r["backend"] == "turbo TORCH" and r["check"] == "PASS" for r in rows)
    assert {r["shape"].split("/")[1] for r in rows} >= {"qkv", "o_proj", "gate_up", "down"}
    if "fp8" in args:
        # Variants are timed in a rotated order per shape; the fp8-vs-bf16 ratio must still be
        # taken against the bf16 row of the same shape, never against another fp8 row.
        for shape in {r["shape"] for r in rows if r["op"].startswith("gemm_fp8")}:
            same = [r for r in rows if r["shape"] == shape and r["op"].startswith("gemm_fp8")]
            bf16 = [r for r in same if r["backend"] == "bf16 torch.matmul"]
            assert len(bf16) == 1 and not bf16[0]["vs_bf16_step"]
            assert all(r["vs_bf16_step"] for r in same if r is not bf16[0] and r["check"] == "PASS")


def test_bench_gemm_blockwise_cpu_smoke(tmp_path):
    """GEMM only on pre-quantised operands: the dispatched op's rows (default and autotuned) pass
    and are timed; F.scaled_mm says why it did not run on a CPU."""
    rows = _run("bench_gemm.py", ["--dtype", "fp8", "--granularity", "blockwise"], tmp_path, "env")
    gemm_rows = [r for r in rows if r["op"] == "gemm_fp8_blockwise_gemm_only"]
    for backend in ("turbo TORCH", "turbo autotune"):
        mine = [r for r in gemm_rows if r["backend"] == backend]
        assert mine and all(r["check"] == "PASS" and float(r["fwd_ms"]) > 0 for r in mine), mine
    assert all("NVIDIA GPU" in r["note"] for r in gemm_rows if r["backend"] == "F.scaled_mm blockwise")


CUSTOM = "8x16x256, 24X40X128,8x16x256"  # a repeat, upper-case 'X' and a space: all accepted


# rowwise runs the tensorwise code path (run_dense) with another config: not repeated here
@pytest.mark.parametrize("mode", [["--dtype", "bf16"], ["--dtype", "fp8", "--granularity", "tensorwise"],
                                  ["--dtype", "fp8", "--granularity", "blockwise"]])
def test_bench_gemm_custom_shapes_cpu_smoke(tmp_path, mode):
    """``--shapes`` replaces the presets in every code path (deduplicated, named custom/M/N/K), and
    the report's "lowest shape" line names the autotuned row's lowest ratio vs the peer and its
    shape."""
    rows = _run("bench_gemm.py", [*mode, "--shapes", CUSTOM, "--mb", "2"], tmp_path)
    timed = [r for r in rows if r["op"] != "linear_peak_memory"]
    assert [r["shape"] for r in timed if r["backend"] == "turbo autotune"] == ["custom/M8/N16/K256",
                                                                               "custom/M24/N40/K128"]
    assert {(r["m"], r["n"], r["k"]) for r in timed} == {("8", "16", "256"), ("24", "40", "128")}
    assert all(r["mb"] == "" and r["model"] == "custom" for r in timed)
    assert any(r["backend"] == "turbo autotune" and r["check"] == "PASS" for r in timed)
    text = next(tmp_path.glob("cpu_*.md")).read_text()
    assert "- shapes: --shapes " + CUSTOM + "; 2 unique shapes (--mb ignored)" in text
    lowest = [line for line in text.splitlines() if line.startswith("- lowest shape, ")]
    assert len(lowest) == 1 and " turbo autotune vs " in lowest[0], lowest
    auto = [r for r in timed if r["backend"] == "turbo autotune" and r["ratio_vs_best_peer"]]
    if "blockwise" in mode:  # F.scaled_mm blockwise needs an NVIDIA GPU: no peer, no ratio
        assert not auto and "none scored (0/2 shapes)" in lowest[0]
    else:
        low = min(auto, key=lambda r: float(r["ratio_vs_best_peer"]))
        assert f"x on {low['shape']} (step); 2/2 shapes scored, geomean " in lowest[0]
        assert ("vs torch.matmul:" if "bf16" in mode else "vs torch fp8 recipe") in lowest[0]


def test_bench_gemm_shapes_parsing():
    """``--shapes`` items: MxNxK or a named set, mixed freely, deduplicated in the order given;
    bad text exits naming ``--shapes`` and the bad item."""
    G = _bench_module("bench_gemm")
    shapes = G.custom_shapes("3000x5120x3584 ,unseen,UNSEEN,3072x8192x3584")
    assert shapes[0].label == "custom/M3000/N5120/K3584" and shapes[0].models == ["custom"]
    assert (shapes[0].m, shapes[0].n, shapes[0].k) == (3000, 5120, 3584)
    # 3072x8192x3584 is unseen's gemma-2-9b qkv: measured once, under its first name
    assert [s.label for s in shapes[1:]] == [f"unseen/{m}/{layer}/M{mm}" for m, layer, mm, _, _ in G.UNSEEN]
    for bad, says in (("8x16", "'8x16' is not MxNxK (three integers joined by 'x') or one of: unseen"),
                      ("8x16x32,8xAx32", "'8xAx32' is not MxNxK"),
                      ("8x16x32x4", "'8x16x32x4' is not MxNxK"), ("8x0x32", "'8x0x32' needs positive sizes"),
                      ("unsen", "'unsen' is not MxNxK"), (" , ", "no shape in ' , '")):
        with pytest.raises(SystemExit) as err:
            G.custom_shapes(bad)
        assert str(err.value).startswith("--shapes: ") and says in str(err.value), (bad, err.value)
    H = _harness()
    assert H.parse_shapes("4x16x32x256", "GxTxNxK") == [(4, 16, 32, 256)]
    with pytest.raises(SystemExit, match=r"--shapes: '4x16x32' is not GxTxNxK \(four integers"):
        H.parse_shapes("4x16x32", "GxTxNxK")


def test_bench_gemm_unseen_shapes_are_new():
    """``--shapes unseen``: 8 LLM layers whose M, (N, K) pair and step keys (fwd, dgrad, wgrad) are
    in no preset and no shipped tuned database, from models the module docstring names."""
    from turbo_dispatch.presets import MODELS, dense_linear_shapes, moe_grouped_shapes

    G = _bench_module("bench_gemm")
    unseen = G.custom_shapes("unseen")
    assert len(unseen) == 8 == len(G.UNSEEN) and len({(s.m, s.n, s.k) for s in unseen}) == 8
    def step_keys(m, n, k):  # (M, N, K) of the forward, dgrad and wgrad GEMMs
        return {(m, n, k), (m, k, n), (n, k, m)}

    preset_m, preset_nk, preset_keys = set(), set(), set()
    for model in MODELS.values():
        for mb in (1, 2, 4, 8):
            for s in dense_linear_shapes(model, mb):
                preset_m.add(s.m)
                preset_nk.add((s.n, s.k))
                preset_keys |= step_keys(s.m, s.n, s.k)
        if model.is_moe:
            preset_nk |= {(s.n, s.k) for s in moe_grouped_shapes(model)}
    tuned = set()
    for path in (REPO / "turbo_dispatch" / "tuned").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("type") == "result" and entry["op"] in ("gemm", "gemm_fp8"):
                tuned.add((entry["key"]["m"], entry["key"]["n"], entry["key"]["k"]))
    assert tuned, "no shipped tuned gemm entry found: the check below would be empty"
    for s in unseen:
        assert s.m not in preset_m and (s.n, s.k) not in preset_nk, s
        assert not step_keys(s.m, s.n, s.k) & (tuned | preset_keys), s
    for name in ("Gemma-2-9B", "Phi-3-medium", "Yi-34B", "Falcon-40B"):
        assert name in G.__doc__
    assert {s.models[0] for s in unseen} == {"gemma-2-9b", "phi-3-medium", "yi-34b", "falcon-40b"}
    assert not {s.models[0] for s in unseen} & set(MODELS)


def test_summary_names_the_lowest_ratio():
    H = _harness()
    rows = []
    for shape, ratio in (("a", 1.2), ("b", 0.9), ("c", None)):
        row = H.Row(op="g", shape=shape, backend="mine", flops=1e9, step_ms=1.0,
                    check=H.Check(True, 99.0, 0.0, []))
        row.ratio, row.ratio_on = ratio, "step" if ratio else ""
        rows.append(row)
    (s,) = H.summary(rows)
    assert (s["lowest_ratio"], s["lowest_shape"], s["lowest_on"], s["shapes"]) == (0.9, "b", "step", "2/3")
    (s,) = H.summary(rows[2:])
    assert (s["lowest_ratio"], s["lowest_shape"]) == (None, "")


def test_bench_grouped_gemm_cpu_smoke(tmp_path):
    rows = _run("bench_grouped_gemm.py", ["--routings", "balanced,empty", "--models", "tiny"], tmp_path)
    assert {r["routing"] for r in rows} == {"balanced", "empty"}
    assert any(r["empty_groups"] not in ("", "0") for r in rows)
    assert all(r["check"] == "PASS" for r in rows if r["backend"] in ("turbo TORCH", "torch per-group mm loop"))
    text = next(tmp_path.glob("cpu_*.md")).read_text()
    by_routing = text.split("## Score by routing", 1)[1].split("## All rows", 1)[0]
    assert "| grouped_gemm | balanced | turbo TORCH |" in by_routing
    assert "| grouped_gemm | empty | turbo TORCH |" in by_routing


def test_bench_grouped_gemm_custom_shapes_wall_time_and_profile(tmp_path):
    """``--shapes`` runs shapes no preset has; every timed step gets its wall time in a loop
    (``step_wall_ms``, and ``vs_bf16_wall`` for fp8 against the bf16 step); ``--profile`` writes
    one cProfile + torch.profiler file per turbo variant."""
    rows = _run("bench_grouped_gemm.py", ["--dtype", "fp8", "--granularity", "blockwise", "--backends", "TORCH",
                                          "--shapes", "4x16x32x256", "--routings", "balanced", "--wall-iters", "2",
                                          "--profile", "1"], tmp_path)
    assert {r["shape"] for r in rows} == {"custom/G4xT16/N32/K256/balanced"} and {r["m"] for r in rows} == {"64"}
    timed = [r for r in rows if r["step_ms"]]
    assert timed and all(float(r["step_wall_ms"]) > 0 for r in timed)
    assert all(float(r["vs_bf16_wall"]) > 0 for r in timed if r["backend"].startswith("turbo"))
    profiles = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert profiles == ["custom_G4xT16_N32_K256_balanced_turbo_TORCH.txt",
                        "custom_G4xT16_N32_K256_balanced_turbo_autotune.txt"]
    text = (tmp_path / "profiles" / profiles[0]).read_text()
    assert "forward + backward" in text and "Ordered by: internal time" in text
    bad = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_grouped_gemm.py"), "--device", "cpu",
                          "--shapes", "4x16x32"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--shapes: '4x16x32' is not GxTxNxK" in bad.stderr


def test_bench_attention_varlen_rows_and_profile(tmp_path):
    """The varlen case's backends pass their gate and are timed; ``--profile`` writes one
    cProfile + torch.profiler file per backend that passed."""
    rows = _run("bench_attention.py", ["--only", "varlen", "--profile", "1"], tmp_path)
    passed = [r for r in rows if r["check"] == "PASS"]
    assert passed and all(float(r["step_ms"]) > 0 for r in passed)
    profiles = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert len(profiles) == len(passed) and all(p.startswith("varlen_") for p in profiles)
    text = (tmp_path / "profiles" / profiles[0]).read_text()
    assert "forward + backward" in text and "Ordered by: internal time" in text


def test_probe_step_host_cpu_smoke():
    """benchmarks/probes/probe_step_host.py on the CPU backends: a row per piece of the planned fp8
    step, each with a positive host time, and their sum."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "probes" / "probe_step_host.py"), "--device",
                           "cpu", "--groups", "2", "--tokens-per-group", "32", "--n", "128", "--k", "128",
                           "--backend", "auto", "--calls", "2", "--rounds", "1", "--cprofile", "3"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    alone, inside = proc.stdout.split("\nInside the whole step")
    inside, profiled = inside.split("\ncProfile, the step, all its threads (2 steps)")
    assert len([line for line in profiled.splitlines() if line.startswith("| ") and "---" not in line]) == 4
    rows = [line.split("|") for line in alone.splitlines() if line.startswith("| ") and "---" not in line]
    timed = {r[1].strip(): float(r[2]) for r in rows[1:] if not r[1].strip().startswith("sum")}
    assert sum(1 for label in timed if label.startswith("plan: ")) == 6 and all(v > 0 for v in timed.values())
    assert "whole step (forward + autograd.grad)" in timed and "| sum of the plan's six pieces |" in proc.stdout
    # Each piece timed where the step calls it, inside the layers that call it.
    split = {r[2].strip(): (int(r[1]), float(r[3])) for r in (line.split("|") for line in inside.splitlines()[3:])
             if len(r) == 5}
    pieces = [label for label in split if label.startswith("plan: ")]
    assert len(pieces) == 6 and all(split[label][1] > 0 for label in pieces)
    assert split["whole step"][1] >= split["op call: forward, autograd.Function.apply included"][1] > 0
    assert split["GroupedFp8Function.backward"][0] == 1 and split["plan: dgrad GEMM"][0] > 1


def test_bench_fused_producers_cpu_smoke(tmp_path):
    """Every case has a fused row (SKIP on a CPU without the interpreter, saying why), a checked
    unfused row and a copy row, each timed one with its GB/s and the fraction of the copy's; the
    RoPE case has its op's, the torch peer's and the copy's rows, forward and backward, checked."""
    rows = _run("bench_fused_producers.py", ["--recipes", "rowwise,blockwise"], tmp_path)
    shapes = {r["shape"] for r in rows}
    assert shapes == {f"llama3.1-8b/{op}/{recipe}" for op in ("rms_norm", "swiglu") for recipe in ("rowwise",
                                                                                                 "blockwise")} | {
        "llama3.1-8b/rope"}
    rope = [r for r in rows if r["shape"] == "llama3.1-8b/rope"]
    assert sorted((r["op"], r["backend"]) for r in rope) == sorted(
        (f"rope_{d}", b) for d in ("fwd", "bwd") for b in ("turbo split_qkv_rotary_emb", "torch ops", "torch copy"))
    assert all(r["check"] == "PASS" and float(r["gb_s"]) > 0 for r in rope)
    assert all(float(r["snr_db"]) >= 40 for r in rope if r["backend"] != "torch copy")
    for r in (r for r in rows if r not in rope):
        if r["backend"] == "turbo fused":
            assert r["check"] == "SKIP" and "fused kernel not run" in r["note"]
        else:
            assert r["check"] == "PASS" and float(r["gb_s"]) > 0
        if r["backend"] == "turbo unfused":
            assert float(r["of_copy"]) > 0 and float(r["snr_db"]) >= 25


def test_bench_model_cpu_smoke(tmp_path):
    """Every config (dense, TP widths, MoE) builds the same model from torch and from the library
    with one state_dict: every row passes its check against the float64 reference, fp32 turbo
    rows give the torch peer's losses, the fp8 ones stay within the loss target; the per-config
    table leads the markdown and the autotuned rows filled a fresh DB; ``--profile`` wrote one
    profile per config and variant. The suite's ``model`` family runs one config per run."""
    rows = _run("bench_model.py", ["--variants", "torch,bf16,bf16:tune,fp8-rowwise:tune,fp8-blockwise:unfused",
                                   "--profile", "1"], tmp_path)
    profiles = sorted(p.name for p in (tmp_path / "profiles").glob("*.txt"))
    assert len(profiles) == 15 and "llama3_1_8b_turbo_fp8_rowwise_autotune.txt" in profiles, profiles
    assert "forward + backward" in (tmp_path / "profiles" / "llama3_1_8b_torch_float32.txt").read_text()
    assert {r["op"] for r in rows} == {"llama3.1-8b", "llama3.1-70b-tp8", "deepseek-v3-ep8"}
    assert all(r["check"] == "PASS" and r["step_ms"] and r["train_step_ms"] for r in rows), rows
    for op in {r["op"] for r in rows}:
        mine = {r["backend"]: r for r in rows if r["op"] == op}
        assert list(mine) == ["torch float32", "turbo float32", "turbo float32 autotune", "turbo fp8 rowwise autotune",
                              "turbo fp8 blockwise unfused"]
        assert mine["torch float32"]["peer"] == "yes" and float(mine["torch float32"]["ratio_vs_best_peer"]) == 1.0
        assert float(mine["turbo float32"]["loss_dev_pct"]) < 1e-3
        assert mine["turbo float32"]["loss_ok"] == "yes" and float(mine["turbo float32"]["loss_tol_pct"]) >= 1.0
        assert float(mine["turbo float32"]["loss_noise_pct"]) < 1e-3  # the fp32 replay: split-K sums, same curve
        assert float(mine["turbo fp8 rowwise autotune"]["loss_dev_pct"]) < 1.0
        # the blocks alone timed too (the layer step), their ratio to the peer's
        assert all(float(r["layers_step_ms"]) > 0 for r in mine.values())
        assert float(mine["torch float32"]["layers_ratio"]) == 1.0
        assert all(float(r["layers_ratio"]) > 0 for r in mine.values())
    text = next(tmp_path.glob("cpu_*.md")).read_text()
    assert text.index("### deepseek-v3-ep8") < text.index("## Score")
    assert '"type": "result"' in (tmp_path / "model_quick_tuning.jsonl").read_text()
    listed = dict(line.split("\t") for line in _suite("--list").stdout.splitlines())
    assert listed["model"].split(",") == ["model_llama3.1-8b", "model_llama3.1-70b-tp8", "model_deepseek-v3-ep8"]
    dry = _suite("--family", "model", "--device", "cuda", "--dry-run", "--only", "model_deepseek-v3-ep8")
    assert "bench_model.py --config deepseek-v3-ep8 --tune-budget-ms 300 --device cuda" in dry.stdout


def test_bench_model_check_sees_every_parameter(monkeypatch, tmp_path):
    """The first-step check compares every parameter's gradient: a build whose norm weight gets
    a wrong gradient, or none, FAILs naming it, where the library's build passes; the replay's
    SplitKLinear is nn.Linear summed in another order."""
    import torch
    from types import SimpleNamespace
    B = _bench_module("bench_model")
    c = B.cpu_config(B.CONFIGS["deepseek-v3-ep8"])
    cpu, f32 = torch.device("cpu"), torch.float32
    torch.manual_seed(0)
    state = B.build_model(c, B.TORCH_KIT, None).state_dict()
    batches = [B.BigramCorpus(c.vocab, length=4096).batch(c.batch, c.seq_len, torch.Generator().manual_seed(1), cpu)]
    ref = B.reference(c, state, batches[0], cpu, torch.float64)
    assert {n for n, *_ in ref.params} <= set(ref.tensors) and "blocks.1.mlp_norm.weight" in ref.tensors
    load = B.load_model

    def run(defect=None):
        def loaded(*a):
            model = load(*a)
            if defect is not None:
                defect(dict(model.named_parameters())["blocks.1.mlp_norm.weight"])
            return model
        monkeypatch.setattr(B, "load_model", loaded)
        m = B.train_variant(c, B.parse_variant("bf16"), state, batches, ref, {}, SimpleNamespace(lr=3e-4), cpu, f32,
                            tmp_path / "db.jsonl")
        return m.check
    assert run().ok
    doubled = run(lambda w: w.register_hook(lambda g: 2 * g))
    assert not doubled.ok and any(r.startswith("blocks.1.mlp_norm.weight: rel err") for r in doubled.reasons)
    frozen = run(lambda w: w.requires_grad_(False))
    assert not frozen.ok and "blocks.1.mlp_norm.weight: no gradient" in frozen.reasons
    assert any("differ from the torch model's: blocks.1.mlp_norm.weight" in r for r in frozen.reasons)
    linear, split = torch.nn.Linear(37, 5, bias=False), B.SplitKLinear(37, 5, bias=False)
    split.load_state_dict(linear.state_dict())
    x = torch.randn(3, 4, 37)
    torch.testing.assert_close(split(x), linear(x), rtol=1e-5, atol=1e-6)


def _moe_rows(out_dir: Path, launcher: list[str], *args: str) -> tuple[list[dict], str]:
    """benchmarks/bench_moe.py --quick over 2 gloo processes; its CSV rows and markdown."""
    cmd = [*launcher, str(REPO / "benchmarks" / "bench_moe.py"), "--quick", "--device", "cpu", "--out", str(out_dir),
           *args]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out_dir.glob("cpu_*_moe.csv")
    with open(path) as fh:
        return list(csv.DictReader(fh)), path.with_suffix(".md").read_text()


def test_bench_moe_cpu_smoke(tmp_path):
    """Spawned over 2 gloo processes: every registered backend has a row per configuration (PASS
    with times, or SKIP saying why), the no-sync round trip passes, the raw all_to_all_single row
    passes, the peer copy says why a CPU run has none; the header names the device and the date."""
    from turbo_dispatch.registry import get_registry

    rows, text = _moe_rows(tmp_path, [sys.executable], "--models", "deepseek-v3,mixtral")
    configs = {(r["model"], r["routing"], r["payload"]) for r in rows}
    assert len(configs) == 8 and {r["tokens"] for r in rows} == {"16"} and {r["world"] for r in rows} == {"2"}
    for config in configs:
        mine = {r["backend"]: r for r in rows if (r["model"], r["routing"], r["payload"]) == config}
        for entry in get_registry().backends("moe_dispatch_combine"):
            for label in (f"turbo {entry.name}", f"turbo {entry.name} no-sync"):
                assert mine[label]["check"] in ("PASS", "SKIP"), mine[label]
                assert mine[label]["check"] == "PASS" or mine[label]["note"], mine[label]
        torch_row, no_sync = mine["turbo TORCH"], mine["turbo TORCH no-sync"]
        assert torch_row["check"] == "PASS" and float(torch_row["dispatch_ms"]) > 0 and torch_row["dispatch_vs_a2a"]
        assert bool(torch_row["combine_ms"]) == (config[2] == "bf16")
        assert no_sync["check"] == "PASS" and float(no_sync["round_trip_us"]) > 0 and int(no_sync["worst_tokens"]) >= 1
        assert mine["torch all_to_all_single"]["check"] == "PASS" and float(mine["torch all_to_all_single"]["recv_mb"])
        p2p = mine["p2p copy to next rank"]
        assert p2p["check"] == "SKIP" and "no GPU peers" in p2p["note"]
    assert text.startswith("# MoE dispatch / combine: CPU x 2, 20") and "timings below are meaningless" in text
    assert "| deepseek-v3 | 16 | skewed | fp8 | turbo TORCH | PASS |" in text


def test_bench_moe_under_torchrun(tmp_path):
    """The torchrun launch (what qa/multi_gpu.sh runs): ranks from the environment, one report."""
    rows, _ = _moe_rows(tmp_path, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc_per_node", "2"],
                        "--models", "mixtral", "--routings", "skewed", "--payloads", "bf16", "--backends", "torch")
    assert [(r["backend"], r["check"]) for r in rows] == [
        ("turbo TORCH", "PASS"), ("turbo TORCH no-sync", "PASS"), ("torch all_to_all_single", "PASS"),
        ("p2p copy to next rank", "SKIP")]


def test_bench_moe_layer_cpu_smoke(tmp_path):
    """The suite's quick moe_layer run: 2 spawned gloo processes, a tiny layer. The plain-torch EP
    layer and train_moe's MoE (float32, fp8 rowwise, fp8 blockwise) on one set of weights each pass
    the check against the float64 plain-torch layer on its routing and are timed; the per-config
    table leads the markdown, and the issue's target is reported as not measured by a CPU run."""
    rows = _run("bench_moe_layer.py", [], tmp_path)
    assert [(r["backend"], r["check"]) for r in rows] == [
        ("torch float32", "PASS"), ("turbo float32", "PASS"), ("turbo fp8 rowwise", "PASS"),
        ("turbo fp8 blockwise", "PASS")]
    assert {(r["shape"], r["world"], r["experts_per_rank"]) for r in rows} == {("EP2 T16 H64 E8 k2 F32", "2", "4")}
    for r in rows:
        assert float(r["step_ms"]) > 0 and float(r["fwd_ms"]) > 0 and int(r["tokens_per_s"]) > 0, r
    mine = {r["backend"]: r for r in rows}
    assert mine["torch float32"]["peer"] == "yes" and float(mine["torch float32"]["ratio_vs_best_peer"]) == 1.0
    assert float(mine["turbo float32"]["rel_err"]) < 1e-5
    assert float(mine["turbo fp8 blockwise"]["snr_db"]) >= 15 and float(mine["turbo fp8 rowwise"]["snr_db"]) >= 15
    text = next(tmp_path.glob("cpu_*_moe_layer_quick.md")).read_text()
    assert text.index("### EP2 T16 H64 E8 k2 F32") < text.index("## Score") and "2 ranks over gloo" in text
    assert "4096 tokens per rank, deepseek-v3 widths: not measured by this run" in text


def test_summary_by_a_column_scores_each_value_apart():
    H = _harness()
    rows = []
    for routing, ratio in (("balanced", 2.0), ("balanced", 0.5), ("empty", 0.25)):
        row = H.Row(op="g", shape=f"{routing}{ratio}", backend="mine", flops=1e9, fwd_ms=1.0,
                    check=H.Check(True, 99.0, 0.0, []), extra={"routing": routing})
        row.ratio = ratio
        rows.append(row)
    whole = H.summary(rows)
    parts = {s["routing"]: s for s in H.summary(rows, by="routing")}
    assert len(whole) == 1 and abs(whole[0]["geomean_ratio"] - 0.25 ** (1 / 3)) < 1e-12
    assert abs(parts["balanced"]["geomean_ratio"] - 1.0) < 1e-12 and parts["balanced"]["shapes"] == "2/2"
    assert abs(parts["empty"]["geomean_ratio"] - 0.25) < 1e-12 and parts["empty"]["shapes"] == "1/1"


def _bench_module(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _harness():
    return _bench_module("harness")


def test_time_interleaved_takes_turns():
    """Every function gets a turn (its setup, one untimed call, per_turn timed calls) before any
    gets its next, turns starting from a different function each round; warm-ups run first."""
    import torch
    H = _harness()
    log: list[str] = []
    timer = H.Timer(torch.device("cpu"), warmup=1, min_repeats=3, max_repeats=3)
    fns = [lambda n=n: log.append(n) for n in "abc"]
    setups = [lambda n=n: log.append(n.upper()) for n in "abc"]
    times = timer.time_interleaved(fns, setups, per_turn=2)
    assert len(times) == 3 and all(t >= 0 for t in times)
    calls = "".join(log)
    # warm-ups, then round 0 (each: setup, untimed call, two timed), then round 1 from b
    assert calls == "AaBbCc" + "AaaaBbbbCccc" + "BbbbCcccAaaa", calls


def test_time_rows_times_only_passes_and_wanted_grads():
    """time_rows times forward for every PASSing row, backward and step only where the variant
    wants gradients, nothing for a FAIL or an unserved row, and runs each variant's enter first."""
    import torch
    from types import SimpleNamespace
    H = _harness()
    x = torch.randn(4, 3, requires_grad=True)
    grad = torch.randn(4, 3)
    entered: list[str] = []

    def variant(name, grads=True):
        return SimpleNamespace(fwd=lambda: x * 2.0, enter=lambda: entered.append(name), grads=grads,
                               explain=lambda: f"note {name}")

    ok, bad = H.Check(True), H.Check(False)
    rows = [H.Row(op="t", shape="s", backend=n) for n in ("p", "q", "f", "u")]
    rows[0].check, rows[1].check, rows[2].check = ok, ok, bad  # rows[3]: not served (no check)
    vs = [variant("p"), variant("q", grads=False), variant("f"), variant("u")]
    timer = H.Timer(torch.device("cpu"), warmup=1, min_repeats=2, max_repeats=2)
    timed = []
    real = timer.time_interleaved
    timer.time_interleaved = lambda fns, setups: timed.append(len(fns)) or real(fns, setups)
    timer.time_ms = lambda *a, **k: pytest.fail("time_rows timed a variant on its own, not in turns")
    H.time_rows(list(zip(rows, vs)), timer, (x,), grad, wants_grad=lambda v: v.grads)
    assert timed == [2, 1, 1]  # forward of both PASSes, then backward and step of the one with grads
    assert rows[0].fwd_ms is not None and rows[0].bwd_ms is not None and rows[0].step_ms is not None
    assert rows[1].fwd_ms is not None and rows[1].bwd_ms is None and rows[1].step_ms is None
    assert all(r.fwd_ms is None and r.step_ms is None for r in rows[2:])
    assert [r.note for r in rows] == ["note p", "note q", "note f", "note u"]
    assert set(entered) == {"p", "q", "f", "u"}


def test_time_interleaved_records_host_time_per_fn():
    """time_interleaved and time_ms leave each function's host issue time in last_host_ms, in the
    order of the functions: a call that sleeps 10 ms on the host shows it, a trivial one does not."""
    import time
    import torch
    H = _harness()
    timer = H.Timer(torch.device("cpu"), warmup=1, min_repeats=2, max_repeats=2)
    times = timer.time_interleaved([lambda: None, lambda: time.sleep(0.01)])
    assert len(times) == 2 and len(timer.last_host_ms) == 2
    quick, slow = timer.last_host_ms
    assert slow >= 9.5 and quick < 5.0
    timer.time_ms(lambda: time.sleep(0.01))
    assert len(timer.last_host_ms) == 1 and timer.last_host_ms[0] >= 9.5


def test_time_rows_sets_step_host_ms():
    """time_rows stores the step's host time on rows that time a step, the forward's on rows that
    time only the forward, none on rows not timed; the CSV carries the column after step_tflops."""
    import time
    import torch
    from types import SimpleNamespace
    H = _harness()
    x = torch.randn(4, 3, requires_grad=True)
    grad = torch.randn(4, 3)

    class SlowBackward(torch.autograd.Function):
        """x * 2 with a backward that takes 4 ms of host time: only a step's host time has it."""

        @staticmethod
        def forward(ctx, t):
            return t * 2.0

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.004)
            return g * 2.0

    vs = [SimpleNamespace(fwd=lambda: SlowBackward.apply(x), grads=True),
          SimpleNamespace(fwd=lambda: x * 2.0, grads=False), SimpleNamespace(fwd=lambda: x * 2.0, grads=True)]
    rows = [H.Row(op="t", shape="s", backend=n) for n in ("step", "fwd", "fail")]
    rows[0].check, rows[1].check, rows[2].check = H.Check(True), H.Check(True), H.Check(False)
    timer = H.Timer(torch.device("cpu"), warmup=1, min_repeats=2, max_repeats=2)
    H.time_rows(list(zip(rows, vs)), timer, (x,), grad, wants_grad=lambda v: v.grads)
    step, fwd, fail = rows
    assert step.step_ms is not None and step.step_host_ms is not None and step.step_host_ms >= 3.5
    assert fwd.step_ms is None and fwd.step_host_ms is not None and fwd.step_host_ms < 3.5
    assert fail.step_host_ms is None
    cols = H.BASE_COLUMNS
    assert cols.index("step_host_ms") == cols.index("step_tflops") + 1
    assert step.as_dict()["step_host_ms"] == round(step.step_host_ms, 4) and fail.as_dict()["step_host_ms"] == ""


def test_fp8_grouped_bound_arithmetic(tmp_path):
    """The bound tool's step time is the forward and dgrad at one rate, the wgrad at its own (each
    GEMM at least its operand and output bytes), plus the quantisation bytes (4 per x and
    gradient element, 2 + copies per weight element) at the given bandwidth."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import fp8_grouped_bound as B
    finally:
        sys.path.pop(0)
    m, n, k, g = 4096, 2048, 1024, 4
    flops_ms = 1e3 * 3 * 2.0 * m * n * k / 1e15
    bytes_ms = 1e3 * (4.0 * m * k + 4.0 * m * n + 4.0 * g * n * k) / 2e12
    assert abs(B.step_bound_ms(m, n, k, g, 1000.0, 2.0) - (flops_ms + bytes_ms)) < 1e-12
    one_copy_ms = bytes_ms - 1e3 * g * n * k / 2e12
    assert abs(B.step_bound_ms(m, n, k, g, 1000.0, 2.0, weight_copies=1) - (flops_ms + one_copy_ms)) < 1e-12
    slow_wgrad_ms = flops_ms * 2 / 3 + 1e3 * 2.0 * m * n * k / 5e14
    assert abs(B.step_bound_ms(m, n, k, g, 1000.0, 2.0, wgrad_tflops=500.0) - (slow_wgrad_ms + bytes_ms)) < 1e-12
    # 16 tokens per group: every GEMM is bound by its bytes (fp8 operands in, bf16 output out)
    m2, w2 = 64, g * n * k
    gemm_bytes = (m2 * k + w2 + 2 * m2 * n) + (m2 * n + w2 + 2 * m2 * k) + (m2 * n + m2 * k + 2 * w2)
    quant_bytes = 4.0 * m2 * k + 4.0 * m2 * n + 4.0 * w2
    assert abs(B.step_bound_ms(m2, n, k, g, 1000.0, 2.0) - 1e3 * (gemm_bytes + quant_bytes) / 2e12) < 1e-12
    path = tmp_path / "r.csv"
    path.write_text("shape,m,n,k,groups,backend,step_ms\n"
                    f"s,{m},{n},{k},{g},turbo autotune,1.0\n"
                    f"s,{m},{n},{k},{g},bf16 torch._grouped_mm,0.8\n"
                    f"t,{m},{n},{k},{g},turbo autotune,1.0\n")  # no bf16 row: skipped
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    (only,) = B.bounds(rows, 1000.0, 2.0, "turbo autotune", "bf16 ")
    assert only["shape"] == "s" and abs(only["measured_ratio"] - 0.8) < 1e-12
    assert abs(only["bound_ratio"] - 0.8 / (flops_ms + bytes_ms)) < 1e-12


def test_reports_default_to_the_ignored_bench_out_folder(monkeypatch):
    """Without --out the reports go to $TURBO_BENCH_OUT, else bench-out/ at the repository root,
    which git ignores: results are run artifacts, not files of the tree."""
    H = _harness()
    monkeypatch.delenv("TURBO_BENCH_OUT", raising=False)
    assert H.resolve_out_dir() == REPO / "bench-out" and H.resolve_out_dir("x") == Path("x")
    monkeypatch.setenv("TURBO_BENCH_OUT", str(REPO / "elsewhere"))
    assert H.resolve_out_dir() == REPO / "elsewhere" and H.resolve_out_dir("x") == Path("x")
    assert "/bench-out/" in (REPO / ".gitignore").read_text().splitlines()


def _suite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "suite.py"), *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)


def test_suite_lists_every_family():
    proc = _suite("--list")
    assert proc.returncode == 0, proc.stderr
    families = dict(line.split("\t") for line in proc.stdout.splitlines())
    assert set(families) >= {"gemm", "gemm_fp8", "grouped_gemm", "grouped_gemm_fp8", "dispatch_overhead",
                             "blaslt_switch"}
    assert families["gemm_fp8"].split(",") == ["fp8_tensorwise_gemm", "fp8_rowwise_gemm", "fp8_blockwise_gemm"]
    # the checks on shapes no preset has run with their families
    assert families["gemm"].split(",") == ["bf16_gemm", "bf16_gemm_unseen"]
    assert "fp8_blockwise_grouped_gemm_new_shapes" in families["grouped_gemm_fp8"].split(",")


def test_suite_dry_run_names_each_command_or_why_it_cannot_run(tmp_path):
    """On a CPU, --quick runs every bench's smoke form once (the grouped sweeps share one) and
    names the families that need a GPU; without --quick the benches need one; on a GPU the full
    commands carry the published sizes, --only picks runs and arguments after -- reach them."""
    quick = _suite("--family", "all", "--quick", "--device", "cpu", "--dry-run", "--out", str(tmp_path))
    assert quick.returncode == 0, quick.stderr
    out = quick.stdout
    assert f"bench_gemm.py --dtype bf16 --quick --device cpu --out {tmp_path} --name bf16_gemm_quick" in out
    assert f"bench_dispatch_overhead.py --iters 2000 --rounds 3 --device cpu --json {tmp_path}" in out
    assert "bf16_grouped_gemm_tpe4096: skipped (its quick form is bf16_grouped_gemm_tpe512's)" in out
    assert "blaslt_switch/blaslt_switch: skipped (needs a CUDA/ROCm GPU" in out
    assert "step_host/step_host_launcher_object: skipped (needs a CUDA/ROCm GPU" in out  # the probe's A/B
    assert not any(tmp_path.iterdir())  # a dry run writes nothing
    full = _suite("--family", "grouped_gemm_fp8", "--family", "dispatch_overhead", "--device", "cpu", "--dry-run")
    assert full.stdout.count("a full run needs a GPU") == 3 and "dispatch_overhead: dry-run" in full.stdout
    gpu = _suite("--family", "grouped_gemm_fp8", "--device", "cuda", "--dry-run", "--only",
                 "fp8_blockwise_grouped_gemm_ep8_tpe4096", "--", "--models", "deepseek-v3")
    assert gpu.returncode == 0 and "rowwise" not in gpu.stdout
    assert ("--dtype fp8 --granularity blockwise --ep 8 --tokens-per-expert 4096 --backends TRITON --target-ms 60 "
            "--tune-budget-ms 300 --device cuda") in gpu.stdout
    assert gpu.stdout.count("--models deepseek-v3") == 1
    unseen = _suite("--family", "gemm", "--device", "cuda", "--dry-run", "--only", "bf16_gemm_unseen")
    assert "bench_gemm.py --dtype bf16 --shapes unseen --tune-budget-ms 300 --device cuda" in unseen.stdout
    assert "bf16_gemm_unseen: skipped (its quick form is bf16_gemm's)" in out
    bad = _suite("--family", "gemm", "--only", "nothing", "--dry-run")
    assert bad.returncode == 2 and "no run named nothing" in bad.stderr


def test_suite_runs_set_their_own_environment(tmp_path):
    """A run's ``env`` reaches its process only (the A/B of a library switch is two runs), shows in
    its command line, and keeps two quick runs that differ only in it apart."""
    suite = _bench_module("suite")
    log = tmp_path / "env.log"
    code = "import os; print('SWITCH=' + os.environ.get('TURBO_SUITE_PROBE', 'unset'))"
    assert suite.execute([sys.executable, "-c", code], log, 60, (("TURBO_SUITE_PROBE", "b"),)) == (0, False)
    assert log.read_text().splitlines() == [f"$ TURBO_SUITE_PROBE=b {sys.executable} -c {code}", "SWITCH=b"]
    assert "TURBO_SUITE_PROBE" not in os.environ
    dry = _suite("--family", "attention_self_delta", "--device", "cuda", "--dry-run")
    assert dry.stdout.count("PRIMUS_TURBO_ATTN_GLUON_BWD_SELF_DELTA=1 ") == 1
    assert dry.stdout.count("PRIMUS_TURBO_ATTN_GLUON_BWD_SELF_DELTA=0 ") == 1
    runs = suite.FAMILIES["attention_self_delta"]
    ctx = suite.Context(quick=True, device="cuda", gpu=True, out=tmp_path, extra=())
    assert suite.skip_reason(runs[1], ctx, list(runs[:1])) is None


def test_suite_runs_a_family_and_records_each_run(tmp_path):
    proc = _suite("--family", "dispatch_overhead", "--family", "blaslt_switch", "--quick", "--device", "cpu",
                  "--out", str(tmp_path), "--", "--iters", "200", "--rounds", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "dispatch_overhead_quick.json").read_text())
    assert [r["case"][:3] for r in result["results"]] == ["(a)", "(b)", "(c)", "(d)"]
    assert "rounds" in (tmp_path / "dispatch_overhead_quick.log").read_text()
    records = [json.loads(line) for line in (tmp_path / "suite.jsonl").read_text().splitlines()]
    assert [(r["run"], r["status"]) for r in records] == [("dispatch_overhead", "ok"), ("blaslt_switch", "skipped")]


def test_suite_fails_a_run_whose_own_rows_fail_and_stops_one_out_of_time(tmp_path):
    """A turbo_dispatch row that failed the gate fails the run; a peer's FAIL row is only counted;
    another run's report is not read. A run past its time gets SIGTERM (the benches then write
    their partial reports)."""
    S = _bench_module("suite")
    head = "op,shape,backend,check\n"
    rows = "g,s,turbo TRITON,FAIL\ng,s,torch peer,FAIL\ng,s,turbo TORCH,PASS\n"
    (tmp_path / "cpu_2026-01-01_x.csv").write_text(head + rows)
    (tmp_path / "cpu_2026-01-01_y_x.csv").write_text(head + "g,s,turbo TRITON,FAIL\n")
    assert S.failed_rows(tmp_path, "x", 0.0) == (1, 1)
    assert S.failed_rows(tmp_path, "x", time.time() + 60) == (0, 0)  # written before the run started
    sleeper = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (print('stopped'), sys.exit(0))); "
               "print('up', flush=True); time.sleep(60)")
    t0 = time.monotonic()
    rc, limited = S.execute([sys.executable, "-c", sleeper], tmp_path / "s.log", 1.0)
    assert limited and rc in (0, -signal.SIGTERM) and time.monotonic() - t0 < 30
