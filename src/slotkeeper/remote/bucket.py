"""The shared tier's bucket: entries as objects, read, listed, written and deleted. No journal, no index.

Layout under the configured prefix, one folder per model+KV fingerprint (the namespace):

    <prefix>/<namespace>/<entry_id>.bin    llama-server's KV state file, byte for byte
    <prefix>/<namespace>/<entry_id>.json   the local manifest plus "sha256" and "bytes" of the .bin

The .json is written after the .bin, so it is the commit marker: an entry without one is not there. This client
is all `slotkeeper ls/prune --remote` need; the daemon's tier (tier.py) adds the index, the verified
downloads and, through uploads.py, the write-behind queue.
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
from ..store.entries import BIN_SUFFIX, MANIFEST_SUFFIX
from .s3config import NAME_RE, RemoteConfig

if TYPE_CHECKING:
    from obstore import AsyncWritableFile, GetResult, ObjectMeta

INDEX_TIMEOUT_S = 60.0  # a whole listing (LIST pages + manifest GETs) gives up after this
MANIFEST_GET_CONCURRENCY = 8
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
    ) -> dict[str, Listed]:
        """`namespace/entry_id` -> (e_tag, manifest) of the valid manifests under `prefix` (recursive).

        A manifest whose e_tag is that of its `known` listing is not downloaded again; keys in `skip` are left
        out; `on_invalid` hears of each manifest that is not valid JSON with sha256 and bytes.
        """
        known = known or {}
        metas = await obstore.list(self._store, prefix or None, chunk_size=1000).collect_async()
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
                    return None
            manifest = _valid_manifest(bytes(raw))
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

    async def list_all(
        self,
        namespace: str | None = None,
        *,
        skip: Collection[str] = (),
        on_invalid: Callable[[str], None] | None = None,
    ) -> dict[str, list[dict[str, Any]]]:
        """namespace -> manifests (each with its "entry_id") under the whole prefix, or under one namespace."""
        try:
            found = await asyncio.wait_for(
                self.list_manifests(f"{namespace}/" if namespace else "", skip=skip, on_invalid=on_invalid),
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
        """The commit of an upload: the .bin is there already."""
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

    async def delete(self, namespace: str, entry_id: str) -> None:
        """Remove an entry: its manifest first, so no reader ever sees a manifest without its data."""
        try:
            for suffix in (MANIFEST_SUFFIX, BIN_SUFFIX):
                await self.delete_object(namespace, entry_id, suffix)
        except Exception as exc:  # noqa: BLE001
            raise RemoteError(
                f"deleting {namespace}/{entry_id} from {self.config.url} failed ({reason(exc, self.request_timeout_s)})"
            ) from None
        log.info("remote: entry %s of namespace %s deleted", entry_id, namespace)


def _valid_manifest(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("bytes"), int)
        or data["bytes"] < 0
        or not isinstance(data.get("sha256"), str)
        or not _SHA256_RE.fullmatch(data["sha256"])
    ):
        return None
    return data


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
