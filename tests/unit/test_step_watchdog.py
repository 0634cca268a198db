"""The engine watchdog's step timeout: max(60 s, 20 x p99 of recent step times) unless set; 0 turns it off."""

from __future__ import annotations

from tokenmill.engine.step_watchdog import StepWatchdog


def test_before_any_step_the_floor_applies() -> None:
    watchdog = StepWatchdog()
    assert watchdog.limit() == 60.0
    assert not watchdog.is_hung(59.0) and watchdog.is_hung(61.0)


def test_slow_steps_raise_the_timeout_to_twenty_times_their_p99() -> None:
    watchdog = StepWatchdog()
    for _ in range(99):
        watchdog.record(0.5)
    watchdog.record(0.0)  # a report without a model step is not a step time
    watchdog.record(4.0)  # the 99th percentile of 100 steps
    assert watchdog.limit() == 80.0  # 20 x 4 s
    assert not watchdog.is_hung(79.0) and watchdog.is_hung(81.0)


def test_a_set_timeout_wins_and_zero_turns_the_watchdog_off() -> None:
    watchdog = StepWatchdog(5.0)
    watchdog.record(10.0)
    assert watchdog.limit() == 5.0 and watchdog.is_hung(6.0)
    assert not StepWatchdog(0.0).is_hung(1e9)
