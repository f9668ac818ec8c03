"""The shared tier: the local store's entries in S3-compatible object storage, so a chat saved on one host
resumes warm on another.

Layout under the store's prefix, one folder per model+KV fingerprint (the namespace):

    <prefix>/<namespace>/<entry_id>.bin    llama-server's KV state file, byte for byte
    <prefix>/<namespace>/<entry_id>.json   the local manifest plus "sha256" and "bytes" of the .bin

The .json is written after the .bin, so it is the commit marker: an entry without one is not there. Nothing
remote is trusted: a download is checked against the manifest's size and sha256 before it is handed over.
Uploads are write-behind: journaled locally first, so an upload cut off by a stop or a dead link is resumed at
the next start. Every failure here leaves the local store working; the remote tier is an optimisation.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import PermissionDeniedError, UnauthenticatedError
from obstore.store import S3Store

from .log import fmt_bytes, log
from .store import fsync_path

if TYPE_CHECKING:
    from obstore import GetResult, ObjectMeta
    from obstore.store import S3Config

BIN_SUFFIX = ".bin"
MANIFEST_SUFFIX = ".json"
PARTIAL_SUFFIX = ".partial"  # a download in progress in dest_dir, as slots.py names its own partial files
JOURNAL_TMP_SUFFIX = ".tmp"

INDEX_MAX_AGE_S = 30.0  # find() re-lists the namespace at most this often
INDEX_TIMEOUT_S = 60.0  # a whole listing (LIST pages + manifest GETs) gives up after this
FIND_WAIT_S = 5.0  # a request waits at most this long for a refresh; it then continues in the background
MANIFEST_GET_CONCURRENCY = 8
PART_BYTES = 8 * 1024 * 1024  # multipart part size for uploads
DOWNLOAD_CHUNK_BYTES = 256 * 1024  # a download's unit of progress: a stall is no chunk within request_timeout_s
PART_CONCURRENCY = 2  # parts in flight per upload: PART_BYTES * this must cross the link within the timeout
READ_BYTES = 1024 * 1024  # an upload reads and hashes the local file in pieces of this size, off the loop
TRANSFER_MAX = timedelta(hours=24)  # a download is one GET; it is bounded per chunk (stall), not as a whole
PROGRESS_INTERVAL_S = 2.0
CANCEL_GRACE_S = 1.0  # close(): how long cancelled uploads get to unwind after the deadline
SPEED_WEIGHT = 0.5  # weight of the newest download in the measured speed
RETRIES = 4  # per HTTP request (obstore's retry), with exponential backoff and jitter...
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 4.0  # ...capped here; all retries of one request end within request_timeout_s

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class RemoteError(Exception):
    """A remote operation asked for by the user (ls/prune --remote) failed; the message is one line."""


# ---- configuration -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteConfig:
    """Where the shared tier lives and how to sign for it, resolved once at start from the standard AWS settings."""

    bucket: str
    prefix: str
    endpoint: str | None
    region: str | None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    profile: str | None = None  # where the credentials came from, for messages

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @classmethod
    def from_url(cls, url: str, env: Mapping[str, str]) -> RemoteConfig:
        """`s3://bucket[/prefix]` plus AWS_* variables and ~/.aws files, with the AWS CLI's precedence."""
        bucket, prefix = _parse_s3_url(url)
        home = Path(env["HOME"]) if env.get("HOME") else Path.home()
        profile = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
        name = profile or "default"
        creds = _read_ini(Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials"),
                          "AWS_SHARED_CREDENTIALS_FILE", {name})
        conf = _read_ini(Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config"), "AWS_CONFIG_FILE",
                         {f"profile {name}", name} if name == "default" else {f"profile {name}"})
        if profile and creds is None and conf is None:
            raise ValueError(f"AWS_PROFILE={profile}: no such profile in the AWS credentials or config file")
        creds, conf = creds or {}, conf or {}

        def from_profile(key: str) -> str | None:
            return creds.get(key) or conf.get(key) or None

        source: str | None
        if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_SECRET_ACCESS_KEY"):
            key_id, secret, token = (env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY"),
                                     env.get("AWS_SESSION_TOKEN"))
            source, where = None, "the environment"
        else:
            key_id, secret, token = (from_profile("aws_access_key_id"), from_profile("aws_secret_access_key"),
                                     from_profile("aws_session_token"))
            source = name if key_id or secret else None
            where = f"AWS profile {name}"
            if profile and not key_id and not secret:
                raise ValueError(f"AWS_PROFILE={profile}: the profile has no aws_access_key_id/"
                                 "aws_secret_access_key (SSO, role and credential_process profiles are not supported)")
        if bool(key_id) != bool(secret):
            missing = "secret access key" if key_id else "access key id"
            raise ValueError(f"the credentials from {where} have no {missing}")
        endpoint = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
                    or _ini_subkey(conf.get("s3", ""), "endpoint_url") or conf.get("endpoint_url") or None)
        if endpoint is not None:
            parts = urlsplit(endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
                raise ValueError(f"the S3 endpoint must look like http(s)://host[:port] (got {endpoint!r})")
            endpoint = endpoint.rstrip("/")
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or conf.get("region") or None
        return cls(bucket, prefix, endpoint, region, key_id, secret, token or None, source)

    def store(self, timeout: timedelta, retry_timeout: timedelta, retries: int = RETRIES) -> S3Store:
        """An obstore client: path-style with allow_http for custom endpoints (MinIO, rclone, Ceph)."""
        config: S3Config = {"region": self.region or "us-east-1"}
        if self.endpoint:
            config["endpoint"] = self.endpoint
            config["virtual_hosted_style_request"] = False
        else:
            config["virtual_hosted_style_request"] = True  # AWS's preferred addressing
        if self.access_key_id and self.secret_access_key:
            config["access_key_id"] = self.access_key_id
            config["secret_access_key"] = self.secret_access_key
            if self.session_token:
                config["session_token"] = self.session_token
        backoff = {"init_backoff": timedelta(seconds=BACKOFF_FIRST_S), "max_backoff": timedelta(seconds=BACKOFF_MAX_S),
                   "base": 2}
        return S3Store(
            self.bucket, prefix=self.prefix or None, config=config,
            client_options={"allow_http": bool(self.endpoint and self.endpoint.startswith("http://")),
                            "timeout": timeout, "connect_timeout": min(timeout, timedelta(seconds=5))},
            retry_config={"max_retries": retries, "backoff": backoff, "retry_timeout": retry_timeout},
        )


def _parse_s3_url(url: str) -> tuple[str, str]:
    usage = f"--remote-store must look like s3://bucket/prefix (got {url!r})"
    parts = urlsplit(url)
    if parts.scheme != "s3" or parts.query or parts.fragment or not parts.netloc:
        raise ValueError(usage)
    if not _BUCKET_RE.fullmatch(parts.netloc):
        raise ValueError(f"--remote-store: {parts.netloc!r} is not an S3 bucket name (3-63 of a-z 0-9 . -)")
    prefix = parts.path.strip("/")
    if prefix and not all(_NAME_RE.fullmatch(seg) for seg in prefix.split("/")):
        raise ValueError(f"--remote-store: prefix {prefix!r} must be /-separated names of A-Z a-z 0-9 . _ -")
    return parts.netloc, prefix


def _read_ini(path: Path, variable: str, sections: set[str]) -> dict[str, str] | None:
    """The first of `sections` in an AWS ini file, or None when the file or the section is missing."""
    parser = configparser.RawConfigParser()  # raw: secrets may contain %
    try:
        parser.read_string(path.read_text(encoding="utf-8"), source=str(path))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, configparser.Error) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"cannot read {path} ({variable}): {first}") from None
    for section in sorted(sections, key=lambda s: not s.startswith("profile ")):
        if parser.has_section(section):
            return dict(parser.items(section))
    return None


def _ini_subkey(block: str, key: str) -> str | None:
    """`endpoint_url` from a nested section (`s3 =` followed by indented `endpoint_url = ...` lines)."""
    for line in block.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip() or None
    return None


# ---- the tier -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteMatch:
    """A remote entry whose first `matched_blocks` block hashes are the request's."""

    entry_id: str
    manifest: dict[str, Any]
    matched_blocks: int


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


@dataclass
class _Upload:
    entry_id: str
    bin_path: Path
    manifest: dict[str, Any]
    nbytes: int = 0


class _Dropped(Exception):
    """The local file of a journaled upload is gone or changed: that upload no longer makes sense."""


class RemoteTier:
    """One namespace of the shared tier: write-behind uploads, an index of remote manifests, verified fetches."""

    def __init__(self, config: RemoteConfig, namespace: str, journal_dir: Path, *, concurrency: int = 2,
                 request_timeout_s: float = 30.0) -> None:
        if not _NAME_RE.fullmatch(namespace):
            raise ValueError(f"remote namespace {namespace!r} must be a short name of A-Z a-z 0-9 . _ -")
        self.config = config
        self.namespace = namespace
        self.journal_dir = journal_dir
        self.request_timeout_s = request_timeout_s
        self.stats = RemoteStats()
        journal_dir.mkdir(parents=True, exist_ok=True)
        timeout = timedelta(seconds=request_timeout_s)
        self._store = config.store(timeout, retry_timeout=timeout)
        self._bulk = config.store(TRANSFER_MAX, retry_timeout=timeout)  # downloads: stalls are caught per chunk
        self._probe_store = config.store(timeout, retry_timeout=timeout, retries=0)  # its error is the answer
        self._upload_slots = asyncio.Semaphore(concurrency)
        self._uploads: dict[str, tuple[_Upload, asyncio.Task[None]]] = {}
        self._fetches: dict[str, asyncio.Task[tuple[Path, dict[str, Any]] | None]] = {}
        self._index: dict[str, tuple[str | None, dict[str, Any]]] = {}  # entry_id -> (e_tag of its .json, manifest)
        self._index_at: float | None = None  # monotonic time of the last complete listing
        self._refresh: asyncio.Task[None] | None = None
        self._refresh_failing = False
        self._rejected: set[str] = set()  # entries that failed verification: not offered again
        self._speed: float | None = None  # bytes/s of recent downloads
        self._closed = False

    def _key(self, entry_id: str, suffix: str, namespace: str | None = None) -> str:
        return f"{namespace or self.namespace}/{entry_id}{suffix}"

    # ---- reachability ---------------------------------------------------------------------------------------

    async def probe(self, timeout_s: float) -> bool:
        """Whether the bucket answers a listing of this namespace within `timeout_s`; one log line either way.

        One request without retries: a refused connection or a missing bucket is reported as such at once
        instead of being retried until the timeout hides the reason.
        """
        started = time.monotonic()
        try:
            await asyncio.wait_for(
                obstore.list_with_delimiter_async(self._probe_store, f"{self.namespace}/"), timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure means: local store only
            log.warning("remote store %s unreachable (%s); continuing with the local store only",
                        self.config.url, _reason(exc, timeout_s))
            return False
        log.info("remote store %s reachable (%.0f ms)", self.config.url, (time.monotonic() - started) * 1000)
        return True

    # ---- uploads --------------------------------------------------------------------------------------------

    def schedule_upload(self, entry_id: str, bin_path: Path, manifest: dict[str, Any]) -> None:
        """Queue an upload and return at once; the journal record is written (off the loop) before it starts."""
        if not _NAME_RE.fullmatch(entry_id):
            raise ValueError(f"remote entry id {entry_id!r} must be a short name of A-Z a-z 0-9 . _ -")
        job = _Upload(entry_id, bin_path, dict(manifest))
        if self._closed:  # stopping: record it for the next start, upload nothing now
            self._write_journal(job)
            return
        self._enqueue(job, journal=True)

    def resume(self) -> int:
        """Queue again every journaled upload whose local file is still there; drop the others."""
        count = 0
        for record in sorted(self.journal_dir.glob(f"*{MANIFEST_SUFFIX}")):
            try:
                data = json.loads(record.read_text(encoding="utf-8"))
                job = _Upload(str(data["entry_id"]), Path(data["bin_path"]), dict(data["manifest"]))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                record.unlink(missing_ok=True)
                log.warning("remote: unreadable upload journal %s removed (%s)", record.name, exc)
                continue
            if job.entry_id in self._uploads:
                continue
            if not job.bin_path.is_file():
                record.unlink(missing_ok=True)
                log.info("remote: upload of entry %s dropped: %s is gone", job.entry_id, job.bin_path)
                continue
            self._enqueue(job, journal=False)
            count += 1
        for stale in self.journal_dir.glob(f"*{JOURNAL_TMP_SUFFIX}"):
            stale.unlink(missing_ok=True)
        if count:
            log.info("remote: %d upload(s) from the journal resumed", count)
        return count

    def _enqueue(self, job: _Upload, journal: bool) -> None:
        previous = self._uploads.pop(job.entry_id, None)
        if previous is not None:
            previous[1].cancel()  # a newer save of the same entry replaces it
            self.stats.uploads_pending -= 1
        with contextlib.suppress(OSError):
            job.nbytes = job.bin_path.stat().st_size
        task = asyncio.ensure_future(self._upload(job, journal))
        self._uploads[job.entry_id] = (job, task)
        self.stats.uploads_pending += 1

    def _journal_path(self, entry_id: str) -> Path:
        return self.journal_dir / f"{entry_id}{MANIFEST_SUFFIX}"

    def _write_journal(self, job: _Upload) -> None:
        final = self._journal_path(job.entry_id)
        tmp = final.with_name(final.name + JOURNAL_TMP_SUFFIX)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"entry_id": job.entry_id, "bin_path": str(job.bin_path), "manifest": job.manifest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_path(self.journal_dir)

    async def _upload(self, job: _Upload, journal: bool) -> None:
        """Journal, wait for a slot, then .bin and .json; the journal record goes only once both are up."""
        if journal:
            await asyncio.to_thread(self._write_journal, job)
        async with self._upload_slots:
            started = time.monotonic()
            try:
                nbytes = await self._upload_entry(job)
            except _Dropped as exc:
                self._journal_path(job.entry_id).unlink(missing_ok=True)
                log.info("remote: upload of entry %s dropped: %s", job.entry_id, exc)
                self._finish(job)
                return
            except Exception as exc:  # noqa: BLE001 - kept in the journal for the next start
                self.stats.uploads_failed += 1
                self._finish(job)
                log.warning("remote: entry %s upload failed (%s); it stays in the journal for the next start",
                            job.entry_id, _reason(exc, self.request_timeout_s))
                return
            elapsed = time.monotonic() - started
            self._journal_path(job.entry_id).unlink(missing_ok=True)
            self.stats.uploads_done += 1
            self.stats.upload_bytes += nbytes
            self.stats.upload_seconds += elapsed
            self._finish(job)
            log.info("remote: entry %s uploaded: %s in %.1f s", job.entry_id, fmt_bytes(nbytes), elapsed)

    def _finish(self, job: _Upload) -> None:
        current = self._uploads.get(job.entry_id)
        if current is not None and current[0] is job:
            del self._uploads[job.entry_id]
            self.stats.uploads_pending -= 1

    async def _upload_entry(self, job: _Upload) -> int:
        """Read the file once (off the loop), hashing what is sent; then the manifest with that hash.

        Written through obstore's buffered writer rather than `put_async(path)`: cancelling a `put_async`
        does not stop its upload (it runs to completion inside obstore's runtime), while an unclosed writer
        never completes its object, and at most PART_CONCURRENCY parts are still in flight when it is dropped.
        """
        before = _stat_or_drop(job)
        hasher = hashlib.sha256()
        sent = 0
        writer = obstore.open_writer_async(self._store, self._key(job.entry_id, BIN_SUFFIX),
                                           buffer_size=PART_BYTES, max_concurrency=PART_CONCURRENCY)
        with open(job.bin_path, "rb") as f:
            while chunk := await asyncio.to_thread(_read_hashed, f, hasher):
                await writer.write(chunk)
                sent += len(chunk)
        changed = _Dropped(f"{job.bin_path.name} changed while it was uploaded")
        if _stat_or_drop(job) != before or sent != before[0]:
            raise changed  # the writer is never closed: no object
        await writer.close()
        if _stat_or_drop(job) != before:  # the object is there, but it is not the local file any more
            with contextlib.suppress(Exception):
                await obstore.delete_async(self._store, self._key(job.entry_id, BIN_SUFFIX))
            raise changed
        remote_manifest = {**job.manifest, "sha256": hasher.hexdigest(), "bytes": sent}
        await obstore.put_async(self._store, self._key(job.entry_id, MANIFEST_SUFFIX),
                                json.dumps(remote_manifest, indent=1).encode())
        return sent

    # ---- finding --------------------------------------------------------------------------------------------

    async def find(self, blocks: list[str], block_tokens: int) -> RemoteMatch | None:
        """The remote entry sharing the longest block prefix with `blocks`, from an index at most
        INDEX_MAX_AGE_S old (a refresh longer than FIND_WAIT_S continues in the background)."""
        if self._index_at is None or time.monotonic() - self._index_at >= INDEX_MAX_AGE_S:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.ensure_future(self._refresh_index())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_shared(self._refresh), FIND_WAIT_S)
        best: RemoteMatch | None = None
        for entry_id, (_, manifest) in self._index.items():
            their = manifest.get("blocks")
            if manifest.get("block_tokens") != block_tokens or not isinstance(their, list):
                continue
            matched = 0
            for mine, other in zip(blocks, their):
                if mine != other:
                    break
                matched += 1
            if matched and (best is None or matched > best.matched_blocks):
                best = RemoteMatch(entry_id, manifest, matched)
        if best is None:
            self.stats.remote_misses += 1
        else:
            self.stats.remote_hits += 1
        return best

    async def _refresh_index(self) -> None:
        """Re-list the namespace; only manifests that are new or changed (by e_tag) are downloaded."""
        try:
            found = await asyncio.wait_for(self._list_manifests(f"{self.namespace}/", self._index), INDEX_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - keep the index we have
            if not self._refresh_failing:
                log.warning("remote: listing %s failed (%s); using the %d entries known", self.config.url,
                            _reason(exc, INDEX_TIMEOUT_S), len(self._index))
            self._refresh_failing = True
            self._index_at = time.monotonic()  # retried after INDEX_MAX_AGE_S, not on every request
            return
        if self._refresh_failing:
            log.info("remote: listing %s works again (%d entries)", self.config.url, len(found))
        self._refresh_failing = False
        self._index = {key.rpartition("/")[2]: value for key, value in found.items()}
        self._index_at = time.monotonic()

    async def _list_manifests(self, prefix: str, known: Mapping[str, tuple[str | None, dict[str, Any]]]
                              ) -> dict[str, tuple[str | None, dict[str, Any]]]:
        """`namespace/entry_id` -> (e_tag, manifest) of the valid manifests under `prefix` (recursive)."""
        metas = await obstore.list(self._store, prefix or None, chunk_size=1000).collect_async()
        limit = asyncio.Semaphore(MANIFEST_GET_CONCURRENCY)
        unreadable: list[str] = []

        async def one(meta: ObjectMeta) -> tuple[str, tuple[str | None, dict[str, Any]]] | None:
            path: str = meta["path"]
            namespace, _, name = path.rpartition("/")
            entry_id = name.removesuffix(MANIFEST_SUFFIX)
            if not namespace or "/" in namespace or not _NAME_RE.fullmatch(entry_id):
                return None
            if namespace == self.namespace and entry_id in self._rejected:
                return None
            previous = known.get(entry_id) if namespace == self.namespace else None
            if previous is not None and previous[0] is not None and previous[0] == meta.get("e_tag"):
                return f"{namespace}/{entry_id}", previous
            async with limit:
                try:
                    raw = await (await obstore.get_async(self._store, path)).bytes_async()
                except FileNotFoundError:
                    return None  # deleted between LIST and GET
                except Exception as exc:  # noqa: BLE001 - one unreadable manifest must not hide the others
                    unreadable.append(_reason(exc, self.request_timeout_s))
                    return None
            manifest = _valid_manifest(bytes(raw))
            if manifest is None:
                if namespace == self.namespace:
                    self._reject(entry_id, "its manifest is not valid JSON with sha256 and bytes")
                return None
            return f"{namespace}/{entry_id}", (meta.get("e_tag"), manifest)

        jobs = [one(m) for m in metas if m["path"].endswith(MANIFEST_SUFFIX)]
        found = dict(pair for pair in await asyncio.gather(*jobs) if pair is not None)
        if unreadable:
            log.warning("remote: %d manifest(s) under %s could not be read (%s); skipped", len(unreadable),
                        self.config.url, unreadable[0])
        return found

    def _reject(self, entry_id: str, why: str) -> None:
        self._rejected.add(entry_id)
        self._index.pop(entry_id, None)
        self.stats.rejected += 1
        log.warning("remote: entry %s rejected: %s", entry_id, why)

    # ---- fetching -------------------------------------------------------------------------------------------

    async def fetch(self, match: RemoteMatch, dest_dir: Path) -> tuple[Path, dict[str, Any]] | None:
        """Download and verify an entry into dest_dir/<entry_id>.bin, or None (logged) when it cannot be had.

        Callers fetching one entry at the same time share one download (and the first caller's dest_dir).
        """
        task = self._fetches.get(match.entry_id)
        if task is None:
            task = asyncio.ensure_future(self._fetch(match, dest_dir))
            self._fetches[match.entry_id] = task
            task.add_done_callback(lambda done: self._fetches.pop(match.entry_id, None)
                                   if self._fetches.get(match.entry_id) is done else None)
        return await _shared(task)

    async def _fetch(self, match: RemoteMatch, dest_dir: Path) -> tuple[Path, dict[str, Any]] | None:
        entry_id, manifest = match.entry_id, match.manifest
        final = dest_dir / f"{entry_id}{BIN_SUFFIX}"
        partial = dest_dir / f"{entry_id}{BIN_SUFFIX}{PARTIAL_SUFFIX}"
        expected = int(manifest["bytes"])
        started = time.monotonic()
        committed = False
        try:
            dest_dir.mkdir(parents=True, exist_ok=True)
            result = await asyncio.wait_for(
                obstore.get_async(self._bulk, self._key(entry_id, BIN_SUFFIX)), self.request_timeout_s)
            if result.meta["size"] != expected:
                self._reject(entry_id, f"its object has {result.meta['size']} bytes, its manifest says {expected}")
                return None
            if not await self._download(entry_id, result, partial, expected, str(manifest["sha256"])):
                self._reject(entry_id, "the downloaded bytes do not match its manifest's sha256; nothing was kept")
                return None
            await asyncio.to_thread(_commit_download, partial, final)
            committed = True
        except FileNotFoundError:
            self._index.pop(entry_id, None)
            self.stats.fetches_failed += 1
            log.warning("remote: entry %s is gone from %s", entry_id, self.config.url)
            return None
        except Exception as exc:  # noqa: BLE001 - a failed fetch is a cold start, never a failed request
            self.stats.fetches_failed += 1
            log.warning("remote: entry %s fetch failed (%s)", entry_id, _reason(exc, self.request_timeout_s))
            return None
        finally:  # also when cancelled: never leave a partial download behind
            if not committed:
                partial.unlink(missing_ok=True)
        elapsed = time.monotonic() - started
        self.stats.download_bytes += expected
        self.stats.download_seconds += elapsed
        speed = expected / max(elapsed, 1e-6)
        self._speed = speed if self._speed is None else SPEED_WEIGHT * speed + (1 - SPEED_WEIGHT) * self._speed
        log.info("remote: entry %s fetched: %s in %.1f s (%s/s)", entry_id, fmt_bytes(expected), elapsed,
                 fmt_bytes(int(speed)))
        return final, manifest

    async def _download(self, entry_id: str, result: GetResult, partial: Path, expected: int, sha256: str) -> bool:
        """Stream to `partial`, hashing as it goes (a chunk at a time in memory); True when size and hash match.

        The GET has no overall timeout (a big file on a slow link takes long); each chunk must arrive within
        request_timeout_s instead, so a stalled transfer gives up.
        """
        hasher = hashlib.sha256()
        received = 0
        last_report = time.monotonic()
        stream = result.stream(min_chunk_size=DOWNLOAD_CHUNK_BYTES)
        with open(partial, "wb") as f:
            while True:
                try:
                    chunk = await asyncio.wait_for(anext(stream), self.request_timeout_s)
                except StopAsyncIteration:
                    break
                received += len(chunk)
                if received > expected:
                    return False
                await asyncio.to_thread(_write_hashed, f, hasher, chunk)
                if time.monotonic() - last_report >= PROGRESS_INTERVAL_S:
                    last_report = time.monotonic()
                    log.info("remote: entry %s fetching: %s of %s", entry_id, fmt_bytes(received), fmt_bytes(expected))
        return received == expected and hasher.hexdigest() == sha256

    def estimated_fetch_seconds(self, nbytes: int) -> float | None:
        """From the measured speed of recent downloads; None until one was measured."""
        return None if self._speed is None else nbytes / self._speed

    # ---- listing and pruning (CLI) ---------------------------------------------------------------------------

    async def list_entries(self) -> list[dict[str, Any]]:
        """This namespace's manifests, each with its "entry_id"."""
        return (await self.list_all(namespace=self.namespace)).get(self.namespace, [])

    async def list_all(self, namespace: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """namespace -> manifests (each with its "entry_id") under the whole prefix."""
        try:
            found = await asyncio.wait_for(
                self._list_manifests(f"{namespace}/" if namespace else "", {}), INDEX_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            raise RemoteError(f"listing {self.config.url} failed ({_reason(exc, INDEX_TIMEOUT_S)})") from None
        out: dict[str, list[dict[str, Any]]] = {}
        for key, (_, manifest) in sorted(found.items()):
            ns, _, entry_id = key.rpartition("/")
            out.setdefault(ns, []).append({**manifest, "entry_id": entry_id})
        return out

    async def delete(self, namespace: str, entry_id: str) -> None:
        """Remove an entry: its manifest first, so no reader ever sees a manifest without its data."""
        try:
            for suffix in (MANIFEST_SUFFIX, BIN_SUFFIX):
                await obstore.delete_async(self._store, self._key(entry_id, suffix, namespace))
        except Exception as exc:  # noqa: BLE001
            raise RemoteError(f"deleting {namespace}/{entry_id} from {self.config.url} failed "
                              f"({_reason(exc, self.request_timeout_s)})") from None
        if namespace == self.namespace:
            self._index.pop(entry_id, None)
        log.info("remote: entry %s of namespace %s deleted", entry_id, namespace)

    # ---- stop -----------------------------------------------------------------------------------------------

    async def close(self, deadline: float) -> None:
        """Let running uploads go on until `deadline` (monotonic), then cancel them; the journal keeps them."""
        self._closed = True
        for task in [*self._fetches.values(), *([self._refresh] if self._refresh else [])]:
            task.cancel()
        tasks = [task for _, task in self._uploads.values()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=CANCEL_GRACE_S)
        if self._uploads:
            left = sum(job.nbytes for job, _ in self._uploads.values())
            log.info("remote: %d upload(s) pending (%s); they resume at the next start",
                     len(self._uploads), fmt_bytes(left))


# ---- helpers --------------------------------------------------------------------------------------------------


async def _shared(task: asyncio.Task[Any]) -> Any:
    """Await a task several callers share: one caller's cancellation is not the task's, and the task's
    cancellation (by close()) reads as None to callers that were not themselves cancelled."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if task.cancelled() and me is not None and not me.cancelling():
            return None
        raise


def _stat_or_drop(job: _Upload) -> tuple[int, int]:
    """(size, mtime_ns) of the local file; _Dropped when it is gone or its size is not the manifest's."""
    try:
        st = job.bin_path.stat()
    except FileNotFoundError:
        raise _Dropped(f"{job.bin_path} is gone (evicted?)") from None
    declared = job.manifest.get("bytes")
    if declared is not None and declared != st.st_size:
        raise _Dropped(f"{job.bin_path.name} has {st.st_size} bytes, its manifest says {declared}")
    return st.st_size, st.st_mtime_ns


def _read_hashed(f: BinaryIO, hasher: Any) -> bytes:
    chunk = f.read(READ_BYTES)
    hasher.update(chunk)
    return chunk


def _write_hashed(f: BinaryIO, hasher: Any, chunk: bytes) -> None:
    f.write(chunk)
    hasher.update(chunk)


def _commit_download(partial: Path, final: Path) -> None:
    fd = os.open(partial, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, final)
    fsync_path(final.parent)


def _valid_manifest(raw: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if (not isinstance(data, dict) or not isinstance(data.get("bytes"), int) or data["bytes"] < 0
            or not isinstance(data.get("sha256"), str) or not _SHA256_RE.fullmatch(data["sha256"])):
        return None
    return data


def _reason(exc: BaseException, timeout_s: float) -> str:
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
    for needle, words in (("NoSuchBucket", "no such bucket"), ("Connection refused", "connection refused"),
                          ("InvalidAccessKeyId", "credentials refused"),
                          ("SignatureDoesNotMatch", "credentials refused"),
                          ("dns error", "host not found"), ("timed out", "timed out"), ("TimedOut", "timed out"),
                          ("Connection reset", "connection reset"), ("403 Forbidden", "access denied")):
        if needle in text:
            return words
    first = text.splitlines()[0] if text else type(exc).__name__
    return first if len(first) <= 160 else first[:157] + "..."
