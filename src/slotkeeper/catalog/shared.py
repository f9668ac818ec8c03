"""`slotkeeper ls/prune --remote`: the shared tier's entries as rows, read with a bare bucket client.

The bucket client (bucket.py) needs no upload journal and no index; it is imported only here, when --remote
is given, because obstore is needed for nothing else `ls` and `prune` do.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ..store.blockpool import BlockPool
from ..store.entries import Status, parse_entry
from ..store.fingerprint import namespace_key
from .formats import CatalogError, RemoteFailure
from .remote_rows import RemoteRow
from .short_ids import assign_short_ids

if TYPE_CHECKING:
    from ..remote.bucket import Bucket
    from ..remote.s3config import RemoteConfig

ENV_REMOTE_STORE = "SLOTKEEPER_REMOTE_STORE"
T = TypeVar("T")


def remote_url(given: str | None, env: Mapping[str, str]) -> str:
    url = given or env.get(ENV_REMOTE_STORE)
    if not url:
        raise CatalogError(f"--remote needs --remote-store s3://bucket/prefix or {ENV_REMOTE_STORE}")
    return url


def remote_config(url: str, env: Mapping[str, str]) -> RemoteConfig:
    """RemoteConfig.from_url, its complaints as one line."""
    from ..remote.s3config import RemoteConfig

    try:
        return RemoteConfig.from_url(url, env)
    except ValueError as exc:
        raise CatalogError(str(exc)) from None


def open_bucket(config: RemoteConfig) -> Bucket:
    """A client for the command's lifetime; RemoteError (one line) when it refuses its configuration."""
    from ..remote.bucket import Bucket, RemoteError

    try:
        return Bucket(config)
    except Exception as exc:  # noqa: BLE001 - the client refused its configuration: one line
        raise RemoteError(f"remote store {config.url}: {exc}") from None


def run_remote(job: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a job against the shared tier for the command's lifetime; its RemoteError is a RemoteFailure."""
    import asyncio

    from ..remote.bucket import RemoteError

    try:
        return asyncio.run(job())
    except RemoteError as exc:
        raise RemoteFailure(str(exc)) from None


def list_remote(config: RemoteConfig) -> dict[str, list[dict[str, Any]]]:
    """namespace -> its manifests (each with its "entry_id"), under the whole prefix."""
    return run_remote(lambda: open_bucket(config).list_all())


def remote_row(url: str, namespace: str, manifest: dict[str, Any]) -> RemoteRow:
    """A remote entry, judged as a fetch would treat it: a manifest slotkeeper reads, in the namespace its
    fingerprint names (the store then judges a fetched entry as any other, entries.judge)."""
    entry, _ = parse_entry(manifest)
    status = (
        Status.REMOTE_BAD_MANIFEST
        if entry is None
        else Status.OTHER_NAMESPACE
        if namespace_key(entry.fingerprint) != namespace
        else Status.SHARED
    )
    return RemoteRow(url, namespace, str(manifest.get("entry_id", "")), manifest, entry, status)


def remote_rows(url: str, listing: Mapping[str, list[dict[str, Any]]]) -> dict[str, list[RemoteRow]]:
    """namespace -> its rows, most recently used first, with short ids told apart within the namespace, and what
    each entry kept as blocks holds alone there."""
    out: dict[str, list[RemoteRow]] = {}
    for namespace, manifests in sorted(listing.items()):
        rows = sorted((remote_row(url, namespace, m) for m in manifests), key=lambda r: (-r.last_used, r.id))
        assign_short_ids(rows)
        pool = block_pool(rows)
        for row in rows:
            if (parts := row.remote_parts) is not None:
                row.held = pool.own_bytes(parts)
        out[namespace] = rows
    return out


def block_pool(rows: Iterable[RemoteRow]) -> BlockPool:
    """The blocks these rows (of one namespace) use, by users."""
    pool = BlockPool()
    for row in rows:
        if (parts := row.remote_parts) is not None:
            pool.acquire(parts)
    return pool
