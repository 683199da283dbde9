"""The tuner records a winner's device time and host issue time per call (``gpu_us``, ``host_us``)
next to its cost in the tuning DB, and ``explain`` and ``db show`` show them.

On the CPU the fixture backends declare their cost on the autotuner's virtual clock
(tests/fixture_backends.py), so the recorded host time is known; the CUDA timing loop is run with
the device calls stubbed by declared (GPU ms, host ms) pairs.
"""
from __future__ import annotations

import json

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager, autotune, host_cover
from turbo_dispatch.autotune import CallTime
from turbo_dispatch.cli import main as cli
from turbo_dispatch.ops.gemm import GEMM, gemm_problem
from turbo_dispatch.registry import get_registry, reload_registry
from turbo_dispatch.tuning import store
from turbo_dispatch.tuning.codec import encode_key
from turbo_dispatch.tuning.stamp import current_stamp

from plugin_registry import use_plugins
from db_lines import db_file

SLOW_ONLY = ("version: 1\nops:\n  gemm:\n    defaults: {cpu: SLOW}\n    backends:\n"
             "      - name: SLOW\n        adapter: fixture_backends:SlowGemm\n        platforms: [cpu]\n")


@pytest.fixture
def slow_only(tmp_path, monkeypatch):
    """SLOW (200 ms a call, declared) is the CPU default and the only gemm candidate."""
    use_plugins(tmp_path, monkeypatch, SLOW_ONLY)
    monkeypatch.setattr(get_registry().get("gemm", "TORCH").adapter, "supports", lambda p: "switched off here")
    yield
    monkeypatch.undo()
    reload_registry()
    GlobalBackendManager.reset()


# -- the split of one candidate's timing -------------------------------------------------------------
def test_cost_is_the_larger_time_per_call_and_both_medians_are_kept():
    host_bound = [(0.005, 0.080), (0.006, 0.090), (0.005, 0.085)]
    timed = CallTime.of(host_bound)
    assert timed == CallTime(0.085, 0.005, 0.085)
    # Per call, not of the medians: each call's cost is its own larger time.
    mixed = CallTime.of([(0.1, 0.02), (0.01, 0.2), (0.15, 0.03)])
    assert mixed.cost_ms == 0.15 and mixed.gpu_ms == 0.1 and mixed.host_ms == 0.03
    on_host = CallTime.of([(None, 2.0), (None, 1.0), (None, 3.0)])
    assert on_host == CallTime(2.0, None, 2.0)
    assert CallTime.combined([CallTime(1.0, 0.5, 1.0), CallTime(3.0, None, 3.0), CallTime(2.0, 2.0, 0.5)]) == \
        CallTime(2.0, 1.25, 1.0)


def test_the_cuda_timing_loop_keeps_device_and_host_time_apart(monkeypatch):
    """``_measure`` on CUDA with the device stubbed: every covered call reports (GPU ms, host ms);
    a host-bound call's host time comes from the loop of calls, a device-bound one's from the
    covered calls (no loop is run)."""
    pairs = iter([(0.004, 0.070)] * 100)
    loops = []

    def loop(fn, device, calls):
        loops.append(calls)
        return 0.050

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(host_cover, "untimed_host_ms", lambda fn, device: 0.07)
    monkeypatch.setattr(host_cover, "covered_call", lambda fn, device, host_ms: next(pairs))
    monkeypatch.setattr(host_cover, "loop_host_ms", loop)
    timed = autotune._measure(lambda inputs: None, [()], torch.device("cuda", 0), deadline=0.0)
    assert timed == CallTime(0.050, 0.004, 0.050) and loops == [autotune._MIN_REPEATS]
    parts: list = []
    assert autotune._time_ms(lambda inputs: None, [()], torch.device("cuda", 0), 0.0, parts) == 0.050
    assert parts == [CallTime(0.050, 0.004, 0.050)]
    loops.clear()
    pairs = iter([(2.0, 0.070)] * 100)
    assert autotune._measure(lambda inputs: None, [()], torch.device("cuda", 0), 0.0) == CallTime(2.0, 2.0, 0.070)
    assert loops == []


def test_loop_host_ms_calls_in_order_and_refuses_no_calls():
    seen = []
    assert host_cover.loop_host_ms(seen.append, torch.device("cpu"), 3) >= 0.0 and seen == [0, 1, 2]
    with pytest.raises(ValueError, match="calls"):
        host_cover.loop_host_ms(seen.append, torch.device("cpu"), 0)


# -- recorded by the tuner, stored, shown -----------------------------------------------------------
def test_profile_records_the_winners_host_time_on_the_virtual_clock(slow_only):
    record = autotune.profile(GEMM, gemm_problem(torch.empty(24, 16), torch.empty(16, 8)),
                              [get_registry().get("gemm", "SLOW")])
    assert record.backend == "SLOW"
    assert record.gpu_ms is None  # the host computes a CPU call: no device time
    assert 200.0 <= record.host_ms < 300.0 and record.host_ms == pytest.approx(record.time_ms, rel=0.05)


def test_a_kept_default_reports_its_confirmation_split(tmp_path, monkeypatch):
    """When the confirmation keeps the default, the stored split is the default's in the turns."""
    use_plugins(tmp_path, monkeypatch, "version: 1\nops:\n  gemm:\n    defaults: {cpu: SLOW}\n    backends:\n"
                                    "      - name: SLOW\n        adapter: fixture_backends:SlowGemm\n"
                                    "        platforms: [cpu]\n      - name: FADING\n"
                                    "        adapter: fixture_backends:FadingGemm\n        platforms: [cpu]\n")
    from fixture_backends import FadingGemm

    try:
        monkeypatch.setattr(FadingGemm, "calls", 0)
        monkeypatch.setattr(get_registry().get("gemm", "TORCH").adapter, "supports", lambda p: "switched off here")
        problem = gemm_problem(torch.empty(24, 16), torch.empty(16, 8))
        candidates = [e for e in get_registry().backends("gemm") if e.check(problem, "cpu") is None]
        record = autotune.profile(GEMM, problem, candidates)
        assert record.backend == "SLOW" and "the default is kept" in record.note
        assert record.host_ms == pytest.approx(record.time_ms, rel=0.05) and record.gpu_ms is None
    finally:
        monkeypatch.undo()
        reload_registry()
        GlobalBackendManager.reset()


def test_online_tuning_stores_the_split_and_explain_shows_it(slow_only, tmp_path, capsys):
    GlobalBackendManager.set_auto_tune(True)
    a, b = torch.randn(24, 16), torch.randn(16, 8)
    torch.testing.assert_close(turbo.ops.gemm(a, b), a @ b)
    decision = turbo.explain("gemm", a, b)
    assert decision.source == "autotune" and decision.backend == "SLOW"
    assert any(n.startswith("host ") and n.endswith(" us per call (no device: the host computes the call)")
               for n in decision.notes), decision.notes
    line = next(json.loads(raw) for raw in open(GlobalBackendManager.get_tune_db()) if '"result"' in raw)
    assert "gpu_us" not in line and 200_000 <= line["host_us"] < 300_000
    (result,) = store.parse(open(GlobalBackendManager.get_tune_db()).read()).results.values()
    assert result.host_us == line["host_us"] and result.gpu_us is None


def _entry(problem, **times) -> dict:
    stamp = current_stamp("cpu")
    identity = get_registry().get("gemm", "TORCH").adapter.identity(None)
    return {"type": "result", "stamp": stamp.id, "op": "gemm", "key": encode_key(problem), "backend": "TORCH",
            "config": None, "identity": identity, "time_ms": 0.0837, **times}


def test_old_and_new_entries_load_validate_and_show(tmp_path, capsys):
    with_split = gemm_problem(torch.empty(11, 5), torch.empty(5, 6))
    without = gemm_problem(torch.empty(12, 5), torch.empty(5, 6))
    db = db_file(tmp_path / "db.jsonl", [_entry(with_split, gpu_us=5.2, host_us=83.7), _entry(without)])
    contents = store.parse(db.read_text())
    assert not contents.skipped
    by_m = {r.key["m"]: r for r in contents.results.values()}
    assert (by_m[11].gpu_us, by_m[11].host_us) == (5.2, 83.7)
    assert (by_m[12].gpu_us, by_m[12].host_us) == (None, None)
    # A rewrite keeps the fields where they are and adds none where they were not.
    assert store.Result.from_json(by_m[11].to_json()) == by_m[11]
    assert "gpu_us" not in by_m[12].to_json() and "host_us" not in by_m[12].to_json()

    assert cli(["db", "validate", str(db)]) == 0
    assert "ok, 2 entries (2 usable here, 0 skipped)" in capsys.readouterr().out
    assert cli(["db", "show", str(db)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].split()[:8] == ["OP", "KEY", "BACKEND", "CONFIG", "MS", "GPU_US", "HOST_US", "TIMED"]
    row11 = next(r for r in rows if "m=11," in r).split()
    row12 = next(r for r in rows if "m=12," in r).split()
    assert row11[4:7] == ["0.0837", "5.2", "83.7"]
    assert row12[4:7] == ["0.0837", "-", "-"]


def test_explain_names_the_split_of_a_db_entry(tmp_path):
    with_split = gemm_problem(torch.empty(11, 5), torch.empty(5, 6))
    without = gemm_problem(torch.empty(12, 5), torch.empty(5, 6))
    db = db_file(tmp_path / "db.jsonl", [_entry(with_split, gpu_us=5.2, host_us=83.7), _entry(without)])
    GlobalBackendManager.set_tune_db(db)
    decision = turbo.explain("gemm", torch.randn(11, 5), torch.randn(5, 6))
    assert decision.source == "tuned-db"
    assert "gpu 5.2 us, host 83.7 us per call" in decision.notes, decision.notes
    assert "note:    gpu 5.2 us, host 83.7 us per call" in str(decision)
    decision = turbo.explain("gemm", torch.randn(12, 5), torch.randn(5, 6))
    assert decision.source == "tuned-db" and not any("per call" in n for n in decision.notes)


@pytest.mark.parametrize("field, value", [("gpu_us", "fast"), ("host_us", -1.0), ("gpu_us", True),
                                          ("host_us", float("inf"))])
def test_a_malformed_time_skips_the_line(tmp_path, capsys, field, value):
    problem = gemm_problem(torch.empty(11, 5), torch.empty(5, 6))
    db = tmp_path / "db.jsonl"
    header = {"type": "header", "format": store.FORMAT, "version": store.VERSION}
    lines = [json.dumps(header), json.dumps(current_stamp("cpu").to_json()),
             json.dumps(_entry(problem, **{field: value}))]  # json.dumps writes inf as Infinity
    db.write_text("\n".join(lines) + "\n")
    contents = store.parse(db.read_text())
    assert not contents.results and sum(contents.skipped.values()) == 1
    assert f"malformed result: {field} must be a finite non-negative number" in next(iter(contents.skipped))
    assert cli(["db", "validate", str(db)]) == 1
