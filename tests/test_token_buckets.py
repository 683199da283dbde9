"""Grouped GEMMs share one decision per token bucket (tuning/buckets.py): dropless routing moves
M_total every step, and an exact key would be tuned, stored and cached anew each time."""
from __future__ import annotations

import functools
import importlib
from pathlib import Path

import pytest
import torch

import turbo_dispatch as turbo
from turbo_dispatch import GlobalBackendManager, autotune, resolver
from turbo_dispatch.errors import BackendUnsupportedError
from turbo_dispatch.ops import grouped_gemm_routing, grouped_gemm_spec
from turbo_dispatch.ops.grouped_gemm_problem import forward_fp8_problem, grouped_gemm_problem, variable_k_problem
from turbo_dispatch.registry import reload_registry
from turbo_dispatch.tuning import offline, store
from turbo_dispatch.tuning.buckets import PER_OCTAVE, SMALL, token_bucket

HERE = Path(__file__).resolve().parent

PLUGINS = """
version: 1
ops:
  grouped_gemm:
    defaults: {{cpu: {default}}}
    backends:
      - name: EVEN_TOKENS
        adapter: fixture_backends:EvenTokensGroupedGemm
        platforms: [cpu]
"""


@pytest.fixture
def even_tokens(tmp_path, monkeypatch):
    """Registers EVEN_TOKENS for grouped_gemm on the CPU; ``install(default)`` picks the default."""

    def install(default="TORCH"):
        path = tmp_path / "plugins.yaml"
        path.write_text(PLUGINS.format(default=default))
        monkeypatch.setenv("PRIMUS_TURBO_EXTRA_REGISTRY", str(path))
        reload_registry()
        GlobalBackendManager.reset()

    monkeypatch.syspath_prepend(str(HERE))
    install()
    yield install
    monkeypatch.undo()
    reload_registry()
    GlobalBackendManager.reset()


def operands(lens: list[int], k: int = 8, n: int = 5):
    a = torch.randn(sum(lens), k, requires_grad=True)
    b = torch.randn(len(lens), k, n, requires_grad=True)
    return a, b, torch.tensor(lens, dtype=torch.int64)


def reference(a, b, lens):
    return torch.cat([x @ w for x, w in zip(a.split(lens.tolist()), b)])


# -- the buckets ------------------------------------------------------------------------------------
def test_every_count_up_to_300000_lies_in_its_bucket():
    previous = 0
    for t in range(300_001):
        top = token_bucket(t)
        assert top >= t and token_bucket(top) == top and top >= previous, t
        assert t == 0 or token_bucket(t - 1) == top or token_bucket(t - 1) == t - 1, t  # a bucket starts past a top
        if t > SMALL:  # at most a quarter of an octave above the count
            assert top * PER_OCTAVE <= t * (PER_OCTAVE + 1), t
        previous = top
    assert len({token_bucket(t) for t in range(131_073)}) < 60


def test_zero_and_powers_of_two_are_their_own_buckets():
    assert [token_bucket(t) for t in (0, 1, 2, 256, 512, 4096, 131072)] == [0, 1, 2, 256, 512, 4096, 131072]
    assert token_bucket(131073) == 163840 and token_bucket(3) == 4


# -- the resolver: one decision per bucket ----------------------------------------------------------------
def test_autotune_profiles_once_per_bucket_and_stores_the_bucket_top():
    GlobalBackendManager.set_auto_tune(True)
    before = autotune.STATS["candidate_runs"]
    a, b, lens = operands([140, 0, 160])  # M_total 300: bucket 320
    out = turbo.ops.grouped_gemm(a, b, lens)
    torch.testing.assert_close(out, reference(a, b, lens))
    first = autotune.STATS["candidate_runs"]
    assert first > before
    a2, b2, lens2 = operands([100, 99, 111])  # 310, same bucket: nothing profiled
    decision = turbo.explain("grouped_gemm", a2, b2, lens2)
    assert autotune.STATS["candidate_runs"] == first
    assert decision.problem.m == 310 and "m=310" in decision.key
    assert any("shared: decided for" in note and "m=320" in note for note in decision.notes)
    torch.testing.assert_close(turbo.ops.grouped_gemm(a2, b2, lens2), reference(a2, b2, lens2))
    a3, b3, lens3 = operands([330])  # 330: bucket 384, a key of its own
    turbo.ops.grouped_gemm(a3, b3, lens3)
    assert autotune.STATS["candidate_runs"] > first
    stored = store.parse(Path(GlobalBackendManager.get_tune_db()).read_text()).results.values()
    assert {r.key["m"] for r in stored if r.op == "grouped_gemm" and not r.key["variable_k"]} == {320, 384}


def test_the_weight_gradient_buckets_its_tokens():
    p = variable_k_problem(torch.randn(300, 8), torch.randn(300, 5), torch.tensor([100, 200]))
    shared = grouped_gemm_spec.GROUPED_GEMM.shared_problem(p)
    assert (p.k, shared.k, shared.m, shared.n) == (300, 320, p.m, p.n)


def test_a_shared_choice_that_cannot_serve_the_call_is_decided_on_its_own(even_tokens):
    even_tokens(default="EVEN_TOKENS")
    a, b, lens = operands([150, 150])  # 300: EVEN_TOKENS serves the bucket top and the call
    assert turbo.explain("grouped_gemm", a, b, lens).backend == "EVEN_TOKENS"
    a2, b2, lens2 = operands([150, 151])  # 301: same bucket, but EVEN_TOKENS refuses it
    decision = turbo.explain("grouped_gemm", a2, b2, lens2)
    assert decision.backend == "TORCH" and decision.problem.m == 301
    assert not any("shared" in note for note in decision.notes)
    torch.testing.assert_close(turbo.ops.grouped_gemm(a2, b2, lens2), reference(a2, b2, lens2))


def test_a_pinned_backend_refuses_the_call_by_its_own_key(even_tokens):
    GlobalBackendManager.set_grouped_gemm_backend("EVEN_TOKENS")
    a, b, lens = operands([150, 151])
    with pytest.raises(BackendUnsupportedError, match="m=301.*even token count only"):
        turbo.ops.grouped_gemm(a, b, lens)


def test_offline_tuning_stores_the_shared_key(tmp_path):
    p = grouped_gemm_problem(torch.randn(300, 8), torch.randn(2, 8, 5), torch.tensor([100, 200]))
    db = tmp_path / "offline.jsonl"
    report, result = offline.tune_one("grouped_gemm", p, db=db)
    assert report.status == "tuned" and "m=320" in report.key, report


def test_the_decision_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(resolver, "MAX_CACHED", 4)
    for m in range(1, 12):
        turbo.ops.gemm(torch.randn(m, 3), torch.randn(3, 2))
        assert len(resolver._cache) <= 4


def test_doctests():
    import doctest

    result = doctest.testmod(importlib.import_module("turbo_dispatch.tuning.buckets"))
    assert result.attempted > 0 and result.failed == 0, result


@pytest.mark.parametrize("total,g", [(4096 * 32, 32), (1000, 7), (64, 4), (5, 8), (0, 3)])
def test_near_balanced_split(total, g):
    torch.manual_seed(total + g)
    lens = grouped_gemm_routing.near_balanced_lens(total, g)
    share = total / g
    jitter = grouped_gemm_routing.TIMING_JITTER
    lo, hi = share * (1 - jitter) / (1 + jitter), share * (1 + jitter) / (1 - jitter)
    assert lens.dtype == torch.int64 and lens.numel() == g and int(lens.sum()) == total
    assert all(lo - 1 <= n <= hi + 1 for n in lens.tolist()), lens


class _RecordingGroupedGemm:
    """A real grouped GEMM adapter (``inner``) that remembers the group sizes of every call."""

    def __init__(self, inner):
        self.inner = inner
        self.seen: list[list[int]] = []

    def configs(self, p):
        return [None]

    def run(self, p, a, b, group_lens, group_offs, config=None):
        self.seen.append(group_lens.tolist())
        return self.inner.run(p, a, b, group_lens, group_offs, config=config)


@pytest.mark.parametrize("op", ["grouped_gemm", "grouped_gemm_fp8"])
def test_the_tuner_checks_on_the_random_split_and_times_on_near_balanced_routing(op, monkeypatch):
    """The correctness gate runs on ``make_inputs`` (here: every token in one group, the kind of
    extreme a random split makes), the timing on ``make_timing_inputs`` (near-balanced)."""
    import dataclasses
    import types

    from turbo_dispatch.backends.torch.grouped_gemm import TorchGroupedGemm, TorchGroupedGemmFp8
    from turbo_dispatch.low_precision import Float8QuantConfig

    specs = grouped_gemm_spec
    spec = specs.GROUPED_GEMM if op == "grouped_gemm" else specs.GROUPED_GEMM_FP8
    one_group = lambda total, g: torch.tensor([total] + [0] * (g - 1))
    make = functools.partial(specs._make_inputs if op == "grouped_gemm" else specs._fp8_make_inputs, split=one_group)
    checked_spec = dataclasses.replace(spec, make_inputs=make)
    a, b = torch.randn(256, 8), torch.randn(4, 6, 8)
    lens = torch.tensor([64] * 4)
    if op == "grouped_gemm":
        p = grouped_gemm_problem(a, b, lens, None, True)
        adapter = _RecordingGroupedGemm(TorchGroupedGemm())
    else:
        p = forward_fp8_problem(a, b, lens, grouped_gemm_routing.offsets(lens, 256), True, None,
                                Float8QuantConfig(granularity="rowwise"))
        adapter = _RecordingGroupedGemm(TorchGroupedGemmFp8())
    record = autotune.profile(checked_spec, p, [types.SimpleNamespace(name="REC", adapter=adapter)])
    assert record.backend == "REC", record
    assert adapter.seen[0] == [256, 0, 0, 0]  # the gate's call
    timed = adapter.seen[1:]
    assert timed and all(sum(t) == 256 and 40 <= min(t) and max(t) <= 104 for t in timed), timed
