"""What decides whether a saved KV state fits the running llama-server.

llama-server's slot files record no model identity: it restores a file saved by a different model of the
same shape with HTTP 200 and then generates garbage. slotkeeper stores this fingerprint next to every file
it saves and restores only files whose fingerprint matches the running configuration.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from .durable import write_json_atomic

# The model's identity: its GGUF header and metadata (and the first tensors) plus its tail, not the whole
# multi-GB file. Two fine-tunes of one base differ in both regions; reading them costs milliseconds.
HEAD_BYTES = 8 * 1024 * 1024
TAIL_BYTES = 1024 * 1024
IDENTITY_CACHE_NAME = "model-identity.cache"  # in the save directory: the hashes of the last model files run
IDENTITY_CACHE_FILES = 8
SETTLED_NS = 2_000_000_000

# llama-server flags whose values change the layout or meaning of a slot's KV state.
KV_FLAGS: dict[str, tuple[str, ...]] = {
    "cache_type_k": ("-ctk", "--cache-type-k"),
    "cache_type_v": ("-ctv", "--cache-type-v"),
    "flash_attn": ("-fa", "--flash-attn"),
    "kv_unified": ("-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"),
    "swa_full": ("--swa-full",),
    "mmproj": ("-mm", "--mmproj"),
    "lora": ("--lora",),
}
BOOLEAN_KV_FLAGS = frozenset({"-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified", "--swa-full"})


def model_identity(path: str | None, remembered_in: Path | None = None) -> dict[str, Any]:
    """Resolved path, size and a hash of the head and tail of the model file.

    `remembered_in`: the save directory, whose identity cache gives the hash of a file unchanged since it was
    hashed, so that a start need not read 9 MB and hash it (~20 ms of CPU, beside llama-server's load). A file
    is unchanged while its device, inode, size, mtime and ctime are: any write, replacement or utime sets the
    ctime to the present, which nothing sets back. A file changed in the last SETTLED_NS is hashed each time,
    never remembered: a change within the same clock tick might keep its ctime."""
    if not path or not os.path.isfile(path):
        return {"model": path}
    resolved = Path(path).resolve()
    before = os.stat(resolved)
    stamp = _stamp(before)
    digest = _remembered(remembered_in, str(resolved), stamp) if remembered_in is not None else None
    if digest is None:
        digest = _head_and_tail_digest(resolved, before.st_size)
        settled = time.time_ns() - before.st_ctime_ns > SETTLED_NS
        if remembered_in is not None and settled and _stamp(os.stat(resolved)) == stamp:
            _remember(remembered_in, str(resolved), stamp, digest)
    return {"model": str(resolved), "model_size": before.st_size, "model_sha256": digest}


def _head_and_tail_digest(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
        if size > HEAD_BYTES:
            f.seek(max(HEAD_BYTES, size - TAIL_BYTES))
            digest.update(f.read(TAIL_BYTES))
    return digest.hexdigest()[:32]


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _remembered(save_dir: Path, model: str, stamp: list[int]) -> str | None:
    """The cached hash of `model` when its stamp is the one it was hashed with; None otherwise (or unreadable)."""
    try:
        with open(save_dir / IDENTITY_CACHE_NAME, encoding="utf-8") as f:
            known = json.load(f)["files"][model]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(known, list) and known[:-1] == stamp and isinstance(known[-1], str):
        return known[-1]
    return None


def _remember(save_dir: Path, model: str, stamp: list[int], digest: str) -> None:
    """Add `model`'s hash to the cache (the IDENTITY_CACHE_FILES most recent files), written whole or not at
    all; a cache that cannot be written only costs the next start a hash."""

    path = save_dir / IDENTITY_CACHE_NAME
    try:
        with open(path, encoding="utf-8") as f:
            files = dict(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        files = {}
    files.pop(model, None)
    kept = dict(list(files.items())[-(IDENTITY_CACHE_FILES - 1) :])
    kept[model] = [*stamp, digest]
    with contextlib.suppress(OSError):
        write_json_atomic(path, {"files": kept}, fsync=False)


def kv_flags(child_args: list[str]) -> dict[str, str]:
    """The KV-relevant llama-server flags as given (unset flags are absent: llama-server's defaults)."""
    found: dict[str, str] = {}
    for i, token in enumerate(child_args):
        if token.startswith("--"):
            token = token.replace("_", "-")  # llama-server reads `--cache_type_k` as `--cache-type-k`
        for field, names in KV_FLAGS.items():
            if token in names:
                if token in BOOLEAN_KV_FLAGS:
                    found[field] = token.lstrip("-")
                elif i + 1 < len(child_args):
                    found[field] = child_args[i + 1]
    return found


def build_fingerprint(
    identity: dict[str, Any], child_args: list[str], total_slots: int, n_ctx_slot: int | None
) -> dict[str, Any]:
    """Everything that must match for a saved state to be restored; compared field by field."""
    fingerprint: dict[str, Any] = dict(identity)
    fingerprint.update(kv_flags(child_args))
    fingerprint["total_slots"] = total_slots
    fingerprint["n_ctx_slot"] = n_ctx_slot
    return fingerprint


def shareable(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint without the model's path when its content hash is known: the same model file under
    another path (another host, a moved directory) is the same model."""
    if "model_sha256" in fingerprint:
        return {k: v for k, v in fingerprint.items() if k != "model"}
    return fingerprint


def namespace_key(fingerprint: dict[str, Any]) -> str:
    """A short name for everything a fingerprint pins down (the shared tier's folder): equal exactly when two
    hosts' configurations can use each other's entries."""
    canonical = json.dumps(shareable(fingerprint), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def first_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The first field that differs, as `field: saved -> current`, or None when they match."""
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            return f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
    return None


def server_identity(binary: str | None) -> dict[str, Any]:
    """Which llama-server wrote a file: its path, size and mtime (build_info says `b0-unknown` when built
    from the sdist, so it cannot tell builds apart)."""
    if not binary:
        return {}
    with contextlib.suppress(OSError):
        st = os.stat(binary)
        return {"path": str(Path(binary).resolve()), "size": st.st_size, "mtime": int(st.st_mtime)}
    return {"path": binary}
