"""Where the shared tier lives and how to sign for it: `s3://bucket/prefix` plus the standard AWS settings.

Resolved once (at start, or per `slotkeeper ls/prune --remote`), with the AWS CLI's precedence, into an obstore
S3 client factory. Kept apart from the client itself so that a bad URL or profile is one line before anything
connects.
"""

from __future__ import annotations

import configparser
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from obstore.store import S3Store

if TYPE_CHECKING:
    from obstore.store import BackoffConfig, S3Config

RETRIES = 4  # per HTTP request (obstore's retry), with exponential backoff and jitter...
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 4.0  # ...capped here; all retries of one request end within request_timeout_s

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a prefix segment, a namespace, an entry id
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


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
        creds = _read_ini(
            Path(env.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials"),
            "AWS_SHARED_CREDENTIALS_FILE",
            {name},
        )
        conf = _read_ini(
            Path(env.get("AWS_CONFIG_FILE") or home / ".aws" / "config"),
            "AWS_CONFIG_FILE",
            {f"profile {name}", name} if name == "default" else {f"profile {name}"},
        )
        if profile and creds is None and conf is None:
            raise ValueError(f"AWS_PROFILE={profile}: no such profile in the AWS credentials or config file")
        creds, conf = creds or {}, conf or {}

        def from_profile(key: str) -> str | None:
            return creds.get(key) or conf.get(key) or None

        source: str | None
        if env.get("AWS_ACCESS_KEY_ID") or env.get("AWS_SECRET_ACCESS_KEY"):
            key_id, secret, token = (
                env.get("AWS_ACCESS_KEY_ID"),
                env.get("AWS_SECRET_ACCESS_KEY"),
                env.get("AWS_SESSION_TOKEN"),
            )
            source, where = None, "the environment"
        else:
            key_id, secret, token = (
                from_profile("aws_access_key_id"),
                from_profile("aws_secret_access_key"),
                from_profile("aws_session_token"),
            )
            source = name if key_id or secret else None
            where = f"AWS profile {name}"
            if profile and not key_id and not secret:
                raise ValueError(
                    f"AWS_PROFILE={profile}: the profile has no aws_access_key_id/"
                    "aws_secret_access_key (SSO, role and credential_process profiles are not supported)"
                )
        if bool(key_id) != bool(secret):
            missing = "secret access key" if key_id else "access key id"
            raise ValueError(f"the credentials from {where} have no {missing}")
        endpoint = (
            env.get("AWS_ENDPOINT_URL_S3")
            or env.get("AWS_ENDPOINT_URL")
            or _ini_subkey(conf.get("s3", ""), "endpoint_url")
            or conf.get("endpoint_url")
            or None
        )
        if endpoint is not None:
            if not _endpoint_ok(endpoint):
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
        backoff: BackoffConfig = {
            "init_backoff": timedelta(seconds=BACKOFF_FIRST_S),
            "max_backoff": timedelta(seconds=BACKOFF_MAX_S),
            "base": 2,
        }
        return S3Store(
            self.bucket,
            prefix=self.prefix or None,
            config=config,
            client_options={
                "allow_http": bool(self.endpoint and self.endpoint.startswith("http://")),
                "timeout": timeout,
                "connect_timeout": min(timeout, timedelta(seconds=5)),
            },
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
    if prefix and not all(NAME_RE.fullmatch(seg) for seg in prefix.split("/")):
        raise ValueError(f"--remote-store: prefix {prefix!r} must be /-separated names of A-Z a-z 0-9 . _ -")
    return parts.netloc, prefix


def _endpoint_ok(endpoint: str) -> bool:
    """http(s)://host[:port], the port in 1-65535: one out of range would panic in obstore's signer."""
    try:
        parts = urlsplit(endpoint)
        port = parts.port  # ValueError when not a number in 0-65535 (as for a bad [IPv6] host in urlsplit)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.path.strip("/") and port != 0


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
