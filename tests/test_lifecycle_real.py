"""slotkeeper's lifecycle and its faults on the real llama-server, in both modes: Linux's own calls, and the paths
of a platform without them (macOS, the BSDs) taken on Linux (`SLOTKEEPER_PORTABLE=1`: a watch in
llama-server's process group stands for prctl's parent-death signal, a 50 ms poll for the pidfd).

What a llama-swap user meets: SIGKILLs of slotkeeper at random moments, llama-swap's SIGTERM of the group then
its SIGKILL when a save outlasts its timeout, llama-server's own crash, a second slotkeeper on one directory,
a long $TMPDIR. Each time llama-server is gone within a second, nothing of the run is left behind, and the store
keeps every chat it had.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from functools import partial
from pathlib import Path

import pytest
from family_helpers import FAMILIES, Chat, swap_out
from process_helpers import MODES, gone, group_members, llama_servers_of, no_runtime_dir, watched
from store_helpers import staged_in_ram, transients

from slotkeeper.testing.harness import wait_until

FAMILY = FAMILIES["llama"]


def start(family_start, mode: str, *extra: str, **kw):
    """slotkeeper in that mode, with its llama-server's process group (and, in the portable mode, the watch in
    it) up."""
    sk = family_start(FAMILY, "-np", "1", *extra, env={**MODES[mode], **kw.pop("env", {})}, **kw)
    assert wait_until(partial(llama_servers_of, sk.pid), 10), sk.logs()
    (group,) = llama_servers_of(sk.pid)
    if mode == "portable":
        assert wait_until(partial(watched, group), 2), f"no watch beside llama-server: {group_members(group)}"
    else:
        assert group_members(group) == [group], "a watch where prctl's signal does it"
    sk.extra["group"] = group
    return sk


def left_behind(save_dir: Path, pid: int) -> list[str]:
    """What a run of that pid left that is not the store's: transient files, staged files in RAM, its runtime
    directory, a partial block or manifest."""
    partials = [str(p) for p in save_dir.rglob("*.partial")]
    return transients(save_dir) + staged_in_ram(pid) + partials + ([] if no_runtime_dir(pid) else ["runtime dir"])


def nothing_left(save_dir: Path, pid: int) -> bool:
    return not left_behind(save_dir, pid)


@pytest.mark.parametrize("mode", list(MODES))
def test_llama_server_never_outlives_a_sigkilled_slotkeeper(family_start, tmp_path, mode):
    """12 SIGKILLs at random moments (starting, in a turn, saving at stop, idle; of slotkeeper alone, or of its
    group after a SIGTERM, as llama-swap sends them): llama-server's group, the watch with it, is empty within a
    second each time; the next start removes what the killed run left, and the store goes on: the chat saved at
    a stop comes back warm."""
    rng = random.Random(47)
    save_dir = tmp_path / "cache"
    chat = Chat(0, FAMILY.request)
    killed = 0
    moments = ["starting", "in a turn", "saving", "idle"] * 3
    for trial, moment in enumerate(moments):
        sk = start(family_start, mode, save_dir=save_dir, wait=moment != "starting")
        assert wait_until(partial(nothing_left, save_dir, killed), 2), (trial, left_behind(save_dir, killed))
        group = sk.extra["group"]
        if moment == "starting":
            time.sleep(rng.uniform(0.0, 0.3))
        elif moment == "in a turn":
            chat.turn(sk.port)
            time.sleep(rng.uniform(0.0, 0.1))
        elif moment == "saving":
            sk.killpg(signal.SIGTERM)
            time.sleep(rng.uniform(0.0, 0.05))
        else:
            time.sleep(rng.uniform(0.0, 0.2))
        if moment == "saving" or trial % 2:
            sk.killpg(signal.SIGKILL)  # llama-swap's group kill after its timeout
        else:
            os.kill(sk.pid, signal.SIGKILL)
        sk.wait()
        killed = sk.pid
        assert wait_until(partial(gone, group), 1.0, interval=0.01), f"trial {trial} ({moment}): {group_members(group)}"
    sk = start(family_start, mode, save_dir=save_dir)
    assert not left_behind(save_dir, killed), left_behind(save_dir, killed)
    chat.turn(sk.port)  # (from what the kills left saved: a turn killed before its save is not kept)
    swap_out(sk)
    sk = start(family_start, mode, save_dir=save_dir)
    assert chat.reused_enough(chat.turn(sk.port)), sk.logs()[-3000:]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_save_longer_than_llama_swaps_timeout_ends_in_its_sigkill_with_nothing_lost(family_start, tmp_path, mode):
    """llama-swap SIGTERMs the group, and SIGKILLs it when its timeout runs out first: here llama-server is
    stopped (SIGSTOP) before the stop, or some milliseconds into it, so the save outlasts the timeout.
    llama-server is gone within a second of the SIGKILL; the next start finds no half-written file and restores
    the chat as its last complete save left it."""
    save_dir = tmp_path / "cache"
    chat = Chat(0, FAMILY.request)
    sk = start(family_start, mode, save_dir=save_dir)
    chat.turn(sk.port)
    swap_out(sk)  # a complete save of the first turn
    saved_prompt = chat.last_prompt_tokens
    for trial, delay in enumerate((None, 0.0, 0.002, 0.005)):
        sk = start(family_start, mode, save_dir=save_dir)
        chat.turn(sk.port)
        group = sk.extra["group"]
        if delay is None:  # stopped before the stop: its save cannot even begin
            os.kill(group, signal.SIGSTOP)
        sk.killpg(signal.SIGTERM)
        if delay is not None:
            time.sleep(delay)
            with contextlib.suppress(ProcessLookupError):  # (the stop may have ended: a save takes milliseconds)
                os.kill(group, signal.SIGSTOP)  # the save cannot end now
        time.sleep(0.5)  # llama-swap's unloadTimeout
        # Running again as the SIGKILL comes, as a slow save's llama-server is: the kernel itself kills a
        # stopped process whose group its parent's death orphans (SIGHUP), which would hide a missing watch.
        with contextlib.suppress(ProcessLookupError):
            os.kill(group, signal.SIGCONT)
        sk.killpg(signal.SIGKILL)
        sk.wait()
        assert wait_until(partial(gone, group), 1.0, interval=0.01), f"trial {trial}: {group_members(group)}"
        assert delay is not None or " saved from slot" not in sk.logs(), sk.logs()[-2000:]
        killed = sk.pid
        sk = start(family_start, mode, save_dir=save_dir)
        assert not left_behind(save_dir, killed), (trial, left_behind(save_dir, killed))
        timings = chat.turn(sk.port)
        assert timings["cache_n"] >= saved_prompt, (trial, timings, saved_prompt, sk.logs()[-3000:])
        swap_out(sk)  # this turn saved: the next trial's floor
        saved_prompt = chat.last_prompt_tokens


@pytest.mark.parametrize("mode", list(MODES))
def test_llama_servers_own_crash_ends_slotkeeper_with_its_code_and_keeps_the_store(family_start, tmp_path, mode):
    """llama-server dies by a signal of its own (SIGSEGV) while serving: slotkeeper exits at once with the shell's
    code for it and one line, the watch goes with it, nothing of the run is left, and the next start restores
    the chat saved before."""
    save_dir = tmp_path / "cache"
    chat = Chat(0, FAMILY.request)
    sk = start(family_start, mode, save_dir=save_dir)
    chat.turn(sk.port)
    swap_out(sk)
    sk = start(family_start, mode, save_dir=save_dir)
    group = sk.extra["group"]
    os.kill(group, signal.SIGSEGV)
    assert sk.wait(5) == 128 + signal.SIGSEGV, sk.logs()[-3000:]
    assert "llama-server exited with code 139 while serving" in sk.logs(), sk.logs()[-3000:]
    assert "Traceback" not in sk.logs()
    assert wait_until(partial(gone, group), 1.0, interval=0.01), group_members(group)
    assert not left_behind(save_dir, sk.pid), left_behind(save_dir, sk.pid)
    sk = start(family_start, mode, save_dir=save_dir)
    assert chat.reused_enough(chat.turn(sk.port)), sk.logs()[-3000:]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_second_slotkeeper_on_one_directory_starts_nothing_and_the_first_goes_on(family_start, tmp_path, mode):
    """A second slotkeeper on a --slot-save-path in use: one line, exit 2, no llama-server (nor watch) of its
    own, nothing left behind; the first serves on and saves at its stop."""
    save_dir = tmp_path / "cache"
    first = start(family_start, mode, save_dir=save_dir)
    chat = Chat(0, FAMILY.request)
    chat.turn(first.port)
    second = family_start(FAMILY, "-np", "1", env=MODES[mode], save_dir=save_dir, wait=False)
    assert second.wait(15) == 2, second.logs()
    assert second.logs().strip().splitlines() == [
        f"slotkeeper: error: slot save directory {save_dir.resolve()} is in use by another slotkeeper "
        f"(pid {first.pid}); give each running model its own --slot-save-path"
    ]
    assert not llama_servers_of(second.pid) and no_runtime_dir(second.pid)
    assert chat.reused_enough(chat.turn(first.port)), first.logs()[-3000:]
    group = first.extra["group"]
    swap_out(first)
    assert " saved from slot 0 (at stop)" in first.logs(), first.logs()[-3000:]
    assert wait_until(partial(gone, group), 1.0, interval=0.01), group_members(group)
    assert not left_behind(save_dir, first.pid), left_behind(save_dir, first.pid)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_long_tmpdir_puts_the_socket_in_tmp_and_leaves_nothing(family_start, tmp_path, mode):
    """A $TMPDIR too long for a unix socket's path (104 bytes on macOS, 108 on Linux): llama-server's socket goes
    in /tmp, the chat comes back after a stop, and the runtime directory is gone with the run."""
    long_tmp = tmp_path / ("t" * (120 - len(str(tmp_path))))
    long_tmp.mkdir()
    save_dir = tmp_path / "cache"
    chat = Chat(0, FAMILY.request)
    sk = start(family_start, mode, save_dir=save_dir, env={"TMPDIR": str(long_tmp)})
    assert f"llama-server on unix:/tmp/slotkeeper-{sk.pid}-" in sk.logs(), sk.logs()[-2000:]
    chat.turn(sk.port)
    swap_out(sk)
    assert no_runtime_dir(sk.pid) and not list(long_tmp.iterdir())
    sk = start(family_start, mode, save_dir=save_dir, env={"TMPDIR": str(long_tmp)})
    assert chat.reused_enough(chat.turn(sk.port)), sk.logs()[-3000:]
