"""Entries: a saved conversation state as a pair of files, and the one rule for what slotkeeper makes of a pair.

An entry is `<id>.bin` (llama-server's slot file, byte for byte) and `<id>.json` (its manifest, written last:
the commit). The store writes and opens them, the shared tier uploads and adopts them, and `slotkeeper ls` /
`prune` look at them without a running server. All three read pairs through this module, so that `ls` says of
an entry exactly what the next start does with it: `judge()` is the store's rule itself, not a copy of it.

Only the stdlib, xxhash (the content checksum) and slotkeeper's stdlib-only modules are imported here: the
command line (`cmdline`) needs the cache root before llama-server starts, and `slotkeeper ls` needs no HTTP stack.

One rule for links: a symbolic link (or anything but a regular file) in entries/ is never followed, read or
used, and left as it is. A store that followed a `.bin` linked to `/etc/passwd` would hand it to llama-server.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from ..chat.prefix import BLOCK_TOKENS, KeyChain
from .blocks import Parts
from .durable import PARTIAL_SUFFIX as PARTIAL_SUFFIX
from .durable import discard as discard
from .durable import fsync_path as fsync_path
from .durable import read_json as read_json
from .durable import write_json_atomic as write_json_atomic
from .fingerprint import first_difference, shareable
from .statefile import SEQ_MAGIC

BIN_SUFFIX = ".bin"
MANIFEST_SUFFIX = ".json"
MANIFEST_VERSION = 2  # an entry kept as one file, as every slotkeeper before blocks wrote it
BLOCKS_MANIFEST_VERSION = 3  # an entry kept as blocks: a slotkeeper before them sees it as unreadable and keeps it
MANIFEST_VERSIONS = (MANIFEST_VERSION, BLOCKS_MANIFEST_VERSION)
TRANSIENT_PREFIX = "slotkeeper-"  # + 32 random hex digits: unguessable, so no client can name it either
TRANSIENT_NAME = re.compile(rf"{TRANSIENT_PREFIX}[0-9a-f]{{32}}\{BIN_SUFFIX}")  # only these are slotkeeper's


# ---- where entries live -----------------------------------------------------------------------------------------


def pair_paths(folder: Path, name: str) -> tuple[Path, Path]:
    """`<name>.bin` and `<name>.json` in `folder` (entries, quarantined pairs and slot files are all named so)."""
    return folder / f"{name}{BIN_SUFFIX}", folder / f"{name}{MANIFEST_SUFFIX}"


def is_slot_name(stem: str) -> bool:
    """The slot-file layout's names (`<digits>.bin` / `<digits>.json`), which the store takes over as entries."""
    return stem.isascii() and stem.isdigit()


def is_state_file(path: Path) -> bool:
    """Whether a file starts with llama.cpp's seq-state magic: a client's own slot file, under any name."""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return int.from_bytes(f.read(4), "little") == SEQ_MAGIC
    return False


def file_size(path: Path) -> int | None:
    """The size of a regular file, never following a link; None when it is gone, a link or not a file."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def is_link(path: Path) -> bool:
    """Whether a name in a store is a link or anything else but a regular file (never followed: see above)."""
    try:
        return not stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False  # gone


# ---- the content checksum -----------------------------------------------------------------------------------------

CHECKSUM_ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20


def file_checksum(path: Path) -> str:
    """`xxh3_128:<hex>` of a file's bytes: taken when an entry is saved, checked before it is restored.

    xxh3 is not cryptographic: it guards against rot and truncation, not against someone who can write the
    store (who could write a manifest as well). It hashes at memory speed, so the check costs a small share of
    the restore it guards. The file is read in place into one reused buffer.
    """
    digest = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # a link is never followed (ELOOP)
    try:
        # No larger than the file: zero-filling 8 MB cost the check of a 68 KB entry 3-8 ms, its read < 0.2 ms.
        view = memoryview(bytearray(min(_CHUNK, os.fstat(fd).st_size + 1)))
        while n := os.readv(fd, [view]):
            digest.update(view[:n])
    finally:
        os.close(fd)
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}"


def read_manifest(path: Path | str) -> dict[str, Any] | None:
    """A manifest of a version this slotkeeper reads, or None (missing, damaged, or another version's: never
    used)."""
    data = read_json(path)
    return data if data is not None and data.get("version") in MANIFEST_VERSIONS else None


def remove_pair(directory: Path, name: str) -> None:
    """Remove `<name>.json`, then `<name>.bin` (either may be missing; other errors raise).

    Manifest first: a crash in between leaves an uncommitted file, removed at the next start, never a manifest
    naming a file that is gone. Used by the store and by `slotkeeper prune` (entries, quarantined pairs and
    slot-file pairs are all named this way).
    """
    bin_path, manifest_path = pair_paths(directory, name)
    manifest_path.unlink(missing_ok=True)
    bin_path.unlink(missing_ok=True)


# ---- the manifest -------------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Entry:
    """One saved conversation state and what its manifest says about it."""

    id: str
    n_tokens: int
    nbytes: int
    keys: Sequence[str]  # block keys (a prefix.KeyChain once indexed)
    saved_at: float
    last_used: float
    fingerprint: dict[str, Any]
    seq_version: int
    layout: str
    server: dict[str, Any] = field(default_factory=dict)
    # the keys of the request's settings and messages that led to it (placement.request.message_keys_of); its
    # manifest keeps them as "units"
    message_keys: Sequence[str] = field(default_factory=list)
    save_ms: float | None = None
    exact: str = ""  # prefix.exact_key of all its tokens ("" in manifests older than this field)
    boundary: bool = False  # saved at a turn boundary: a prefix of what its chat's next request sends
    opening: bool = False  # a shared opening (system prompt, tools): what new chats start from, not a chat
    uses: int = 0  # openings: the chats that started from it
    checksum: str = ""  # file_checksum() of its file ("" in manifests older than this field: not checked)
    images: Sequence[tuple[str, int]] = ()  # each picture in it: llama-server's image id, positions
    image_wrap: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # media.Wrap of its pictures, when known
    # the vocabulary and shape of the model that saved it (model.model_vocabulary; "" in older manifests):
    # another file of that model (re-quantized) reads its tokens alike, so it can recompute the state
    vocabulary: str = ""
    # how its file is made of blocks (blocks.py); None: kept as one file, entries/<id>.bin
    parts: Parts | None = None

    def manifest(self) -> dict[str, Any]:
        data = {
            "version": MANIFEST_VERSION if self.parts is None else BLOCKS_MANIFEST_VERSION,
            "id": self.id,
            "tokens": self.n_tokens,
            "bytes": self.nbytes,
            "saved_at": self.saved_at,
            "last_used": self.last_used,
            "save_ms": self.save_ms,
            "fingerprint": self.fingerprint,
            "format": {"seq_version": self.seq_version, "layout": self.layout},
            "llama_server": self.server,
            "block_tokens": BLOCK_TOKENS,
            "blocks": list(self.keys),
            "units": list(self.message_keys),
            "exact": self.exact,
            "boundary": self.boundary,
            "opening": self.opening,
            "uses": self.uses,
            "checksum": self.checksum,
            "images": [list(image) for image in self.images],
            "image_wrap": None if self.image_wrap is None else [list(part) for part in self.image_wrap],
            "vocabulary": self.vocabulary,
        }
        if self.parts is not None:
            data["parts"] = self.parts.to_json()
        return data

    @classmethod
    def from_manifest(cls, data: Mapping[str, Any]) -> Entry:
        if data.get("block_tokens", BLOCK_TOKENS) != BLOCK_TOKENS:
            raise ValueError(f"prefix keys of {data.get('block_tokens')}-token blocks, not {BLOCK_TOKENS}")
        fmt = data.get("format") or {}
        return cls(
            id=str(data["id"]),
            n_tokens=int(data["tokens"]),
            nbytes=int(data["bytes"]),
            keys=_chain(data["blocks"]),
            saved_at=float(data.get("saved_at", 0)),
            last_used=float(data.get("last_used", data.get("saved_at", 0))),
            fingerprint=_mapping(data.get("fingerprint")),
            seq_version=int(fmt.get("seq_version", 0)),
            layout=str(fmt.get("layout", "")),
            server=_mapping(data.get("llama_server")),
            message_keys=_chain(data.get("units") or []),
            save_ms=data.get("save_ms"),
            exact=str(data.get("exact") or ""),
            boundary=bool(data.get("boundary", False)),
            opening=bool(data.get("opening", False)),
            uses=int(data.get("uses") or 0),
            checksum=str(data.get("checksum") or ""),
            images=_images(data.get("images")),
            image_wrap=_wrap(data.get("image_wrap")),
            vocabulary=str(data.get("vocabulary") or ""),
            parts=Parts.from_json(data["parts"]) if data.get("parts") is not None else None,
        )

    @property
    def short(self) -> str:
        return self.id[:4]


def _images(value: Any) -> tuple[tuple[str, int], ...]:
    """A manifest's pictures, `[[id, positions], ...]` (none in manifests older than the field)."""
    if not isinstance(value, list):
        return ()
    return tuple((str(item[0]), int(item[1])) for item in value if isinstance(item, list) and len(item) == 2)


def _wrap(value: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(part, list) for part in value)):
        return None
    return tuple(int(t) for t in value[0]), tuple(int(t) for t in value[1])


def _mapping(value: Any) -> dict[str, Any]:
    """A manifest's object, as it is (a manifest is read fresh for its entry, or shared by the manifest cache
    between entries of one configuration: never changed in place)."""
    return value if isinstance(value, dict) else dict(value or {})


def _chain(keys: Any) -> Sequence[str]:
    """A manifest's key list, packed (a KeyChain, as the manifest cache gives it, stays one)."""
    if isinstance(keys, KeyChain):
        return keys
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError("keys are a list of strings")
    return KeyChain(keys)


def parse_entry(data: Mapping[str, Any]) -> tuple[Entry | None, str]:
    """The entry a manifest describes, or None and why not (in words)."""
    try:
        return Entry.from_manifest(data), ""
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"its manifest is not usable ({exc!r})"


def compatible_format(entry: Entry, current: tuple[int, str] | None) -> bool:
    """Can this llama-server read the file? (seq-state version equal; b11434 also reads plain token lists)."""
    if current is None:
        return True  # unknown: llama-server will say
    version, layout = current
    return entry.seq_version == version and (entry.layout == "plain" or entry.layout == layout)


# ---- the judgement ----------------------------------------------------------------------------------------------


class Status(enum.StrEnum):
    """What slotkeeper makes of a pair of files it finds; the values are `slotkeeper ls --json`'s status codes."""

    # judge(): a pair in entries/, as the next start (or the adoption of a download) treats it
    USABLE = "usable"
    OTHER_CONFIGURATION = "other_configuration"  # kept, not used: its fingerprint is not this configuration's
    OTHER_FORMAT = "other_format"  # kept, not used: this llama-server cannot read its state format
    WRONG_SIZE = "size_mismatch"  # quarantined
    NO_BIN = "no_bin"  # a manifest whose file is gone: the manifest is dropped
    BAD_MANIFEST = "bad_manifest"  # kept as it is, never used (damaged, or another slotkeeper version's)
    INTERRUPTED_SAVE = "interrupted_save"  # a file without a manifest: removed
    LINK = "link"  # a link (or not a regular file) under an entry's name: never followed, left as it is
    # the other places a pair may lie
    QUARANTINED = "quarantined"  # quarantine/: moved aside, never used again
    SLOT_FILE = "slot_file"  # <n>.bin + <n>.json of the slot-file layout: taken over at the next start
    SLOT_FILE_UNVERIFIED = "slot_file_unverified"  # <n>.bin without a manifest: only with --restore-unverified
    SLOT_FILE_UNREADABLE = "slot_file_unreadable"  # left as it is
    SLOT_MANIFEST_ONLY = "slot_manifest_only"  # left as it is
    SHARED = "shared"  # a valid entry of the shared tier, in the namespace its fingerprint names
    REMOTE_BAD_MANIFEST = "remote_bad_manifest"  # never fetched
    OTHER_NAMESPACE = "other_namespace"  # in another namespace than its fingerprint's: a fetch rejects it


@dataclass(frozen=True)
class Verdict:
    """judge()'s answer: the status, the reason in words (as the store logs it), and the entry when readable."""

    status: Status
    reason: str = ""
    entry: Entry | None = None
    difference: str = ""  # OTHER_CONFIGURATION: the first field that differs, `field: saved -> current`


def judge(
    manifest: Mapping[str, Any] | Entry | None,
    size: int | None,
    fingerprint: dict[str, Any] | None = None,
    current_format: tuple[int, str] | None = None,
    *,
    committed: bool = True,
    link: bool = False,
) -> Verdict:
    """What slotkeeper makes of the pair `entries/<id>.bin` + `entries/<id>.json`; pure, so that every reader
    of a store (ConversationStore.open and adopt, `slotkeeper ls`) judges alike.

    `manifest` is read_manifest()'s answer (None: unreadable) or the Entry it describes (the manifest cache's),
    `committed` whether there is a manifest file at
    all, `size` the .bin's (None: missing). `fingerprint` and `current_format` are the configuration and the
    state format it is judged against; None leaves that check out (not known yet). `link`: either name is a
    link or not a regular file (is_link), whatever it points to.
    """
    if link:
        return Verdict(Status.LINK, "a link, not a file: never followed, left as it is")
    if not committed:
        return Verdict(Status.INTERRUPTED_SAVE, "a file without a manifest: an interrupted save")
    if manifest is None:
        return Verdict(Status.BAD_MANIFEST, "a manifest this slotkeeper cannot read")
    entry, problem = (manifest, "") if isinstance(manifest, Entry) else parse_entry(manifest)
    as_blocks = entry.parts is not None if entry is not None else isinstance(manifest, Mapping) and "parts" in manifest
    if as_blocks:
        pass  # kept as blocks, no file of its own: a block missing or changed is found when it is restored
    elif size is None:
        return Verdict(Status.NO_BIN, "a manifest without its file", entry)
    if entry is None:
        return Verdict(Status.BAD_MANIFEST, problem)
    if entry.parts is None and size != entry.nbytes:
        return Verdict(Status.WRONG_SIZE, f"size {size} differs from its manifest's {entry.nbytes}", entry)
    if fingerprint is not None and entry.fingerprint is not fingerprint and entry.fingerprint != fingerprint:
        difference = first_difference(shareable(entry.fingerprint), shareable(fingerprint))
        if difference:
            return Verdict(
                Status.OTHER_CONFIGURATION, f"saved for another configuration: {difference}", entry, difference
            )
    if not compatible_format(entry, current_format):
        return Verdict(Status.OTHER_FORMAT, "saved in another state format", entry)
    return Verdict(Status.USABLE, "", entry)
