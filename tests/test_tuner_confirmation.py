"""The tuner never stores a winner slower than the platform default: after the sweep, the two are
re-timed in turns, and a winner that is not faster there gives way to the default."""
from __future__ import annotations

import pytest
import torch

from turbo_dispatch import GlobalBackendManager
from turbo_dispatch.autotune import profile
from turbo_dispatch.ops.gemm import GEMM, gemm_problem
from turbo_dispatch.registry import get_registry, reload_registry

from plugin_registry import use_plugins


@pytest.fixture(autouse=True)
def restore_registry(monkeypatch):
    yield
    monkeypatch.undo()
    reload_registry()
    GlobalBackendManager.reset()


def _profile(problem):
    candidates = [e for e in get_registry().backends("gemm") if e.check(problem, "cpu") is None]
    return profile(GEMM, problem, candidates)


def test_a_flattered_winner_gives_way_to_the_default(tmp_path, monkeypatch):
    use_plugins(tmp_path, monkeypatch, "version: 1\nops:\n  gemm:\n    defaults: {cpu: SLOW}\n    backends:\n"
                                    "      - name: SLOW\n        adapter: fixture_backends:SlowGemm\n"
                                    "        platforms: [cpu]\n      - name: FADING\n"
                                    "        adapter: fixture_backends:FadingGemm\n        platforms: [cpu]\n")
    from fixture_backends import FadingGemm

    monkeypatch.setattr(FadingGemm, "calls", 0)
    monkeypatch.setattr(get_registry().get("gemm", "TORCH").adapter, "supports", lambda p: "switched off here")
    problem = gemm_problem(torch.empty(24, 16), torch.empty(16, 8))
    record = _profile(problem)
    sweep = dict(record.timings)
    assert sweep["FADING"] < 100.0 < sweep["SLOW"], "the sweep must have measured FADING's flattering calls"
    assert record.backend == "SLOW", record
    assert "was not faster than the default SLOW when re-timed in turns" in record.note


def test_a_real_winner_is_confirmed(tmp_path, monkeypatch):
    use_plugins(tmp_path, monkeypatch, "version: 1\nops:\n  gemm:\n    defaults: {cpu: SLOW}\n    backends:\n"
                                    "      - name: SLOW\n        adapter: fixture_backends:SlowGemm\n"
                                    "        platforms: [cpu]\n")
    problem = gemm_problem(torch.empty(24, 16), torch.empty(16, 8))
    record = _profile(problem)
    assert record.backend == "TORCH", record
    assert record.note.startswith("confirmed in turns") and "the default SLOW" in record.note
