"""What `ls` says about each status: its words in the status column, the status in full, and which statuses
carry a fingerprint worth comparing.

One table apart from the rows, because the rows (their status column), match (what cannot be compared) and
prune (what --other-configs may remove) all read it, and a status's words should be said in one place.
"""

from __future__ import annotations

from ..store.entries import Status

# What `ls` shows for each status: the status column, and the status in full (`ls --json`'s "reason") where
# the row has nothing more precise to say.
WORDS: dict[Status, tuple[str, str]] = {
    Status.USABLE: ("usable", ""),
    Status.OTHER_CONFIGURATION: ("other configuration", ""),
    Status.OTHER_FORMAT: ("other state format", ""),
    Status.WRONG_SIZE: ("size mismatch (quarantined at start)", ""),
    Status.NO_BIN: ("no .bin (manifest dropped at start)", "a manifest without its file: dropped at the next start"),
    Status.BAD_MANIFEST: ("bad manifest (never used)", "a manifest slotkeeper cannot read: its entry is never used"),
    Status.INTERRUPTED_SAVE: (
        "interrupted save (removed at start)",
        "a file without a manifest: an interrupted save, removed at the next start",
    ),
    Status.LINK: ("link (never followed)", "a link or not a file under an entry's name: never followed, left as it is"),
    Status.QUARANTINED: ("quarantined", "moved aside: llama-server refused it or its size was wrong"),
    Status.SLOT_FILE: (
        "slot file (taken over at next start)",
        "a slot file of the slot-file layout: taken over at the next start",
    ),
    Status.SLOT_FILE_UNVERIFIED: (
        "no manifest (--restore-unverified)",
        "a slot file without a manifest: taken over only with --restore-unverified",
    ),
    Status.SLOT_FILE_UNREADABLE: (
        "unreadable slot file (left as it is)",
        "not a slot file slotkeeper can read: left as it is",
    ),
    Status.SLOT_MANIFEST_ONLY: ("manifest without its .bin", "a slot-file manifest without its .bin: left as it is"),
    Status.SHARED: ("shared", ""),
    Status.REMOTE_BAD_MANIFEST: ("bad manifest (never used)", "a manifest slotkeeper cannot read: never fetched"),
    Status.OTHER_NAMESPACE: (
        "other namespace (never used)",
        "its fingerprint belongs to another namespace: a fetch rejects it",
    ),
}
# Rows with a fingerprint that the next start (or a fetch) would compare with its configuration.
COMPARABLE = frozenset(
    {Status.USABLE, Status.OTHER_CONFIGURATION, Status.OTHER_FORMAT, Status.SLOT_FILE, Status.SHARED}
)
