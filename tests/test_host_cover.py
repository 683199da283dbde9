"""The spin that hides a timed call's host time (turbo_dispatch.host_cover), CPU parts."""
from turbo_dispatch import host_cover


def test_cover_cycles_floor_margin_cap():
    assert host_cover.cover_cycles(0.2, 2e6) == host_cover.FLOOR_CYCLES  # 0.4 ms worth < the floor
    assert host_cover.cover_cycles(2.0, 2e6) == int((2.0 * 1.5 + 0.1) * 2e6)
    assert host_cover.cover_cycles(1e6, 2e6) == int(host_cover.CAP_MS * 2e6)


def test_typical_ms_leaves_out_the_first_call():
    assert host_cover.typical_ms([500.0, 1.0, 2.0, 3.0]) == 2.0  # a compiling first call
    assert host_cover.typical_ms([4.0]) == 4.0
    assert host_cover.typical_ms([]) == 0.0
