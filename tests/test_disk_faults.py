"""What a real machine's disk does to a store, on the real llama-server: it fills up, and files rot or are
replaced by links. Each test asserts what the user sees: one line in the log, nothing left behind, the next
save succeeding once the disk allows, and a chat's answer never changed by a bad file.

The full-disk tests mount a small tmpfs (root only: CI runs as root; elsewhere they skip and say why).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from family_helpers import FAMILIES, Chat, answer, same_answer, swap_out
from store_helpers import block_files, blocks_dir, entry_parts, only_files_of, read_manifest

from slotkeeper.store.blockfiles import block_path
from slotkeeper.store.layout import ENTRIES_DIR, QUARANTINE_DIR, SNAPSHOTS_DIR
from slotkeeper.testing.harness import http_call, stream_completion, wait_until

LLAMA = FAMILIES["llama"]
AUTOSAVE = ("--autosave-idle", "1")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs (16 MiB, 64 inodes) for a save directory: a disk that fills up for real."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,nr_inodes=64", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def store_files(save_dir: Path) -> dict[str, list[str]]:
    """Everything in the store's folders, by folder (the lock aside)."""
    return {
        name: sorted(p.name for p in (save_dir / name).iterdir())
        for name in (ENTRIES_DIR, SNAPSHOTS_DIR)
        if (save_dir / name).is_dir()
    }


def entry_ids(save_dir: Path) -> list[str]:
    return sorted(p.stem for p in (save_dir / ENTRIES_DIR).glob("*.json"))


def chat_entry(save_dir: Path) -> str:
    """The chat's own entry (not its shared opening, which is saved too)."""
    chats = [
        i for i in entry_ids(save_dir) if not json.loads((save_dir / ENTRIES_DIR / f"{i}.json").read_text())["opening"]
    ]
    assert len(chats) == 1, chats
    return chats[0]


def free_inodes(path: Path) -> int:
    return os.statvfs(path).f_favail


def fill_inodes(path: Path, leave: int) -> list[Path]:
    """Empty files until only `leave` inodes are free: the next files created after those fail with ENOSPC."""
    folder = path / "filler"
    folder.mkdir(exist_ok=True)
    made: list[Path] = []
    while free_inodes(path) > leave:
        made.append(folder / f"f{len(made)}")
        made[-1].touch()
    return made


def fill_bytes(path: Path) -> Path:
    """One file that takes every free byte."""
    filler = path / "filler.bin"
    with open(filler, "wb", buffering=0) as f:
        for piece in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * piece)
    assert os.statvfs(path).f_bavail == 0
    return filler


def test_disk_full_at_the_manifest_leaves_nothing_and_the_next_save_succeeds(family_start, tmpfs):
    """1. The slot file fits (llama-server writes it to RAM), what the store writes of it does not (ENOSPC: one
    inode left, which its first new block takes): one line, no orphan block and no .partial left, and once
    the disk has room the next autosave commits."""
    save_dir = tmpfs / "cache"
    sk = family_start(LLAMA, "-np", "1", own=AUTOSAVE, save_dir=save_dir)
    chat = Chat(1, LLAMA.request)
    chat.turn(sk.port)
    assert wait_until(lambda: entry_ids(save_dir), 20), sk.logs()
    first = entry_ids(save_dir)
    fillers = fill_inodes(tmpfs, leave=1)
    chat.turn(sk.port)
    assert wait_until(lambda: "No space left on device" in sk.logs(), 20), sk.logs()
    line = [ln for ln in sk.logs().splitlines() if "No space left on device" in ln]
    assert len(line) == 1 and "slot 0 not saved (idle): No space left on device" in line[0], line
    assert "Traceback" not in sk.logs()
    assert entry_ids(save_dir) == first, "the previous entry is kept, and nothing new half-committed"
    files = store_files(save_dir)
    assert only_files_of(save_dir, *first), (files, block_files(save_dir))
    assert files[SNAPSHOTS_DIR] == [], files
    for filler in fillers:
        filler.unlink()
    chat.turn(sk.port)
    assert wait_until(lambda: entry_ids(save_dir) and entry_ids(save_dir) != first, 20), sk.logs()
    swap_out(sk)
    assert not [n for n in store_files(save_dir)[ENTRIES_DIR] if n.endswith(".partial")]


def test_disk_full_for_the_slot_file_leaves_nothing_and_the_stop_exits_0(family_start, tmpfs):
    """1. No byte free: llama-server's own write of the slot file fails. One line, its half-written file is
    removed, the stop still exits 0; after the swap the chat's earlier entry is still there."""
    save_dir = tmpfs / "cache"
    sk = family_start(LLAMA, "-np", "1", own=AUTOSAVE, save_dir=save_dir)
    chat = Chat(2, LLAMA.request)
    chat.turn(sk.port)
    assert wait_until(lambda: entry_ids(save_dir), 20), sk.logs()
    first = entry_ids(save_dir)
    filler = fill_bytes(tmpfs)
    chat.turn(sk.port)
    sk.killpg(signal.SIGTERM)
    assert sk.wait(60) == 0, sk.logs()
    assert "slot 0 not saved" in sk.logs() and "Traceback" not in sk.logs(), sk.logs()
    assert entry_ids(save_dir) == first
    assert store_files(save_dir)[SNAPSHOTS_DIR] == [], "llama-server's half-written file was left behind"
    filler.unlink()


def test_a_rotten_entry_is_quarantined_and_the_answer_is_a_cold_runs(family_start, tmp_path):
    """3. 4,096 bytes flipped in the middle of a saved entry, same size: the next start quarantines it with
    one line (its checksum), restores nothing, and the chat answers as a cold llama-server does."""
    sk = family_start(LLAMA, "-np", "1")
    chat = Chat(3, LLAMA.request, system="Be brief.")  # no opening saved: nothing else is restored into the slot
    chat.turn(sk.port)
    swap_out(sk)
    save_dir = sk.extra["save_dir"]
    entry = chat_entry(save_dir)
    parts = entry_parts(save_dir, entry)
    assert parts is not None
    path = block_path(blocks_dir(save_dir), parts.sections[0].blocks[len(parts.sections[0].blocks) // 2])
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(b ^ 0xFF for b in data[middle : middle + 4096])
    path.write_bytes(bytes(data))

    sk2 = family_start(LLAMA, "-np", "1")
    line = f"entry {entry[:4]} quarantined (its file changed on disk: 1 of its blocks no longer holds what it was"
    assert sk2.logs().count(line) == 1, sk2.logs()
    assert "restored into slot" not in sk2.logs()
    warm = answer(sk2.port, chat, chat.messages)
    assert sorted(p.name.split("-", 2)[-1] for p in (save_dir / QUARANTINE_DIR).iterdir()) == [f"{entry}.json"]
    assert not path.exists(), "the changed block stayed in the store"
    swap_out(sk2)
    cold_sk = family_start(LLAMA, "-np", "1", save_dir=tmp_path / "cold")
    cold = answer(cold_sk.port, chat, chat.messages)
    assert same_answer(warm, cold, 1e-6), (warm, cold)


def test_a_linked_entry_is_never_followed(family_start):
    """4. An entry's .bin linked to /etc/passwd, with a manifest of the right size: the start says so in one
    line, never hands it to llama-server (nothing linked into snapshots/), quarantines nothing, and leaves
    the link as it is; the genuine entry beside it is restored as usual."""
    sk = family_start(LLAMA, "-np", "1")
    chat = Chat(4, LLAMA.request)
    chat.turn(sk.port)
    swap_out(sk)
    save_dir = sk.extra["save_dir"]
    entry = chat_entry(save_dir)
    manifest = json.loads((save_dir / ENTRIES_DIR / f"{entry}.json").read_text())
    target = Path("/etc/passwd")
    fake = "f" * 16
    manifest.update(id=fake, bytes=target.stat().st_size, last_used=manifest["last_used"] + 100)
    (save_dir / ENTRIES_DIR / f"{fake}.json").write_text(json.dumps(manifest))
    (save_dir / ENTRIES_DIR / f"{fake}.bin").symlink_to(target)

    sk2 = family_start(LLAMA, "-np", "1")
    assert (
        f"1 entry in {save_dir / ENTRIES_DIR} is a link or not a file: never followed, left as it is" in sk2.logs()
    ), sk2.logs()
    assert f"chat {entry[:4]} restored into slot 0" in sk2.logs(), sk2.logs()
    assert "quarantined" not in sk2.logs() and not (save_dir / QUARANTINE_DIR).exists()
    assert store_files(save_dir)[SNAPSHOTS_DIR] == []
    assert (save_dir / ENTRIES_DIR / f"{fake}.bin").is_symlink()
    assert chat.turn(sk2.port)["cache_n"] > 0
    swap_out(sk2)
    assert (save_dir / ENTRIES_DIR / f"{fake}.bin").is_symlink() and target.is_file()
    # `ls` says of it what the start did (one rule: entries.judge), and prune never removes it
    listed = {
        row["id"]: row for row in json.loads(catalog("ls_main", str(save_dir), "--json")) if row["kind"] == "entry"
    }
    assert listed[fake]["status"] == "link", listed[fake]
    catalog("prune_main", str(save_dir), "--older-than", "0s")
    assert (save_dir / ENTRIES_DIR / f"{fake}.bin").is_symlink() and target.is_file()


def catalog(command: str, *args: str) -> str:
    """`slotkeeper ls` or `prune` as a process: its output."""
    code = f"import sys; from slotkeeper.catalog.cli import {command}; sys.exit({command}(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_slot_of_long_replies_is_measured_before_its_save(family_start, tmpfs):
    """1. The free-space check counts what the slot holds (its prompt and the reply it generated: llama-server's
    n_prompt_tokens), not the prompt slotkeeper placed: with room for twice the first save but not for a slot of
    long replies, the save is refused up front, in one line, instead of filling the disk to its last byte."""
    save_dir = tmpfs / "cache"
    sk = family_start(LLAMA, "-np", "1", own=AUTOSAVE, save_dir=save_dir)
    prompt = " ".join(f"Note {i}: the disk may fill up." for i in range(15))
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0}
    assert http_call(sk.port, "POST", "/completion", body).status == 200
    assert wait_until(lambda: entry_ids(save_dir), 20), sk.logs()
    first = entry_ids(save_dir)
    size = read_manifest(save_dir, first[0])["bytes"]
    long_reply = {"prompt": prompt + " And more.", "n_predict": 1600, "ignore_eos": True, "temperature": 0}
    # streamed: a wait on its progress (beside busy neighbours llama-server's own decode of 1,600 tokens took
    # longer than any fixed bound on the whole reply)
    timings = stream_completion(sk.port, long_reply, timeout=120).timings
    assert timings["predicted_n"] >= 4 * (timings["prompt_n"] + timings["cache_n"]), timings
    free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
    filler = tmpfs / "filler.bin"
    with open(filler, "wb") as f:
        f.truncate(0)
        os.posix_fallocate(f.fileno(), 0, free - 2 * size)
    assert wait_until(lambda: "slot 0 not saved (idle)" in sk.logs(), 20), sk.logs()
    line = next(ln for ln in sk.logs().splitlines() if "slot 0 not saved (idle)" in ln)
    assert "free in" in line and "needed" in line, line
    assert entry_ids(save_dir) == first and store_files(save_dir)[SNAPSHOTS_DIR] == []
