"""Test fixtures: deterministic plugin backends whose behaviour and speed the tests control.

These are not product backends; they exist to exercise the resolver and autotuner. A fixture's
cost is declared, not slept: ``spend(seconds)`` advances a virtual clock that importing this module
installs as the autotuner's CPU clock (real time plus every declared cost). Declared costs are
hundreds of milliseconds, far beyond what a loaded 2-core machine's scheduling adds to a real
call, and cost no wall time, so no outcome depends on the machine's load.
"""
import threading
import time

import torch

from turbo_dispatch import autotune
from turbo_dispatch.adapter import Adapter

_declared = [0.0]
_declared_lock = threading.Lock()


def spend(seconds: float) -> None:
    """Charges ``seconds`` of virtual time to the call in progress."""
    with _declared_lock:
        _declared[0] += seconds


def _virtual_clock() -> float:
    return time.perf_counter() + _declared[0]


autotune._clock = _virtual_clock


class _Fixture(Adapter):
    library = "fixture"
    delay_s = 0.0
    calls = 0

    def version(self) -> str:
        return "1"


class NNOnlyGemm(_Fixture):
    """Correct, but only for trans_a=False, trans_b=False."""

    def supports(self, p):
        if p.trans_a or p.trans_b:
            return "fixture supports only the NN layout"
        return None

    def run(self, p, a, b, config=None):
        type(self).calls += 1
        return torch.matmul(a, b).to(p.out_dtype)


class SlowGemm(_Fixture):
    """Correct and slow (declares 200 ms a call), for every layout."""

    delay_s = 0.2

    def run(self, p, a, b, config=None):
        spend(self.delay_s)
        lhs = a.t() if p.trans_a else a
        rhs = b.t() if p.trans_b else b
        return torch.matmul(lhs, rhs).to(p.out_dtype)


class WrongFastGemm(_Fixture):
    """Instant and wrong: must never win an autotune."""

    def run(self, p, a, b, config=None):
        return torch.ones(p.m, p.n, dtype=p.out_dtype, device=a.device)


class Unavailable(_Fixture):
    def available(self):
        return "fixture library is not installed"

    def run(self, p, a, b, config=None):
        raise AssertionError("never runs")


class _RankDependent(_Fixture):
    """Correct; fast on one rank (FIXTURE_RANK env var) and slow on the other."""

    fast_rank = 0

    def run(self, p, a, b, config=None):
        import os

        if int(os.environ.get("FIXTURE_RANK", "0")) != self.fast_rank:
            spend(0.3)
        lhs = a.t() if p.trans_a else a
        rhs = b.t() if p.trans_b else b
        return torch.matmul(lhs, rhs).to(p.out_dtype)


class FastOnRank0(_RankDependent):
    fast_rank = 0


class FastOnRank1(_RankDependent):
    fast_rank = 1


class SteadyOnEveryRank(_RankDependent):
    """Correct; the same middling speed on every rank: slower than either rank's own fast backend
    there, faster than both at their worst, so agreeing by worst time picks it."""

    def run(self, p, a, b, config=None):
        spend(0.1)
        return torch.matmul(a.t() if p.trans_a else a, b.t() if p.trans_b else b).to(p.out_dtype)


class EvenTokensGroupedGemm(_Fixture):
    """Correct grouped GEMM that serves only an even token count (M_total, or a wgrad's K): its
    refusal reads the very field the grouped ops bucket, which the product adapters never do."""

    def supports(self, p):
        tokens = p.k if p.variable_k else p.m
        if tokens % 2:
            return f"fixture serves an even token count only (got {tokens})"
        return None

    def run(self, p, a, b, group_lens, group_offs, config=None):
        type(self).calls += 1
        return _grouped_math(p, a, b, group_lens)


def _grouped_math(p, a, b, group_lens):
    """The grouped GEMM of ``p`` (M-grouped, or the variable-K wgrad), group by group."""
    outs, start = [], 0
    for i, length in enumerate(group_lens.tolist()):
        rows = slice(start, start + length)
        outs.append(a[rows].t() @ b[rows] if p.variable_k else a[rows] @ (b[i].t() if p.trans_b else b[i]))
        start += length
    return torch.stack(outs) if p.variable_k else torch.cat(outs)


class _RoleTimedGroupedGemm(_Fixture):
    """Correct grouped GEMM that declares ``delay(p, config)`` seconds: the step tuner's tests
    control what each role (forward, dgrad, wgrad) costs with each config."""

    def delay(self, p, config) -> float:
        return 0.0

    def run(self, p, a, b, group_lens, group_offs, config=None):
        spend(self.delay(p, config))
        return _grouped_math(p, a, b, group_lens)


class SteadyGroupedGemm(_RoleTimedGroupedGemm):
    """600 ms per GEMM, every role."""

    def delay(self, p, config):
        return 0.6


class WgradFastGroupedGemm(_RoleTimedGroupedGemm):
    """Configs ``"lazy"`` (first: 1.8 s everywhere) and ``"quick"`` (50 ms in the wgrad, 1.8 s in
    the forward and dgrad): only the wgrad with ``"quick"`` beats SteadyGroupedGemm, and the
    product TORCH backend (no declared cost) beats it wherever it competes."""

    def configs(self, p):
        return ["lazy", "quick"]

    def delay(self, p, config):
        return 0.05 if p.variable_k and config == "quick" else 1.8


class WrongFastGroupedGemm(_Fixture):
    """Instant and wrong in every role: must never be chosen."""

    def run(self, p, a, b, group_lens, group_offs, config=None):
        out = _grouped_math(p, a, b, group_lens)
        return out + 1.0


class ConfiguredGemm(_Fixture):
    """Correct for every layout, with two configs: ``"slow"`` (the first, what a call without a
    config runs) declares ``delay_s``, ``"fast"`` does not."""

    delay_s = 0.3

    def configs(self, p):
        return ["slow", "fast"]

    def run(self, p, a, b, config=None):
        if config in (None, "slow"):
            spend(self.delay_s)
        lhs = a.t() if p.trans_a else a
        rhs = b.t() if p.trans_b else b
        return torch.matmul(lhs, rhs).to(p.out_dtype)


class FadingGemm(_Fixture):
    """Correct; free for its first ``fast_calls`` calls, then 500 ms a call: a candidate whose sweep
    measurement flatters it, as noise or a warm cache can."""

    fast_calls = 40

    def run(self, p, a, b, config=None):
        type(self).calls += 1
        if type(self).calls > self.fast_calls:
            spend(0.5)
        return torch.matmul(a.t() if p.trans_a else a, b.t() if p.trans_b else b).to(p.out_dtype)


class SlowFp8Gemm(_Fixture):
    """Correct gemm_fp8 (the product TORCH backend's math) that declares 400 ms a call: twice
    SlowGemm's, so fp8 loses to that high-precision peer."""

    delay_s = 0.4

    def run(self, p, a, b, config=None):
        from turbo_dispatch.backends.torch.gemm import TorchGemmFp8

        spend(self.delay_s)
        return TorchGemmFp8().run(p, a, b)


class BrokenGemm(_Fixture):
    """Raises on every call: a high-precision peer whose timing fails."""

    def run(self, p, a, b, config=None):
        raise RuntimeError("fixture gemm always fails")
