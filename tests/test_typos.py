"""A user's typo or ordinary mistake at start-up is one line `slotkeeper: error: ...` and an exit code, never a
traceback; llama-server's informational flags (--version, --help) behave as with plain llama-server.

Each test runs the real command line in a subprocess. The fake llama-server (LLAMA_SERVER) leaves a mark when it
is started, and exits 3: a start that gets that far ends at once, with that code passed through.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slotkeeper.testing.harness import free_port

SLOTKEEPER = [sys.executable, "-m", "slotkeeper.cli"]
CHILD_EXIT = 3


def fake_server(mark: Path) -> str:
    return f"sh -c 'touch {mark}; exit {CHILD_EXIT}' sh"


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "LLAMA_SERVER": fake_server(tmp_path / "started"),
        "XDG_CACHE_HOME": str(tmp_path / "xdg"),
        "HOME": str(tmp_path),
        **extra,
    }


# Root reads a file of mode 000: without these capabilities (setpriv, util-linux) it cannot, as a user cannot.
AS_A_USER = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]


def run(
    argv: list[str], env: dict[str, str], cwd: Path, *, as_a_user: bool = False
) -> subprocess.CompletedProcess[str]:
    prefix = AS_A_USER if as_a_user and os.geteuid() == 0 else []
    return subprocess.run([*prefix, *SLOTKEEPER, *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=60)


def assert_one_error(proc: subprocess.CompletedProcess[str], line: str, code: int = 2) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [f"slotkeeper: error: {line}"], proc.stderr
    assert proc.returncode == code


def test_a_binary_api_key_file_is_one_line(tmp_path):
    (tmp_path / "key").write_bytes(b"\xff\xfe\x00\x01binary")
    argv = ["-m", "m.gguf", "--api-key-file", "key", "--slot-save-path", str(tmp_path / "c")]
    proc = run(argv, env_for(tmp_path), tmp_path)
    assert_one_error(proc, "cannot read --api-key-file key: not UTF-8 text")
    assert not (tmp_path / "started").exists()


@pytest.mark.parametrize("how", ["environment", "option"])
def test_an_unbalanced_quote_in_the_llama_server_command_is_one_line(tmp_path, how):
    command = str(tmp_path / "it's" / "llama-server")  # an apostrophe in a path that does not exist
    env = env_for(tmp_path)
    if how == "environment":
        env["LLAMA_SERVER"] = command
        own: list[str] = []
    else:
        own = ["--llama-server", command, "--"]
    proc = run([*own, "-m", "m.gguf", "--slot-save-path", str(tmp_path / "c")], env, tmp_path)
    assert_one_error(proc, f"llama-server {command!r} not found or not executable")


def test_a_model_path_that_is_not_utf8_gets_its_default_save_directory(tmp_path):
    """The default save directory's name digests the model path's bytes (os.fsencode); for a UTF-8 path those
    are the bytes every earlier version digested."""
    model = os.path.join(os.path.realpath(tmp_path), os.fsdecode(b"caf\xe9.gguf"))
    port = str(free_port())
    proc = run(["-m", model, "--port", port], env_for(tmp_path), tmp_path)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == CHILD_EXIT, proc.stderr
    assert f"slotkeeper: error: llama-server exited with code {CHILD_EXIT} during startup" in proc.stderr
    assert (tmp_path / "started").exists()
    digest = hashlib.sha256(os.fsencode(model)).hexdigest()[:8]
    saved = tmp_path / "xdg" / "slotkeeper" / f"{os.path.basename(model)}-{digest}"
    assert saved.is_dir(), list((tmp_path / "xdg" / "slotkeeper").iterdir())


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"A=caf\xe9\n", "not UTF-8 text"), (b"A=x\x00y\n", "embedded null byte"), (b"A=1\n", "Permission denied")],
    ids=["not-utf8", "nul", "unreadable"],
)
def test_a_dotenv_that_cannot_be_read_is_one_line(tmp_path, content, reason):
    dotenv = tmp_path / ".env"
    dotenv.write_bytes(content)
    if reason == "Permission denied":
        dotenv.chmod(0)
    argv = ["-m", "m.gguf", "--slot-save-path", str(tmp_path / "c")]
    proc = run(argv, env_for(tmp_path), tmp_path, as_a_user=reason == "Permission denied")
    assert_one_error(proc, f"cannot read .env: {reason}")
    assert not (tmp_path / "started").exists()


def run_in_removed_directory(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """slotkeeper started in a directory removed since the shell changed into it."""
    (tmp_path / "gone").mkdir()
    script = 'cd gone && rmdir ../gone && exec "$@"'
    return subprocess.run(
        ["sh", "-c", script, "sh", *SLOTKEEPER, *argv],
        capture_output=True,
        text=True,
        env={**env_for(tmp_path), "PATH": os.defpath},
        cwd=tmp_path,
        timeout=60,
    )


def test_a_removed_current_directory_skips_the_dotenv(tmp_path):
    """Plain llama-server runs there (given absolute paths), and so does slotkeeper: the child is started."""
    model = str(tmp_path / "m.gguf")
    proc = run_in_removed_directory(tmp_path, ["-m", model, "--port", str(free_port())])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == CHILD_EXIT, proc.stderr
    assert (tmp_path / "started").exists()


def test_a_relative_model_path_in_a_removed_current_directory_is_one_line(tmp_path):
    proc = run_in_removed_directory(tmp_path, ["-m", "m.gguf"])
    assert_one_error(proc, "cannot resolve model path m.gguf: the current directory no longer exists")
    assert not (tmp_path / "started").exists()


@pytest.mark.parametrize(
    "argv", [["--version"], ["--", "--help"], ["-m", "m.gguf", "--help"]], ids=["version", "help", "model-help"]
)
def test_informational_flags_behave_as_plain_llama_server(tmp_path, llama_server, argv):
    """Passed straight to llama-server: its output, its exit code 0, no line of slotkeeper's, nothing listening
    and no save directory created."""
    env = {**env_for(tmp_path), "LLAMA_SERVER": llama_server}
    plain = subprocess.run(
        [llama_server, *(a for a in argv if a != "--")], capture_output=True, text=True, env=env, timeout=60
    )
    assert plain.returncode == 0
    proc = run(argv, env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == (plain.stdout, plain.stderr)
    assert "slotkeeper" not in proc.stderr
    assert not (tmp_path / "xdg").exists()


def test_an_own_option_among_llama_servers_says_whose_it_is(tmp_path, llama_server):
    """`slotkeeper --drain-timeout 3 -m m.gguf` (no `--`): llama-server refuses the option and exits 1, as plain
    llama-server would; slotkeeper's line says the option is its own and where it goes."""
    env = {**env_for(tmp_path), "LLAMA_SERVER": llama_server}
    argv = ["--drain-timeout", "3", "--no-fsync", "-m", "m.gguf", "--slot-save-path", str(tmp_path / "c")]
    proc = run([*argv, "--port", str(free_port())], env, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (
        "slotkeeper: error: llama-server exited with code 1 during startup (its own output above says why); "
        "--drain-timeout and --no-fsync: slotkeeper's own, given before a --"
    ) in proc.stderr.splitlines(), proc.stderr[-2000:]
