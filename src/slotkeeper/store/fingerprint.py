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
from pathlib import Path
from typing import Any

# The model's identity: its GGUF header and metadata (and the first tensors) plus its tail, not the whole
# multi-GB file. Two fine-tunes of one base differ in both regions; reading them costs milliseconds.
HEAD_BYTES = 8 * 1024 * 1024
TAIL_BYTES = 1024 * 1024

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


def model_identity(path: str | None) -> dict[str, Any]:
    """Resolved path, size and a hash of the head and tail of the model file."""
    if not path or not os.path.isfile(path):
        return {"model": path}
    resolved = Path(path).resolve()
    size = resolved.stat().st_size
    digest = hashlib.sha256()
    with open(resolved, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
        if size > HEAD_BYTES:
            f.seek(max(HEAD_BYTES, size - TAIL_BYTES))
            digest.update(f.read(TAIL_BYTES))
    return {"model": str(resolved), "model_size": size, "model_sha256": digest.hexdigest()[:32]}


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
