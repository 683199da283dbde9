"""The step tuner (turbo_dispatch.tuning.step, ``turbo-dispatch tune --step``) on the CPU.

Fixture backends whose cost per role and config the tests set (tests/fixture_backends.py) stand
in for the GPU kernels: the tests check that the tuner finds the per-role choice that makes the
whole step fastest, never chooses a wrong kernel, stores only a confirmed gain (as step-scoped
entries that calls then resolve to), and refuses what it cannot do.
"""
import importlib
import json
from pathlib import Path

import pytest
import torch

from turbo_dispatch import GlobalBackendManager, presets
from turbo_dispatch.cli import main as cli
from turbo_dispatch.op_spec import decision_problem, get_op_spec
from turbo_dispatch.registry import get_registry, reload_registry
from turbo_dispatch.tuning import store
from turbo_dispatch.tuning import step as step_tuner
from turbo_dispatch.tuning.keys import layer_keys

HERE = Path(__file__).resolve().parent
CPU = torch.device("cpu")
PLUGINS = """
version: 1
ops:
  grouped_gemm:
    defaults: {cpu: STEADY}
    backends:
      - name: STEADY
        adapter: fixture_backends:SteadyGroupedGemm
        platforms: [cpu]
      - name: WGRAD_FAST
        adapter: fixture_backends:WgradFastGroupedGemm
        platforms: [cpu]
      - name: WRONG_FAST
        adapter: fixture_backends:WrongFastGroupedGemm
        platforms: [cpu]
"""
SHAPE = presets.GroupedShape("up_gate", 4, 64, 24, 16)
FAST = dict(candidate_s=0.05, confirm_rounds=3)


@pytest.fixture
def fixtures(tmp_path, monkeypatch):
    """STEADY (the default), WGRAD_FAST and WRONG_FAST for grouped_gemm on the CPU; the product
    TORCH backend is switched off, so the fixtures' declared costs decide every timing."""
    path = tmp_path / "plugins.yaml"
    path.write_text(PLUGINS)
    monkeypatch.setenv("PRIMUS_TURBO_EXTRA_REGISTRY", str(path))
    monkeypatch.setenv("PRIMUS_TURBO_TUNE_DB_SHIPPED", "0")
    monkeypatch.setenv("PRIMUS_TURBO_TUNE_DB", "off")
    monkeypatch.delenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", raising=False)
    monkeypatch.syspath_prepend(str(HERE))
    reload_registry()
    monkeypatch.setattr(get_registry().get("grouped_gemm", "TORCH").adapter, "supports",
                        lambda p: "switched off in this test")
    GlobalBackendManager.reset()
    yield
    monkeypatch.undo()
    reload_registry()
    GlobalBackendManager.reset()


def _layer(shape=SHAPE) -> step_tuner.Layer:
    return step_tuner.Layer("grouped_gemm", shape, torch.float32, model="test")


def _role_keys(layer) -> list:
    spec = get_op_spec(layer.op)
    return [decision_problem(spec, p._replace(platform="cpu")) for _, p in layer_keys(layer.op, layer.shape, layer.dtype)]


def _run_layer_step(layer):
    """One step of ``layer`` through the public op; the backends its three GEMMs resolved to."""
    gg = importlib.import_module("turbo_dispatch.ops.grouped_gemm_spec")  # where the ops' GEMMs resolve
    seen, resolve = [], gg.resolve

    def recording(spec, problem):
        decision = resolve(spec, problem)
        seen.append((decision.backend, decision.config, decision.source))
        return decision

    gg.resolve = recording
    try:
        step_tuner.step_fn(layer)(step_tuner._step_inputs(layer, CPU)[0])
    finally:
        gg.resolve = resolve
    return seen


def test_it_finds_the_per_role_choice_that_makes_the_step_fastest_and_stores_it(fixtures, tmp_path):
    layer = _layer()
    report, stored = step_tuner.tune_layer(layer, CPU, **FAST)
    assert report.status == "tuned", report
    winners = {r.role: r.winner for r in report.roles}
    assert winners == {"forward": "STEADY", "dgrad": "STEADY", "wgrad": "WGRAD_FAST[quick]"}
    # Every role saw WRONG_FAST fail the gate; it was never timed.
    for role in report.roles:
        assert [label for label, _ in role.rejected] == ["WRONG_FAST"], role.rejected
        assert "WRONG_FAST" not in dict(role.timings)
    # Default step 3 x 6 ms, tuned 2 x 6 ms: confirmed in turns.
    assert 1.25 < report.speedup < 1.8, report
    assert len(stored) == 3 and all(result.scope == "step" for result, _ in stored)

    db = tmp_path / "steps.jsonl"
    store.update(db, store.Contents() if not stored else _contents(stored))
    lines = [json.loads(line) for line in db.read_text().splitlines()]
    results = [line for line in lines if line["type"] == "result"]
    assert [r["scope"] for r in results] == ["step"] * 3
    wgrad = next(r for r in results if r["key"]["variable_k"])
    assert wgrad["backend"] == "WGRAD_FAST" and wgrad["config"] == "quick"
    # The entry's candidates are step times, the default's among them (db prune --min-speedup reads them).
    assert set(wgrad["candidates"]) == {"STEADY", "WGRAD_FAST[lazy]", "WGRAD_FAST[quick]", "WRONG_FAST"}
    assert wgrad["candidates"]["WRONG_FAST"] is None
    assert wgrad["candidates"]["STEADY"] > wgrad["candidates"]["WGRAD_FAST[quick]"]

    # A job reading the DB (autotune off) runs the stored choices.
    GlobalBackendManager.set_tune_db_path([db])
    assert _run_layer_step(layer) == [("STEADY", None, "tuned-db"), ("STEADY", None, "tuned-db"),
                                      ("WGRAD_FAST", "quick", "tuned-db")]


def test_db_prune_min_speedup_keeps_or_drops_a_step_tuned_layer_whole(fixtures, tmp_path):
    """The three entries of a layer carry its confirmed speedup (``default_ms``), so pruning by
    speedup never splits the combination the step was measured with."""
    from turbo_dispatch.tuning.report import prune, speedup_over_default

    report, stored = step_tuner.tune_layer(_layer(), CPU, **FAST)
    assert report.status == "tuned"
    assert {round(speedup_over_default(result), 6) for result, _ in stored} == {
        round(report.default_ms / report.tuned_ms, 6)}
    db = tmp_path / "steps.jsonl"
    store.update(db, _contents(stored))
    assert json.loads(db.read_text().splitlines()[-1])["default_ms"] > 0
    assert prune(db, min_speedup=1.2) == (0, 3)
    assert prune(db, min_speedup=2.0) == (3, 0)


def _contents(pairs):
    from turbo_dispatch.tuning.database import contents_of

    return contents_of(pairs)


def test_the_tuner_leaves_no_trace_in_the_resolver_or_the_autotuner_memory(fixtures):
    from turbo_dispatch import autotune

    layer = _layer()
    before = _run_layer_step(layer)
    step_tuner.tune_layer(layer, CPU, **FAST)
    assert not any(key[0] == "grouped_gemm" for key in autotune._memory)
    assert _run_layer_step(layer) == before == [("STEADY", None, "default")] * 3


@pytest.fixture
def declared_timing(monkeypatch):
    """The step tuner's timer charges each step what the fixtures declare for its three GEMMs,
    nothing of the wall clock: for tests of what the tuner does with times, not of the timing.
    Timed on the wall clock, a loaded machine (a 2-core one with busy loops beside it; pytest -n 8
    on a 16-core GPU host) can move a step by more than the fixtures' margins."""
    def declared_ms(timer, choices):
        return 1e3 * sum(c.entry.adapter.delay(problem, c.config) for (_, problem), c in choices.items())

    monkeypatch.setattr(step_tuner._Timer, "__call__", declared_ms)


def test_a_gain_under_min_speedup_stores_nothing(fixtures, declared_timing):
    report, stored = step_tuner.tune_layer(_layer(), CPU, min_speedup=2.0, **FAST)
    assert report.status == "default kept" and stored == []
    assert 1.25 < report.speedup < 1.8 and "under --min-speedup 2.0" in report.note


def test_without_a_better_choice_the_default_is_kept(fixtures, monkeypatch):
    from fixture_backends import WgradFastGroupedGemm

    monkeypatch.setattr(WgradFastGroupedGemm, "delay", lambda self, p, config: 1.8)
    report, stored = step_tuner.tune_layer(_layer(), CPU, **FAST)
    assert report.status == "default kept" and stored == [], report
    assert report.note == "no role's choice beat the default"
    assert {r.winner for r in report.roles} == {"STEADY"}
    assert report.default_ms > 0


def test_a_default_that_fails_the_gate_is_reported_and_the_baseline_named(fixtures, monkeypatch):
    from fixture_backends import SteadyGroupedGemm

    monkeypatch.setattr(SteadyGroupedGemm, "run", lambda self, p, a, b, lens, offs, config=None: torch.zeros(1))
    report, stored = step_tuner.tune_layer(_layer(), CPU, **FAST)
    assert "forward: the default failed the gate, baseline WGRAD_FAST[lazy]" in report.note, report.note
    assert {r.default for r in report.roles} == {"WGRAD_FAST[lazy]"}
    assert "STEADY" in dict(report.roles[0].rejected)


def test_a_layer_whose_keys_an_earlier_layer_chose_is_held_not_retuned(fixtures):
    first, second = _layer(), _layer(SHAPE._replace(m_total=SHAPE.m_total - 3))  # one token bucket
    assert _role_keys(first) == _role_keys(second)
    held = {}
    report, stored = step_tuner.tune_layer(first, CPU, held=held, **FAST)
    assert report.status == "tuned" and len(held) == 3
    again, more = step_tuner.tune_layer(second, CPU, held=held, **FAST)
    assert again.status == "held" and more == [] and first.label in again.note


def test_a_pinned_backend_is_refused_with_the_setting_named(fixtures, monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "STEADY")
    GlobalBackendManager.reset()
    with pytest.raises(ValueError, match="PRIMUS_TURBO_GROUPED_GEMM_BACKEND pins STEADY"):
        step_tuner.tune_layer(_layer(), CPU, **FAST)


def test_a_role_with_no_correct_candidate_fails_the_layer_with_the_reasons(fixtures, monkeypatch):
    from fixture_backends import SteadyGroupedGemm, WgradFastGroupedGemm

    wrong = lambda self, p, a, b, lens, offs, config=None: torch.zeros(1)  # noqa: E731
    monkeypatch.setattr(SteadyGroupedGemm, "run", wrong)
    monkeypatch.setattr(WgradFastGroupedGemm, "run", wrong)
    report, stored = step_tuner.tune_layer(_layer(), CPU, **FAST)
    assert report.status == "failed" and stored == []
    assert "forward: " in report.note and "STEADY" in report.note and "WRONG_FAST" in report.note


def test_a_step_result_outranks_a_faster_gemm_result_of_the_same_key():
    def result(scope, ms):
        return store.Result("s1", "grouped_gemm", {"m": 1}, "X", None, "id", ms, scope=scope)

    for order in ((result("gemm", 0.5), result("step", 9.0)), (result("step", 9.0), result("gemm", 0.5))):
        contents = store.Contents()
        for r in order:
            contents.add_result(r)
        assert [r.scope for r in contents.results.values()] == ["step"]
    contents = store.Contents()
    contents.add_result(result("step", 9.0))
    assert contents.add_result(result("step", 8.0))  # among steps, the faster
    # Files without the field read as GEMM results; an unknown scope is a malformed line.
    line = result("gemm", 1.0).to_json()
    assert "scope" not in line and store.Result.from_json(line).scope == "gemm"
    parsed = store.parse(json.dumps({**line, "scope": "epoch"}))
    assert not parsed.results and "scope must be one of gemm, step" in next(iter(parsed.skipped))


def test_cli_tune_step_tunes_stores_and_shows_step_entries(fixtures, declared_timing, tmp_path, capsys):
    # The CLI's plumbing is under test here, not the timing (the tests above time real steps).
    db = tmp_path / "cli.jsonl"
    args = ["tune", "--model", "tiny", "--ops", "grouped_gemm", "--step", "--ep", "1", "--tokens-per-expert", "16",
            "--db", str(db), "--no-progress", "--device", "cpu"]  # the fixtures serve the CPU only
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "2 layers by steps: 2 tuned (stored)" in out and "WGRAD_FAST[quick]" in out
    assert cli(["db", "show", str(db)]) == 0
    shown = capsys.readouterr().out
    assert shown.count(" step ") == 6 and "6 entries" in shown
    # A second run finds the layers stored and profiles nothing.
    assert cli(args) == 0
    assert "2 already stored" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--ops", "gemm"], "tune --step tunes grouped_gemm and grouped_gemm_fp8"),
    (["--from-recorded", "x.jsonl"], "tune --step needs --model"),
    (["--min-speedup", "0"], "--min-speedup must be a positive number"),
])
def test_cli_tune_step_refuses_what_it_cannot_do(fixtures, tmp_path, capsys, extra, message):
    args = ["tune", "--step", "--db", str(tmp_path / "x.jsonl"), "--no-progress", *extra]
    if "--from-recorded" not in extra:
        args += ["--model", "tiny"]
    assert cli(args) == 2
    assert message in capsys.readouterr().err


def test_distributed_step_tune_shards_layers_and_rank0_writes_them(tmp_path):
    """``tune --step --distributed`` under torchrun (2 ranks, gloo): each rank tunes its share of
    the layers (here TORCH, the product backend, beats the costly STEADY default everywhere) and
    rank 0 writes every layer's three step entries."""
    import os
    import subprocess
    import sys

    plugins = tmp_path / "plugins.yaml"
    plugins.write_text(PLUGINS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMUS_TURBO_")}
    env.update(PRIMUS_TURBO_EXTRA_REGISTRY=str(plugins), PRIMUS_TURBO_TUNE_DB_SHIPPED="0",
               PRIMUS_TURBO_TUNE_DB="off",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")]))
    db = tmp_path / "dist.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29637",
           "-m", "turbo_dispatch.cli", "tune", "--model", "tiny", "--ops", "grouped_gemm", "--step", "--ep", "1",
           "--tokens-per-expert", "16", "--step-budget-ms", "30", "--db", str(db), "--distributed", "--no-progress",
           "--device", "cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 layers by steps: 2 tuned (stored)" in proc.stdout, proc.stdout
    results = store.parse(db.read_text()).results.values()
    assert len(results) == 6 and {r.scope for r in results} == {"step"} and {r.backend for r in results} == {"TORCH"}


def test_doctests():
    import doctest

    for name in ("turbo_dispatch.tuning.step", "turbo_dispatch.tuning.keys"):
        result = doctest.testmod(importlib.import_module(name))
        assert result.attempted >= 1 and result.failed == 0, (name, result)
