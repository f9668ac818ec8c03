"""The idle-save schedule (idlesaves.IdleSaves), called directly: each model's save is due on its own clock.

Why: a router's children sleep apart (--sleep-idle-seconds); a save that waited for every model to be quiet let
one model's long answer hold another's save past that model's sleep, and its changed chat was lost with the
cache (found on a loaded machine: tests/test_sleep_race.py's router case).
"""

from __future__ import annotations

from slotkeeper.idlesaves import RETRY_MAX_S, Activity, IdleSaves

IDLE_S = 1.5


def quiet(last_end: float, requests: int) -> Activity:
    return Activity(in_flight=0, last_end=last_end, requests=requests)


def test_a_models_save_is_due_its_idle_time_after_its_own_last_request() -> None:
    saves = IdleSaves(idle_s=IDLE_S)
    assert saves.due("a", quiet(10.0, 1)) == 10.0 + IDLE_S


def test_another_models_work_does_not_delay_it() -> None:
    """b answers for a long time: a's save stays due on a's clock (the schedule asks a's activity only)."""
    saves = IdleSaves(idle_s=IDLE_S)
    assert saves.due("b", Activity(in_flight=1, last_end=9.0, requests=1)) is None
    assert saves.due("a", quiet(10.0, 1)) == 10.0 + IDLE_S


def test_nothing_is_due_while_its_own_request_runs() -> None:
    saves = IdleSaves(idle_s=IDLE_S)
    assert saves.due("a", Activity(in_flight=1, last_end=10.0, requests=2)) is None


def test_nothing_is_due_again_until_a_request_comes() -> None:
    saves = IdleSaves(idle_s=IDLE_S)
    saves.started("a", quiet(10.0, 1))
    assert saves.ended("a", left_changes=False, now=12.0) is None
    assert saves.due("a", quiet(10.0, 1)) is None
    assert saves.due("a", quiet(20.0, 2)) == 20.0 + IDLE_S


def test_nothing_is_due_before_any_request() -> None:
    assert IdleSaves(idle_s=IDLE_S).due("a", quiet(0.0, 0)) is None


def test_a_save_that_left_changes_is_tried_again_doubling_up_to_the_maximum() -> None:
    """No request needed: after --autosave-idle, then twice as long each time, from the end of the last try."""
    saves = IdleSaves(idle_s=IDLE_S)
    saves.started("a", quiet(10.0, 1))
    waits = []
    now = 12.0
    for _ in range(12):
        wait = saves.ended("a", left_changes=True, now=now)
        assert wait is not None
        waits.append(wait)
        assert saves.due("a", quiet(10.0, 1)) == now + wait
        now += wait
    assert waits[:4] == [IDLE_S, 2 * IDLE_S, 4 * IDLE_S, 8 * IDLE_S]
    assert waits[-1] == RETRY_MAX_S
    assert saves.ended("a", left_changes=False, now=now) is None
    assert saves.due("a", quiet(10.0, 1)) is None


def test_a_retry_still_waits_for_its_model_to_be_quiet() -> None:
    saves = IdleSaves(idle_s=IDLE_S)
    saves.started("a", quiet(10.0, 1))
    saves.ended("a", left_changes=True, now=12.0)
    assert saves.due("a", Activity(in_flight=1, last_end=10.0, requests=2)) is None
    assert saves.due("a", quiet(14.0, 2)) == 14.0 + IDLE_S  # a request ended after the retry's time
