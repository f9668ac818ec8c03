"""Reading a slotkeeper save directory from a test: the committed entries, their manifests and tokens.

The layout (slotkeeper.store.layout): `entries/<id>.json` (an entry is committed once its manifest exists), and
for an entry kept as one file `entries/<id>.bin`; for one kept as blocks, its blocks in `blocks/`. `snapshots/`
(llama-server's --slot-save-path: clients' names and slotkeeper's transient `slotkeeper-<hex>.bin`),
`quarantine/`, and the `.lock`. Log lines name an entry by its first 4 hex digits.

The stub llama-server's files are not llama.cpp's memory layout: the store keeps each whole, as one block (its
skeleton), so `entry_bin` of a stub entry is that block, the entry's file byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash
from stub import decode_slot_file

from slotkeeper.store.blockfiles import assemble, block_path
from slotkeeper.store.blocks import Parts
from slotkeeper.store.entries import TRANSIENT_PREFIX
from slotkeeper.store.layout import BLOCKS_DIR, ENTRIES_DIR, QUARANTINE_DIR, SNAPSHOTS_DIR
from slotkeeper.store.statefile import read_header

RESTORED = re.compile(r"chat ([0-9a-f]{4}) restored into slot (\d+): ")
SAVED = re.compile(r"chat ([0-9a-f]{4}) saved from slot (\d+) \(([^)]*)\): ")


def entries_dir(save_dir: Path) -> Path:
    return save_dir / ENTRIES_DIR


def snapshots_dir(save_dir: Path) -> Path:
    return save_dir / SNAPSHOTS_DIR


def quarantine_dir(save_dir: Path) -> Path:
    return save_dir / QUARANTINE_DIR


def blocks_dir(save_dir: Path) -> Path:
    return save_dir / BLOCKS_DIR


def entry_parts(save_dir: Path, entry_id: str) -> Parts | None:
    """How an entry is made of blocks; None for one kept as one file."""
    data = json.loads(manifest_path(save_dir, entry_id).read_text()).get("parts")
    return None if data is None else Parts.from_json(data)


def entry_ids(save_dir: Path) -> list[str]:
    """The committed entries (a manifest, and its .bin unless it is kept as blocks), sorted."""
    root = entries_dir(save_dir)
    if not root.is_dir():
        return []
    return sorted(
        p.stem
        for p in root.glob("*.json")
        if (root / f"{p.stem}.bin").is_file() or json.loads(p.read_text()).get("parts") is not None
    )


def uncommitted(save_dir: Path) -> list[str]:
    """Entry files without a manifest (an interrupted save, removed at the next start) and partial manifests."""
    root = entries_dir(save_dir)
    if not root.is_dir():
        return []
    bins = [p.name for p in root.glob("*.bin") if not (root / f"{p.stem}.json").exists()]
    return sorted(bins + [p.name for p in root.glob("*.partial")])


def only_entry(save_dir: Path) -> str:
    ids = entry_ids(save_dir)
    assert len(ids) == 1, f"expected one entry in {entries_dir(save_dir)}, found {ids}"
    return ids[0]


def entry_bin(save_dir: Path, entry_id: str) -> Path:
    """The file holding an entry's bytes: its .bin, or, kept as blocks, its one block (a stub entry's: see
    above; an entry of several blocks has no such file: `entry_bytes`)."""
    parts = entry_parts(save_dir, entry_id) if manifest_path(save_dir, entry_id).exists() else None
    if parts is None:
        return entries_dir(save_dir) / f"{entry_id}.bin"
    assert not parts.sections, f"entry {entry_id} is made of {1 + sum(len(s.blocks) for s in parts.sections)} blocks"
    return block_path(blocks_dir(save_dir), parts.skeleton)


def entry_bytes(save_dir: Path, entry_id: str, scratch: Path) -> bytes:
    """An entry's file, put together from its blocks as a restore does (in `scratch`, removed after)."""
    parts = entry_parts(save_dir, entry_id)
    if parts is None:
        return entry_bin(save_dir, entry_id).read_bytes()
    dest = scratch / f"{entry_id}.assembled"
    assemble(blocks_dir(save_dir), parts, dest)
    try:
        return dest.read_bytes()
    finally:
        dest.unlink()


def manifest_path(save_dir: Path, entry_id: str) -> Path:
    return entries_dir(save_dir) / f"{entry_id}.json"


def read_manifest(save_dir: Path, entry_id: str) -> dict[str, Any]:
    return json.loads(manifest_path(save_dir, entry_id).read_text())


def edit_manifest(save_dir: Path, entry_id: str, change: Callable[[dict[str, Any]], None]) -> None:
    path = manifest_path(save_dir, entry_id)
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def entry_tokens(save_dir: Path, entry_id: str) -> list[int]:
    """The tokens of an entry, read the way slotkeeper reads them (seq-state header) and checked the way the
    stub's restore checks them (the whole file decodes and has the size its header implies)."""
    path = entry_bin(save_dir, entry_id)
    header = read_header(path)
    tokens = decode_slot_file(path.read_bytes())
    assert list(header.token_ids) == tokens, f"entry {entry_id}: header and stub disagree on its tokens"
    return tokens


def assert_entry_sound(save_dir: Path, entry_id: str) -> list[int]:
    """The entry's file and manifest agree and the file decodes: it would restore. Returns its tokens."""
    manifest = read_manifest(save_dir, entry_id)
    assert manifest["version"] == (2 if manifest.get("parts") is None else 3) and manifest["id"] == entry_id, manifest
    assert manifest["bytes"] == entry_bin(save_dir, entry_id).stat().st_size, manifest
    tokens = entry_tokens(save_dir, entry_id)
    assert manifest["tokens"] == len(tokens), manifest
    return tokens


def assert_store_sound(save_dir: Path) -> dict[str, list[int]]:
    """Every committed entry is sound; returns their tokens by id."""
    return {entry_id: assert_entry_sound(save_dir, entry_id) for entry_id in entry_ids(save_dir)}


def entry_files(save_dir: Path) -> list[str]:
    """Every file name in entries/ (committed or not)."""
    root = entries_dir(save_dir)
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def only_files_of(save_dir: Path, *ids: str) -> bool:
    """entries/ holds exactly these entries' files (a manifest, and a .bin for one kept as one file), and
    blocks/ exactly their blocks: nothing uncommitted, partial or stray beside them."""
    expected = []
    blocks: set[str] = set()
    for i in ids:
        expected.append(f"{i}.json")
        parts = entry_parts(save_dir, i) if manifest_path(save_dir, i).exists() else None
        if parts is None:
            expected.append(f"{i}.bin")
        else:
            blocks.update(parts.block_sizes())
    return entry_files(save_dir) == sorted(expected) and block_files(save_dir) == sorted(blocks)


def block_files(save_dir: Path) -> list[str]:
    """Every file in blocks/'s folders (blocks, partial or stray)."""
    root = blocks_dir(save_dir)
    return sorted(p.name for p in root.glob("*/*")) if root.is_dir() else []


def entries_snapshot(save_dir: Path) -> dict[str, bytes]:
    """Every file in entries/ and blocks/, byte for byte (to compare before and after)."""
    root = entries_dir(save_dir)
    files = {p.name: p.read_bytes() for p in sorted(root.iterdir())} if root.is_dir() else {}
    files.update({f"blocks/{p.name}": p.read_bytes() for p in sorted(blocks_dir(save_dir).glob("*/*"))})
    return files


def bins_snapshot(save_dir: Path) -> dict[str, bytes]:
    """Each committed entry's file, as `<id>.bin`: its own, or put together from its blocks (manifests record
    the last use, which a restore updates)."""
    with tempfile.TemporaryDirectory() as scratch:
        return {f"{i}.bin": entry_bytes(save_dir, i, Path(scratch)) for i in entry_ids(save_dir)}


def rewrite_entry(save_dir: Path, entry_id: str, data: bytes) -> None:
    """Make an entry's file `data` behind slotkeeper's back, consistently: kept as one block (its name the
    hash of `data`), its manifest's size and checksum those of `data`; its old blocks no other entry uses go."""
    old = entry_parts(save_dir, entry_id)
    assert old is not None, f"entry {entry_id} is kept as one file"
    name = xxhash.xxh3_128_hexdigest(data)
    path = block_path(blocks_dir(save_dir), name)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    parts = Parts(nbytes=len(data), block_cells=old.block_cells, skeleton=name, sections=())
    edit_manifest(
        save_dir,
        entry_id,
        lambda m: m.update(parts=parts.to_json(), bytes=len(data), checksum=f"xxh3_128:{name}"),
    )
    in_use = {b for i in entry_ids(save_dir) for b in (entry_parts(save_dir, i) or parts).block_sizes()}
    for block in old.block_sizes():
        if block not in in_use:
            block_path(blocks_dir(save_dir), block).unlink()


def staged_in_ram(pid: int) -> list[str]:
    """What the slotkeeper of this pid staged in RAM and left there (its RAM folders: store/staging.py)."""
    found = []
    for base in ("/dev/shm", os.environ.get("XDG_RUNTIME_DIR") or ""):
        if base and os.path.isdir(base):
            found += [str(p) for p in Path(base).glob(f"slotkeeper-{os.getuid()}-{pid}-*")]
    return found


def transients(save_dir: Path) -> list[str]:
    """slotkeeper's transient files in snapshots/ (a save in progress, or a restore's link)."""
    root = snapshots_dir(save_dir)
    return sorted(p.name for p in root.glob(f"{TRANSIENT_PREFIX}*")) if root.is_dir() else []


def restored(logs: str) -> list[tuple[str, int]]:
    """(entry short id, slot) of every `chat XXXX restored into slot N` line."""
    return [(m.group(1), int(m.group(2))) for m in RESTORED.finditer(logs)]


def saved(logs: str) -> list[tuple[str, int, str]]:
    """(entry short id, slot, why) of every `chat XXXX saved from slot N (why)` line."""
    return [(m.group(1), int(m.group(2)), m.group(3)) for m in SAVED.finditer(logs)]
