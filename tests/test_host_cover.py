"""The spin that hides a timed call's host time (turbo_dispatch.host_cover), CPU parts."""
from turbo_dispatch import host_cover


def test_cover_cycles_floor_margin_cap():
    assert host_cover.cover_cycles(0.2, 2e6) == host_cover.FLOOR_CYCLES  # 0.4 ms worth < the floor
    assert host_cover.cover_cycles(2.0, 2e6) == int((2.0 * 1.5 + 0.1) * 2e6)
    assert host_cover.cover_cycles(1e6, 2e6) == int(host_cover.CAP_MS * 2e6)


def test_cover_cycles_floor_scale_cap():
    """The spin before a timed call is the floor for short host times, grows with the host time
    (with a margin: it must outlast the host's issue, not just match it) and stops at the cap."""
    cpm = 2e6  # 2 GHz
    floor, cap_ms = 1_000_000, 50.0
    assert host_cover.cover_cycles(0.0, cpm, floor, cap_ms) == floor
    assert host_cover.cover_cycles(0.05, cpm, floor, cap_ms) == floor
    small, large = host_cover.cover_cycles(2.0, cpm, floor, cap_ms), host_cover.cover_cycles(4.0, cpm, floor, cap_ms)
    assert small > 2.0 * cpm and large > 4.0 * cpm  # longer than the host time itself
    assert large > small > floor
    assert host_cover.cover_cycles(1000.0, cpm, floor, cap_ms) == int(cap_ms * cpm)
    # a slower clock (fewer cycles per ms) needs fewer cycles for the same host time
    assert host_cover.cover_cycles(4.0, 1e6, floor, cap_ms) < large


def test_typical_ms_leaves_out_the_first_call():
    assert host_cover.typical_ms([500.0, 1.0, 2.0, 3.0]) == 2.0  # a compiling first call
    assert host_cover.typical_ms([4.0]) == 4.0
    assert host_cover.typical_ms([]) == 0.0


def test_untimed_host_ms_times_one_call():
    """One call, timed on the host (on the CPU nothing to synchronise); the sample grows with
    the call's own time."""
    import time

    import torch

    calls = []
    quick = host_cover.untimed_host_ms(lambda: calls.append(1), torch.device("cpu"))
    slow = host_cover.untimed_host_ms(lambda: (calls.append(1), time.sleep(0.02)), torch.device("cpu"))
    assert calls == [1, 1]
    assert 0.0 <= quick < slow and slow >= 20.0
