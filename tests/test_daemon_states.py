"""The daemon's lifecycle states change only along its transition table (llama-swap's process.go checks its own)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slotkeeper.daemon import TRANSITIONS, Daemon, InvalidTransition, State

RUN = [State.STARTING, State.RESTORING, State.READY, State.DRAINING, State.SAVING, State.STOPPING, State.STOPPED]


def holder(state: State) -> SimpleNamespace:
    """What set_state reads and writes of a Daemon: its state (the rest of a Daemon is a running child)."""
    return SimpleNamespace(state=state)


def test_the_table_names_every_state() -> None:
    assert set(TRANSITIONS) == set(State)


def test_a_whole_run_goes_through() -> None:
    daemon = holder(State.STARTING)
    for state in RUN[1:]:
        Daemon.set_state(daemon, state)  # type: ignore[arg-type]
        assert daemon.state is state


@pytest.mark.parametrize("start", RUN[:-1])
def test_any_state_may_end_early_in_a_forced_stop_or_the_runs_end(start: State) -> None:
    for end in (State.STOPPING, State.STOPPED):
        if end is start:
            continue
        daemon = holder(start)
        Daemon.set_state(daemon, end)  # type: ignore[arg-type]
        assert daemon.state is end


@pytest.mark.parametrize(("start", "back"), [(later, earlier) for i, later in enumerate(RUN) for earlier in RUN[:i]])
def test_nothing_comes_back(start: State, back: State) -> None:
    daemon = holder(start)
    with pytest.raises(InvalidTransition, match=f"state {start.value} cannot become {back.value}"):
        Daemon.set_state(daemon, back)  # type: ignore[arg-type]
    assert daemon.state is start


def test_no_step_is_skipped_on_the_way_to_ready() -> None:
    daemon = holder(State.STARTING)
    with pytest.raises(InvalidTransition):
        Daemon.set_state(daemon, State.READY)  # type: ignore[arg-type]


def test_setting_the_current_state_again_changes_nothing() -> None:
    daemon = holder(State.READY)
    Daemon.set_state(daemon, State.READY)  # type: ignore[arg-type]
    assert daemon.state is State.READY
