"""Set-ups that used to end in a traceback or a panic, each now one line that names what to fix: a store folder a
`sudo slotkeeper` run left to root (or a file where a folder goes), an S3 endpoint whose port is out of range,
and --log-level debug's promised tracebacks."""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slotkeeper.log import LOGGER_NAME, setup_logging
from slotkeeper.remote.s3config import RemoteConfig
from slotkeeper.store.layout import BLOCKS_DIR, ENTRIES_DIR, SNAPSHOTS_DIR, prepare_layout

# Root ignores permission bits: the CLI then runs without the capabilities that bypass them.
WITHOUT_DAC = ["--bounding-set=-dac_override,-dac_read_search,-fowner", "--inh-caps=-all"]


def run_cli(tmp_path: Path, save_dir: Path, *, as_ordinary_user: bool = False) -> subprocess.CompletedProcess[str]:
    """`slotkeeper -m m.gguf --slot-save-path save_dir` with a LLAMA_SERVER that leaves a mark if started."""
    mark = tmp_path / "started"
    prefix: list[str] = []
    if as_ordinary_user and os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("needs setpriv (util-linux) to run without root's permission override")
        prefix = [setpriv, *WITHOUT_DAC]
    proc = subprocess.run(
        [*prefix, sys.executable, "-m", "slotkeeper.cli", "-m", "m.gguf", "--slot-save-path", str(save_dir)],
        capture_output=True,
        text=True,
        env={
            "LLAMA_SERVER": f"sh -c 'touch {mark}' sh",
            "XDG_CACHE_HOME": str(tmp_path / "xdg"),
            "HOME": str(tmp_path),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        },
        cwd=tmp_path,
        timeout=30,
    )
    assert not mark.exists(), "llama-server was started"
    return proc


@pytest.mark.parametrize("folder", [ENTRIES_DIR, BLOCKS_DIR, SNAPSHOTS_DIR])
def test_a_file_where_a_store_folder_goes_is_one_line_naming_it(tmp_path: Path, folder: str) -> None:
    save_dir = Path(os.path.realpath(tmp_path / "c"))
    save_dir.mkdir()
    (save_dir / folder).write_text("")
    proc = run_cli(tmp_path, save_dir)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"slotkeeper: error: cannot prepare slot save directory {save_dir}: {save_dir / folder} is not a directory"
    ]


@pytest.mark.parametrize("folder", [ENTRIES_DIR, BLOCKS_DIR, SNAPSHOTS_DIR])
def test_a_store_folder_left_by_sudo_is_one_line_naming_it(tmp_path: Path, folder: str) -> None:
    """`sudo slotkeeper` under umask 077 leaves root's folders of mode 700: for another user, one line naming the
    folder and its owner (was: `internal error: PermissionError(13, 'Permission denied')`, exit 70)."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root (CI runs as root)")
    nobody = pwd.getpwnam("nobody")
    save_dir = Path(os.path.realpath(tmp_path / "c"))
    (save_dir / folder).mkdir(parents=True)
    os.chown(save_dir / folder, nobody.pw_uid, nobody.pw_gid)
    (save_dir / folder).chmod(0o700)
    proc = run_cli(tmp_path, save_dir, as_ordinary_user=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"slotkeeper: error: cannot prepare slot save directory {save_dir}: {save_dir / folder} is not readable, "
        "writable or enterable (Permission denied, mode 700): it belongs to nobody: chown -R it to this user"
    ]


def test_an_own_store_folder_without_write_permission_is_one_line(tmp_path: Path) -> None:
    save_dir = Path(os.path.realpath(tmp_path / "c"))
    (save_dir / BLOCKS_DIR).mkdir(parents=True)
    (save_dir / BLOCKS_DIR).chmod(0o500)
    proc = run_cli(tmp_path, save_dir, as_ordinary_user=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"slotkeeper: error: cannot prepare slot save directory {save_dir}: {save_dir / BLOCKS_DIR} is not "
        "writable (Permission denied, mode 500): chmod u+rwx it"
    ]


def test_a_good_layout_still_prepares(tmp_path: Path) -> None:
    """blocks/ may be missing (made with the first block); entries/ and snapshots/ are made."""
    assert prepare_layout(tmp_path) == str(tmp_path / SNAPSHOTS_DIR)
    assert (tmp_path / ENTRIES_DIR).is_dir() and not (tmp_path / BLOCKS_DIR).exists()
    (tmp_path / BLOCKS_DIR).mkdir()
    assert prepare_layout(tmp_path) == str(tmp_path / SNAPSHOTS_DIR)


# -- the S3 endpoint


@pytest.mark.parametrize(
    "endpoint",
    ["http://127.0.0.1:99999", "http://127.0.0.1:65536", "https://s3.example:0", "http://host:abc", "http://[::1"],
)
def test_an_endpoint_with_a_bad_port_is_one_line(tmp_path: Path, endpoint: str) -> None:
    """A port out of range used to reach obstore's signer, which panicked (a Rust backtrace)."""
    with pytest.raises(ValueError) as caught:
        RemoteConfig.from_url("s3://bucket/x", {"HOME": str(tmp_path), "AWS_ENDPOINT_URL": endpoint})
    assert str(caught.value) == f"the S3 endpoint must look like http(s)://host[:port] (got {endpoint!r})"


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:65535", "https://s3.example:1/", "http://[::1]:9000"])
def test_an_endpoint_with_a_good_port_is_kept(tmp_path: Path, endpoint: str) -> None:
    config = RemoteConfig.from_url("s3://bucket/x", {"HOME": str(tmp_path), "AWS_ENDPOINT_URL": endpoint})
    assert config.endpoint == endpoint.rstrip("/")


def test_ls_remote_with_a_bad_endpoint_port_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "slotkeeper.cli", "ls", "--remote", "--remote-store", "s3://bucket/x"],
        capture_output=True,
        text=True,
        env={
            "HOME": str(tmp_path),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "AWS_ACCESS_KEY_ID": "dummy",
            "AWS_SECRET_ACCESS_KEY": "dummy",
            "AWS_ENDPOINT_URL": "http://127.0.0.1:99999",
        },
        cwd=tmp_path,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "slotkeeper ls: error: the S3 endpoint must look like http(s)://host[:port] (got 'http://127.0.0.1:99999')"
    ]


# -- --log-level debug's tracebacks


@pytest.fixture
def restored_logger() -> Iterator[None]:
    logger = logging.getLogger(LOGGER_NAME)
    saved = logger.handlers[:], logger.level, logger.propagate
    try:
        yield
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def log_a_failure(level: str, fmt: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    setup_logging(level, fmt)  # (its handler writes to the sys.stderr capsys put in place)
    logger = logging.getLogger(LOGGER_NAME)
    try:
        raise RuntimeError("the disk went away")
    except RuntimeError as exc:
        logger.error("save failed: %s", exc, exc_info=exc)
    return capsys.readouterr().err.splitlines()


@pytest.mark.usefixtures("restored_logger")
def test_debug_plain_lines_carry_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    lines = log_a_failure("debug", "plain", capsys)
    assert lines[0] == "slotkeeper: error: save failed: the disk went away"
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == "RuntimeError: the disk went away"
    assert any("log_a_failure" in line for line in lines)


@pytest.mark.usefixtures("restored_logger")
def test_debug_json_lines_carry_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    lines = log_a_failure("debug", "json", capsys)
    assert len(lines) == 1  # still one object per line
    event = json.loads(lines[0])
    assert event["msg"] == "save failed: the disk went away"
    assert event["exc"].startswith("Traceback (most recent call last):")
    assert event["exc"].endswith("RuntimeError: the disk went away")


@pytest.mark.usefixtures("restored_logger")
@pytest.mark.parametrize("fmt", ["plain", "json"])
def test_above_debug_an_event_stays_one_line(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    lines = log_a_failure("info", fmt, capsys)
    assert len(lines) == 1 and "Traceback" not in lines[0]
