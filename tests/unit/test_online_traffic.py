"""How long after online traffic the Batch API's idle class stays restrained (scheduling/online_traffic.py)."""

from __future__ import annotations

import pytest

from tokenmill.scheduling.online_traffic import MAX_QUIET_S, ONLINE_QUIET_S, OnlineTraffic


def test_without_pauses_seen_recent_means_the_fixed_window() -> None:
    traffic = OnlineTraffic()
    assert not traffic.recent(0.0)
    for step in range(20):  # one burst: steps 10 ms apart are not pauses between arrivals
        traffic.seen(step * 0.01)
    assert traffic.quiet_after_s == ONLINE_QUIET_S
    assert traffic.recent(0.19 + ONLINE_QUIET_S - 0.01) and not traffic.recent(0.19 + ONLINE_QUIET_S)


def test_a_steady_stream_stays_recent_through_pauses_ten_times_its_median() -> None:
    traffic = OnlineTraffic()
    now = 0.0
    for pause in [0.5, 0.3, 0.4, 0.6, 0.4] * 4:
        now += pause
        traffic.seen(now)
    assert traffic.quiet_after_s == pytest.approx(4.0)  # 10 x the median pause, 0.4 s
    assert traffic.recent(now + 3.9) and not traffic.recent(now + 4.01)


def test_a_rare_long_silence_does_not_stretch_the_window() -> None:
    traffic = OnlineTraffic()
    now = 0.0
    for pause in [0.4] * 10 + [600.0] + [0.4] * 5:
        now += pause
        traffic.seen(now)
    assert traffic.quiet_after_s == pytest.approx(4.0)


def test_the_window_is_capped() -> None:
    traffic = OnlineTraffic()
    now = 0.0
    for _ in range(8):
        now += 120.0
        traffic.seen(now)
    assert traffic.quiet_after_s == MAX_QUIET_S
