"""The shared tier's bucket: entries as objects, read, listed, written and deleted. No journal, no index.

Layout under the configured prefix, one folder per model+KV fingerprint (the namespace):

    <prefix>/<namespace>/blocks/<32 hex>   a block (store/blocks.py), named by the xxh3_128 of its bytes
    <prefix>/<namespace>/<entry_id>.json   an entry kept as blocks: the local manifest (its "parts" name them)
    <prefix>/<namespace>/<entry_id>.bin    an entry kept whole (as slotkeeper uploaded before blocks)...
    <prefix>/<namespace>/<entry_id>.json   ...its manifest plus "sha256" and "bytes" of the .bin

A block is shared by every entry of the namespace that repeats it and written under its name by whichever host
uploads it first; a host writing it again writes the same bytes. The .json is written after the entry's blocks
(or its .bin), so it is the commit marker: an entry without one is not there. Listings use the delimiter, so
that the blocks are never walked to find the manifests. This client is all `slotkeeper ls/prune --remote`
need; the daemon's tier (tier.py) adds the index, the verified downloads and, through uploads.py, the
write-behind queue.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import obstore
from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

from ..log import log
from ..store.blocks import Parts, is_block_name
from ..store.entries import BIN_SUFFIX, CHECKSUM_ALGORITHM, MANIFEST_SUFFIX
from .s3config import NAME_RE, RemoteConfig

if TYPE_CHECKING:
    from obstore import AsyncWritableFile, GetResult, ObjectMeta

INDEX_TIMEOUT_S = 60.0  # a whole listing (LIST pages + manifest GETs) gives up after this
MANIFEST_GET_CONCURRENCY = 8
BLOCKS_FOLDER = "blocks"  # <namespace>/blocks/<name>
TRANSFER_MAX = timedelta(hours=24)  # a download is one GET; it is bounded per chunk (stall), not as a whole
_SHA256_RE = re.compile(r"[0-9a-f]{64}")

Listed = tuple[str | None, dict[str, Any]]  # (e_tag of an entry's .json, its manifest)


class RemoteError(Exception):
    """A remote operation asked for by the user (ls/prune --remote) failed; the message is one line."""


@dataclass
class RemoteStats:
    """Counters for /slotkeeper/status and metrics; seconds are wall time of whole transfers."""

    uploads_pending: int = 0
    uploads_failed: int = 0
    uploads_done: int = 0
    upload_bytes: int = 0
    upload_seconds: float = 0.0
    remote_hits: int = 0
    remote_misses: int = 0
    download_bytes: int = 0
    download_seconds: float = 0.0
    fetches_failed: int = 0  # network or disk errors (the entry may still be fine)
    rejected: int = 0  # tampered, truncated or malformed remote entries


class Bucket:
    """Signed clients for one bucket and prefix: each entry's two objects, by namespace and id."""

    def __init__(self, config: RemoteConfig, request_timeout_s: float = 30.0) -> None:
        self.config = config
        self.request_timeout_s = request_timeout_s
        timeout = timedelta(seconds=request_timeout_s)
        self._store = config.store(timeout, retry_timeout=timeout)
        self._bulk = config.store(TRANSFER_MAX, retry_timeout=timeout)  # downloads: stalls are caught per chunk
        self._probe_store = config.store(timeout, retry_timeout=timeout, retries=0)  # its error is the answer

    @staticmethod
    def key(namespace: str, entry_id: str, suffix: str) -> str:
        return f"{namespace}/{entry_id}{suffix}"

    @staticmethod
    def block_key(namespace: str, name: str) -> str:
        return f"{namespace}/{BLOCKS_FOLDER}/{name}"

    async def probe(self, namespace: str, timeout_s: float) -> bool:
        """Whether the bucket answers a listing of `namespace` within `timeout_s`; one log line either way.

        One request without retries: a refused connection or a missing bucket is reported as such at once
        instead of being retried until the timeout hides the reason.
        """
        started = time.monotonic()
        try:
            await asyncio.wait_for(obstore.list_with_delimiter_async(self._probe_store, f"{namespace}/"), timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure means: local store only
            log.warning(
                "remote store %s unreachable (%s); continuing with the local store only",
                self.config.url,
                reason(exc, timeout_s),
            )
            return False
        log.info("remote store %s reachable (%.0f ms)", self.config.url, (time.monotonic() - started) * 1000)
        return True

    # ---- manifests --------------------------------------------------------------------------------------------

    async def list_manifests(
        self,
        prefix: str,
        known: Mapping[str, Listed] | None = None,
        *,
        skip: Collection[str] = (),
        on_invalid: Callable[[str], None] | None = None,
        unread: set[str] | None = None,
    ) -> dict[str, Listed]:
        """`namespace/entry_id` -> (e_tag, manifest) of the valid manifests under `prefix` ("": every
        namespace's; "<namespace>/": that one's).

        A manifest whose e_tag is that of its `known` listing is not downloaded again; keys in `skip` are left
        out; `on_invalid` hears of each manifest that is not a valid entry's (valid_manifest); `unread` gets the
        namespaces of the manifests that could not be read at all.
        """
        known = known or {}
        metas = await self._list_folders(prefix)
        limit = asyncio.Semaphore(MANIFEST_GET_CONCURRENCY)
        unreadable: list[str] = []

        async def one(meta: ObjectMeta) -> tuple[str, Listed] | None:
            path: str = meta["path"]
            namespace, _, name = path.rpartition("/")
            entry_id = name.removesuffix(MANIFEST_SUFFIX)
            key = f"{namespace}/{entry_id}"
            if not namespace or "/" in namespace or not NAME_RE.fullmatch(entry_id) or key in skip:
                return None
            previous = known.get(key)
            if previous is not None and previous[0] is not None and previous[0] == meta.get("e_tag"):
                return key, previous
            async with limit:
                try:
                    raw = await (await obstore.get_async(self._store, path)).bytes_async()
                except FileNotFoundError:
                    return None  # deleted between LIST and GET
                except Exception as exc:  # noqa: BLE001 - one unreadable manifest must not hide the others
                    unreadable.append(reason(exc, self.request_timeout_s))
                    if unread is not None:
                        unread.add(namespace)
                    return None
            manifest = valid_manifest(bytes(raw))
            if manifest is None:
                if on_invalid is not None:
                    on_invalid(key)
                return None
            return key, (meta.get("e_tag"), manifest)

        jobs = [one(m) for m in metas if m["path"].endswith(MANIFEST_SUFFIX)]
        found = dict(pair for pair in await asyncio.gather(*jobs) if pair is not None)
        if unreadable:
            log.warning(
                "remote: %d manifest(s) under %s could not be read (%s); skipped",
                len(unreadable),
                self.config.url,
                unreadable[0],
            )
        return found

    async def _list_folders(self, prefix: str) -> list[ObjectMeta]:
        """The objects right in `prefix` ("<namespace>/"), or ("") right in each namespace's folder: one
        delimiter listing each, so that the blocks/ folders are never walked."""
        if prefix:
            return list((await obstore.list_with_delimiter_async(self._store, prefix))["objects"])
        top = await obstore.list_with_delimiter_async(self._store, None)
        listings = await asyncio.gather(
            *(obstore.list_with_delimiter_async(self._store, f"{folder}/") for folder in top["common_prefixes"])
        )
        return [meta for listing in listings for meta in listing["objects"]]

    async def list_all(
        self,
        namespace: str | None = None,
        *,
        skip: Collection[str] = (),
        on_invalid: Callable[[str], None] | None = None,
        unread: set[str] | None = None,
    ) -> dict[str, list[dict[str, Any]]]:
        """namespace -> manifests (each with its "entry_id") under the whole prefix, or under one namespace;
        `unread` gets the namespaces of manifests that could not be read."""
        try:
            found = await asyncio.wait_for(
                self.list_manifests(
                    f"{namespace}/" if namespace else "", skip=skip, on_invalid=on_invalid, unread=unread
                ),
                INDEX_TIMEOUT_S,
            )
        except Exception as exc:  # noqa: BLE001
            raise RemoteError(f"listing {self.config.url} failed ({reason(exc, INDEX_TIMEOUT_S)})") from None
        out: dict[str, list[dict[str, Any]]] = {}
        for key, (_, manifest) in sorted(found.items()):
            ns, _, entry_id = key.rpartition("/")
            out.setdefault(ns, []).append({**manifest, "entry_id": entry_id})
        return out

    async def put_manifest(self, namespace: str, entry_id: str, manifest: dict[str, Any]) -> None:
        """The commit of an upload: the .bin, or every block, is there already."""
        await obstore.put_async(
            self._store, self.key(namespace, entry_id, MANIFEST_SUFFIX), json.dumps(manifest, indent=1).encode()
        )

    # ---- objects ----------------------------------------------------------------------------------------------

    async def get(self, namespace: str, entry_id: str, suffix: str) -> GetResult:
        """Start a download: the answer's head within request_timeout_s, its body streamed by the caller."""
        return await asyncio.wait_for(
            obstore.get_async(self._bulk, self.key(namespace, entry_id, suffix)), self.request_timeout_s
        )

    def writer(self, namespace: str, entry_id: str, suffix: str, part_bytes: int, parts: int) -> AsyncWritableFile:
        """A multipart upload that makes an object only when closed (cancelling a `put_async` does not stop it)."""
        return obstore.open_writer_async(
            self._store, self.key(namespace, entry_id, suffix), buffer_size=part_bytes, max_concurrency=parts
        )

    async def delete_object(self, namespace: str, entry_id: str, suffix: str) -> None:
        await obstore.delete_async(self._store, self.key(namespace, entry_id, suffix))

    # ---- blocks -----------------------------------------------------------------------------------------------

    async def head_block(self, namespace: str, name: str) -> ObjectMeta | None:
        """The block's size and when it was last written (one HEAD); None when it is not there."""
        try:
            return await obstore.head_async(self._store, self.block_key(namespace, name))
        except FileNotFoundError:
            return None

    async def list_blocks(self, namespace: str) -> dict[str, ObjectMeta]:
        """The namespace's blocks, by name (a recursive listing of its blocks/: `slotkeeper prune --remote`)."""
        metas = await obstore.list(self._store, f"{namespace}/{BLOCKS_FOLDER}/", chunk_size=1000).collect_async()
        named = ((meta["path"].rpartition("/")[2], meta) for meta in metas)
        return {name: meta for name, meta in named if is_block_name(name)}

    async def get_block(self, namespace: str, name: str) -> GetResult:
        """Start a block's download: the answer's head within request_timeout_s, its body streamed by the caller."""
        return await asyncio.wait_for(
            obstore.get_async(self._bulk, self.block_key(namespace, name)), self.request_timeout_s
        )

    def block_writer(self, namespace: str, name: str, part_bytes: int, parts: int) -> AsyncWritableFile:
        """A block's upload, made an object only when closed (one PUT when it fits in `part_bytes`)."""
        return obstore.open_writer_async(
            self._store, self.block_key(namespace, name), buffer_size=part_bytes, max_concurrency=parts
        )

    async def delete_block(self, namespace: str, name: str) -> None:
        await obstore.delete_async(self._store, self.block_key(namespace, name))

    async def delete(self, namespace: str, entry_id: str) -> None:
        """Remove an entry: its manifest first, so no reader ever sees a manifest without its data. The blocks
        of an entry kept as blocks are left: other entries may use them (`slotkeeper prune --remote` removes
        those no remaining manifest uses)."""
        try:
            for suffix in (MANIFEST_SUFFIX, BIN_SUFFIX):
                await self.delete_object(namespace, entry_id, suffix)
        except Exception as exc:  # noqa: BLE001
            raise RemoteError(
                f"deleting {namespace}/{entry_id} from {self.config.url} failed ({reason(exc, self.request_timeout_s)})"
            ) from None
        log.info("remote: entry %s of namespace %s deleted", entry_id, namespace)


def valid_manifest(raw: bytes) -> dict[str, Any] | None:
    """A remote manifest, or None when it is not valid JSON of an entry: one kept as blocks ("parts" that
    describe a file of its "bytes", and the "checksum" that file is checked against at each restore), or one kept
    whole ("sha256" and "bytes" of its .bin)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("bytes"), int) or data["bytes"] < 0:
        return None
    if "parts" in data:
        try:
            parts = block_parts(data)
        except (KeyError, TypeError, ValueError):
            return None
        checksum = data.get("checksum")
        whole = isinstance(checksum, str) and checksum.startswith(f"{CHECKSUM_ALGORITHM}:")
        return data if whole and parts is not None and parts.nbytes == data["bytes"] else None
    if not isinstance(data.get("sha256"), str) or not _SHA256_RE.fullmatch(data["sha256"]):
        return None
    return data


def block_parts(manifest: Mapping[str, Any]) -> Parts | None:
    """How an entry kept as blocks is made of them (None: an entry kept whole, as a .bin). ValueError (or
    KeyError, TypeError) for "parts" that are not a whole, consistent description of a file."""
    data = manifest.get("parts")
    if data is None:
        return None
    return Parts.from_json(data)  # (each block's name checked: 32 hex digits, never a path)


def age_s(meta: ObjectMeta) -> float:
    """Seconds since an object was last written (as the server's clock and ours agree)."""
    return max(0.0, time.time() - meta["last_modified"].timestamp())


def reason(exc: BaseException, timeout_s: float) -> str:
    """A few words for a log line instead of obstore's multi-line debug dump."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(exc, PermissionDeniedError):
        return "access denied"
    if isinstance(exc, UnauthenticatedError):
        return "credentials refused"
    if isinstance(exc, FileNotFoundError):
        return "not found"
    text = str(exc)
    for needle, words in (
        ("NoSuchBucket", "no such bucket"),
        ("Connection refused", "connection refused"),
        ("InvalidAccessKeyId", "credentials refused"),
        ("SignatureDoesNotMatch", "credentials refused"),
        ("dns error", "host not found"),
        ("timed out", "timed out"),
        ("TimedOut", "timed out"),
        ("Connection reset", "connection reset"),
        ("403 Forbidden", "access denied"),
    ):
        if needle in text:
            return words
    first = text.splitlines()[0] if text else type(exc).__name__
    return first if len(first) <= 160 else first[:157] + "..."
