"""What run mode reads of its store while llama-server loads the model: the listing, and the index it guesses.

Why: a store of 20,000 entries took a second to open once llama-server answered healthy, all of it added to
the time until ready, while the model's load left a core idle. Listing entries/ and reading the manifest cache
need no configuration, and the index needs only the one the entries were saved for, which is the last run's
in all but the run after a change of flags: the most recently used entry's fingerprint is taken as this run's.
The store's open (ConversationStore.open) then takes that index when the guess was right, and judges only the
pairs it left; when it was wrong, it judges every pair as before: the guess costs time, never a verdict.
Nothing here removes or moves an entry, but what scan_entries removes (partial files, interrupted saves).

It also asks the kernel to read the files of the chats the start will restore (`prefetch`): after a reboot
or a long while, reading a large chat's file from the disk (0.1 s for 215 MB here) came after llama-server's
load, on the path to ready; read ahead meanwhile, it overlaps the load.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..portable import available_memory, read_ahead
from .blockfiles import block_path
from .blocks import Parts
from .entries import BIN_SUFFIX, Entry, Status, judge
from .index import EntryIndex
from .layout import BLOCKS_DIR, ENTRIES_DIR
from .scan import Found, scan_entries

READ_AHEAD_STEP = 128 << 10  # bytes per read-ahead request (prefetch): the smallest device read-ahead in use
Pair = tuple[str, dict[str, Any] | Entry, int | None]


@dataclass
class Prescan:
    """scan_entries' listing, and the usable entries indexed against the guessed configuration."""

    found: Found
    index: EntryIndex | None = None  # None: no entry says which configuration saved it
    rest: list[Pair] = field(default_factory=list)  # the pairs the index left: judged by the store's open


def prescan(root: Path, server: dict[str, Any], slots: int) -> Prescan:
    """In a thread, at the spawn: list the store, read ahead the files of its `slots` most recent chats, and
    index what the last run's configuration can use (`server`: this run's llama-server identity,
    store.server_identity). None of this makes cycles: run mode keeps the collector off until it is done
    (cli.run), so that no collection walks the entries as they are built."""
    found = scan_entries(root)
    recent = recent_chats(found.pairs, slots)
    reading = threading.Thread(
        target=prefetch, args=(chat_files(root, found.pairs, recent), prefetch_budget()), daemon=True
    )
    reading.start()
    guess = last_fingerprint(found.pairs)
    if guess is None:
        return Prescan(found)
    index = EntryIndex(guess, server)
    rest: list[Pair] = []
    for entry_id, data, size in found.pairs:
        verdict = judge(data, size, guess)
        if verdict.status is Status.USABLE and verdict.entry is not None:
            index.index(verdict.entry)
        else:
            rest.append((entry_id, data, size))
    return Prescan(found, index, rest)


def recent_chats(pairs: Sequence[Pair], count: int) -> list[str]:
    """The ids of the `count` most recently used chats, most recent first: the entries a start restores when
    they fit this run (openings are restored on demand, not at start)."""

    def recency(pair: Pair) -> float:
        data = pair[1]
        if isinstance(data, Entry):
            return -1.0 if data.opening else data.last_used
        used = data.get("last_used", data.get("saved_at"))
        return -1.0 if data.get("opening") or not isinstance(used, (int, float)) else float(used)

    ranked = heapq.nlargest(count, ((recency(pair), pair[0]) for pair in pairs))
    return [entry_id for used, entry_id in ranked if used >= 0]


def chat_files(root: Path, pairs: Sequence[Pair], entry_ids: list[str]) -> list[list[Path]]:
    """Per entry, in the order given, the files a restore reads: its blocks (each once), or its one file
    (an entry of a store before blocks, or a manifest that does not say)."""
    ids = set(entry_ids)
    wanted = {entry_id: data for entry_id, data, _ in pairs if entry_id in ids}
    files = []
    for entry_id in entry_ids:
        data = wanted.get(entry_id)
        parts: Parts | None = None
        try:
            if isinstance(data, Entry):
                parts = data.parts
            elif isinstance(data, dict) and data.get("parts") is not None:
                parts = Parts.from_json(data["parts"])
        except (KeyError, TypeError, ValueError):
            parts = None  # (its verdict is the store's open's: here it is only not read ahead as blocks)
        if parts is None:
            files.append([root / ENTRIES_DIR / f"{entry_id}{BIN_SUFFIX}"])
        else:
            files.append([block_path(root / BLOCKS_DIR, name) for name in parts.block_sizes()])
    return files


def prefetch(chats: list[list[Path]], budget: int) -> int:
    """Start reading these chats' files into the page cache (POSIX_FADV_WILLNEED), as many chats as fit in
    `budget` bytes; returns how many were asked for. A guess that misses costs a read, never a verdict.

    The budget (`prefetch_budget`) keeps the chats from pushing the model, which llama-server is reading at
    the same time, out of a page cache too small for both.

    One call per READ_AHEAD_STEP: the kernel reads at most the device's read-ahead size per call (8 MiB here,
    128 KiB on many disks), so one call for the whole file read its first 8 MiB only. Queued this way, a 213 MB
    file was in the page cache in ~0.15 s, where reading it through took ~0.3 s; the calls block ~50 ms while
    the reads are queued, hence a thread of their own (`prescan`)."""
    asked = 0
    for files in chats:
        opened: list[tuple[int, int]] = []
        try:
            for path in files:
                with contextlib.suppress(OSError):  # (missing: the restore says so, not this)
                    fd = os.open(path, os.O_RDONLY)
                    opened.append((fd, os.fstat(fd).st_size))
            size = sum(n for _, n in opened)
            if size > budget:
                continue
            budget -= size
            for fd, n in opened:
                for offset in range(0, n, READ_AHEAD_STEP):
                    if not read_ahead(fd, offset, READ_AHEAD_STEP):
                        return asked  # no posix_fadvise here: nothing is read ahead
            asked += 1
        except OSError:  # a file system that cannot read ahead: the restore reads the files as before
            pass
        finally:
            for fd, _ in opened:
                os.close(fd)
    return asked


def prefetch_budget() -> int:
    """A quarter of the memory the kernel could give to new data without swapping (portable.available_memory);
    0, so that nothing is read ahead, when it does not say."""
    return (available_memory() or 0) // 4


def last_fingerprint(pairs: list[Pair]) -> dict[str, Any] | None:
    """The fingerprint of the most recently used entry (the last run's configuration), if any says one."""
    newest, found = float("-inf"), None
    used: Any
    fingerprint: Any
    for _, data, _ in pairs:
        if isinstance(data, Entry):
            used, fingerprint = data.last_used, data.fingerprint
        else:
            used, fingerprint = data.get("last_used", data.get("saved_at")), data.get("fingerprint")
        if isinstance(fingerprint, dict) and isinstance(used, (int, float)) and used > newest:
            newest, found = used, fingerprint
    return found
