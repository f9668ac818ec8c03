"""6. Argument forms: slotkeeper reads llama-server's command line the way llama-server and llama-swap write it."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotkeeper.cmdline import ConfigError, executable, find_llama_server, parse_llama_args, plan_launch
from slotkeeper.config import Options, build_run_config, plain_options
from slotkeeper.llama.supervisor import make_endpoint, remove_stale_runtime_dirs
from slotkeeper.portable import VARIABLE as PORTABLE_VARIABLE


def env_for(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"LLAMA_SERVER": sys.executable, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path), **extra}


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "m.gguf", "--port", "9001", "-np", "2", "--slot-save-path", "DIR"],
        ["-m", "m.gguf", "--port=9001", "--parallel=2", "--slot-save-path=DIR"],
        ["--model=m.gguf", "--port", "9001", "--parallel", "2", "--slot_save_path", "DIR"],
    ],
)
def test_6_argument_forms(tmp_path, argv):
    argv = [a.replace("DIR", str(tmp_path / "c")) for a in argv]
    config = build_run_config(argv, env_for(tmp_path))
    assert config.port == 9001
    assert config.total_slots_hint == 2
    assert config.save_dir == (tmp_path / "c").resolve() and config.save_dir.is_dir()
    # taken-over flags never reach the child; the ones it needs are re-emitted in the form it accepts
    assert not any(
        a.startswith(("--port", "--host", "--slot-save-path", "--slot_save_path")) for a in config.child_args
    )
    assert any(a in ("-np", "--parallel") for a in config.child_args)
    assert "--no-cache-idle-slots" in config.child_args
    command = plan_launch(argv, env_for(tmp_path)).child_command(["--host", "/x.sock"])
    # the child saves into snapshots/ (clients' names and slotkeeper's transient ones); the store's entries/
    # beside it are out of any request's reach
    assert command[0] == sys.executable
    assert command[-2:] == ["--slot-save-path", str(config.save_dir / "snapshots")]
    assert (config.save_dir / "snapshots").is_dir() and (config.save_dir / "entries").is_dir()


def test_6_env_forms(tmp_path):
    env = env_for(
        tmp_path,
        LLAMA_ARG_PORT="9100",
        LLAMA_ARG_HOST="0.0.0.0",
        LLAMA_API_KEY="k1,k2",
        SLOTKEEPER_DRAIN_TIMEOUT="2.5",
        SLOTKEEPER_CHILD_TCP="true",
    )
    config = build_run_config(["-m", "m.gguf"], env)
    assert (config.hosts, config.port, config.api_key) == (["0.0.0.0"], 9100, "k1")
    assert config.options.drain_timeout == 2.5 and config.options.child_tcp
    # the command line wins over the environment, as in llama-server
    assert build_run_config(["--port", "9200"], env).port == 9200
    assert build_run_config(["--drain-timeout=1", "--", "-m", "m.gguf"], env).options.drain_timeout == 1


def test_6_default_save_dir_is_per_model(tmp_path, monkeypatch):
    a = build_run_config(["-m", str(tmp_path / "a.gguf")], env_for(tmp_path)).save_dir
    b = build_run_config(["-m", str(tmp_path / "b.gguf")], env_for(tmp_path)).save_dir
    assert a != b and a.parent == b.parent == (tmp_path / "xdg" / "slotkeeper").resolve()
    # the name every earlier version chose: a user's default store stays where it was
    assert a.name == "a.gguf-" + hashlib.sha256(str((tmp_path / "a.gguf").resolve()).encode()).hexdigest()[:8]
    monkeypatch.chdir(tmp_path)  # the model's real path names it, however it is given
    assert build_run_config(["-m", "a.gguf"], env_for(tmp_path)).save_dir == a


def test_6_user_choice_of_idle_slot_caching_is_kept(tmp_path):
    config = build_run_config(["--cache-idle-slots"], env_for(tmp_path))
    assert "--no-cache-idle-slots" not in config.child_args and "--cache-idle-slots" in config.child_args
    config = build_run_config(["--llama-idle-slot-caching", "--", "-m", "x"], env_for(tmp_path))
    assert "--no-cache-idle-slots" not in config.child_args


def test_api_key_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nfirst\nsecond\n")
    assert build_run_config(["--api-key-file", str(keys)], env_for(tmp_path)).api_key == "first"
    assert parse_llama_args(["--api-key", "a,b"], {}).api_keys == ["a", "b"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "abc"], "invalid --port"),
        (["--port", "70000"], "invalid --port"),
        (["--port"], "needs a value"),
        (["-np", "many"], "invalid -np"),
        (["--drain-timeout", "-1", "--", "-m", "x"], "invalid --drain-timeout"),
        (["--bogus", "1", "--"], "unknown option --bogus"),
        (["--log-level", "loud", "--"], "invalid --log-level"),
        (["--api-key-file", "/nonexistent/keys"], "cannot read --api-key-file"),
    ],
)
def test_6_bad_values_are_one_clear_error(tmp_path, argv, message):
    with pytest.raises(ConfigError, match=message):
        build_run_config(argv, env_for(tmp_path))


def test_unwritable_save_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot create slot save directory"):
        build_run_config(["--slot-save-path", str(blocker / "sub")], env_for(tmp_path))
    with pytest.raises(ConfigError, match=r"slot save path .*/file is not a directory \(a file is in the way\)$"):
        build_run_config(["--slot-save-path", str(blocker)], env_for(tmp_path))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "entries").write_text("")  # a file where the store's folder goes
    with pytest.raises(ConfigError, match=r"cannot prepare slot save directory .*/entries is not a directory"):
        build_run_config(["--slot-save-path", str(taken)], env_for(tmp_path))


def test_missing_llama_server(tmp_path):
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path), "LLAMA_SERVER": str(tmp_path / "nope")}
    with pytest.raises(ConfigError, match="not found"):
        build_run_config([], env)


def test_llama_server_is_found_where_shutil_which_finds_it(tmp_path, monkeypatch):
    """cmdline.executable stands in for shutil.which, whose import would come before the spawn: the same answer
    for a bare name on PATH (a directory and a file that cannot run in the way), a path, and a name nowhere."""
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "llama-server").mkdir(parents=True)
    (first / "tool").write_text("")
    second.mkdir()
    for program in (second / "llama-server", second / "tool"):
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{first}{os.pathsep}{second}")
    names = ["llama-server", "tool", "nowhere", str(first / "tool"), str(second / "tool"), str(first / "llama-server")]
    assert [executable(name) for name in names] == [shutil.which(name) for name in names]
    assert find_llama_server(None, {}) == [str(second / "llama-server")]
    assert find_llama_server(f"{second / 'tool'} --flag", {}) == [str(second / "tool"), "--flag"]


@pytest.fixture
def short_tmp() -> typing.Iterator[Path]:
    """A directory with a short path, as $TMPDIR is (pytest's tmp_path leaves a socket no room: see below)."""
    path = Path(tempfile.mkdtemp(prefix="sk", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_childs_runtime_directory_is_private_and_stale_ones_are_removed(short_tmp, monkeypatch):
    """A slotkeeper that was SIGKILLed leaves its runtime directory (named after its pid) in $TMPDIR; the next
    start removes it, and no other."""
    tmp_path = short_tmp
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale, living, unrelated = (
        tmp_path / name for name in (f"slotkeeper-{gone.pid}-x", f"slotkeeper-{os.getpid()}-x", "slotkeeper-x")
    )
    for folder in (stale, living, unrelated):
        folder.mkdir()
    (stale / "llama-server.sock").write_text("")
    endpoint = make_endpoint(False)
    runtime_dir = Path(endpoint.runtime_dir)
    assert runtime_dir.parent == tmp_path and stat.S_IMODE(runtime_dir.stat().st_mode) == 0o700
    assert endpoint.host_arg == ["--host", str(runtime_dir / "llama-server.sock")]
    remove_stale_runtime_dirs()
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([runtime_dir.name, living.name, unrelated.name])


@pytest.mark.parametrize("portable", [False, True])
def test_a_socket_path_too_long_for_the_platform_goes_to_tmp(short_tmp, monkeypatch, portable):
    """A unix socket's path has 107 bytes on Linux, 103 on macOS: in a $TMPDIR that leaves the socket 104 to 107
    bytes, the runtime directory is made there on Linux and in /tmp in the portable mode; in a longer one, in
    /tmp on both. The next start's housekeeping looks in both places."""
    monkeypatch.setenv(PORTABLE_VARIABLE, "1" if portable else "0")
    socket_tail = len(f"/slotkeeper-{os.getpid()}-{'0' * 12}/llama-server.sock")
    for length, in_tmp in ((106 - socket_tail, portable), (110 - socket_tail, True)):
        base = short_tmp / f"{length}"
        base = base / ("d" * (length - len(str(base)) - 1))
        base.mkdir(parents=True)
        assert len(str(base)) == length
        monkeypatch.setenv("TMPDIR", str(base))
        endpoint = make_endpoint(False)
        try:
            assert Path(endpoint.runtime_dir).parent == (Path("/tmp") if in_tmp else base), (
                length,
                endpoint.socket_path,
            )
            assert endpoint.socket_path is not None and len(endpoint.socket_path) <= (103 if portable else 107)
        finally:
            os.rmdir(endpoint.runtime_dir)
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = Path("/tmp") / f"slotkeeper-{gone.pid}-x"
    stale.mkdir()
    remove_stale_runtime_dirs()  # (with $TMPDIR the long one)
    assert not stale.exists()


def test_no_directory_short_enough_for_the_socket_is_one_clear_error(tmp_path):
    """A $TMPDIR too long for a socket's path and no /tmp: one line that says how long it would be and what to
    do, exit 2, no llama-server started."""
    mark, base = tmp_path / "started", tmp_path / ("d" * 120)
    base.mkdir()
    start = (
        "import slotkeeper.llama.supervisor as supervisor, sys; supervisor.SHORT_TEMP_DIR = '/nonexistent'; "
        "from slotkeeper.cli import main; sys.exit(main())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", start, "-m", "m.gguf", "--slot-save-path", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env={**env_for(tmp_path), "TMPDIR": str(base), "LLAMA_SERVER": f"sh -c 'touch {mark}' sh"},
        cwd=tmp_path,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert re.fullmatch(
        rf"slotkeeper: error: llama-server's socket path {re.escape(str(base))}/slotkeeper-\d+-\w+/llama-server.sock "
        r"would be \d+ bytes, over the 107 a unix socket's path may have here: set TMPDIR to a shorter directory "
        r"\(or give slotkeeper --child-tcp\)",
        line,
    ), line
    assert not mark.exists() and not list(base.iterdir())


def test_a_read_only_temporary_directory_is_one_clear_error(tmp_path, short_tmp, read_only):
    """The child's socket directory goes in $TMPDIR: a read-only one (a real EROFS) is one line, exit 2, and no
    llama-server was started (LLAMA_SERVER would leave a mark)."""
    temporary, mark = short_tmp / "tmp", tmp_path / "started"
    temporary.mkdir()
    with read_only(temporary):
        proc = subprocess.run(
            [sys.executable, "-m", "slotkeeper.cli", "-m", "m.gguf", "--slot-save-path", str(tmp_path / "c")],
            capture_output=True,
            text=True,
            env={**env_for(tmp_path), "TMPDIR": str(temporary), "LLAMA_SERVER": f"sh -c 'touch {mark}' sh"},
            cwd=tmp_path,
            timeout=30,
        )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"slotkeeper: error: cannot create llama-server's socket directory in {temporary}: Read-only file system "
        "(set TMPDIR to a writable directory)"
    ]
    assert not mark.exists()


def test_a_temporary_directory_that_cannot_be_listed_leaves_the_start_alone(tmp_path, monkeypatch):
    """Removing stale runtime directories is housekeeping after the spawn: a $TMPDIR gone since ours was made in
    it (or unreadable) is no reason to stop a start, nor a traceback."""
    monkeypatch.setattr("slotkeeper.llama.supervisor.temp_dir", lambda: str(tmp_path / "gone"))
    remove_stale_runtime_dirs()


@pytest.mark.parametrize(("argv", "code"), [(["--port", "abc"], 1), (["--drain-timeout", "x", "--"], 2)])
def test_6_cli_bad_value_one_line_with_llama_servers_code_or_2(tmp_path, argv, code):
    """A bad value of one of llama-server's flags exits 1, as plain llama-server does; of slotkeeper's own, 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "slotkeeper.cli", *argv],
        capture_output=True,
        text=True,
        env={**env_for(tmp_path), "LLAMA_SERVER": "true", "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        timeout=30,
    )
    assert proc.returncode == code
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("slotkeeper: error: invalid"), proc.stderr


def test_a_llama_server_that_cannot_start_is_one_clear_error(tmp_path):
    """An executable file the kernel cannot run (no format it knows): one line, exit 2, as before the daemon."""
    binary = tmp_path / "llama-server"
    binary.write_bytes(b"\x00not a program\n")
    binary.chmod(0o755)
    proc = subprocess.run(
        [sys.executable, "-m", "slotkeeper.cli", "-m", "m.gguf", "--slot-save-path", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env={**env_for(tmp_path), "LLAMA_SERVER": str(binary)},
        cwd=tmp_path,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"slotkeeper: error: cannot start {binary}: Exec format error"]


def test_own_options_table_matches_the_model():
    """cmdline parses own options before config is imported; its table must list exactly Options' fields."""
    from slotkeeper.cmdline import OWN_OPTIONS
    from slotkeeper.config import Options

    types = typing.get_type_hints(Options, localns={"ByteSize": int})
    assert {f.name: types[f.name] is bool for f in dataclasses.fields(Options)} == OWN_OPTIONS


def test_dotenv_in_the_working_directory_is_read(tmp_path):
    """A .env next to where slotkeeper runs supplies SLOTKEEPER_* settings (bad ones fail the same way)."""
    (tmp_path / ".env").write_text("SLOTKEEPER_DRAIN_TIMEOUT=soon\n")
    proc = subprocess.run(
        [sys.executable, "-m", "slotkeeper.cli", "-m", "m.gguf"],
        capture_output=True,
        text=True,
        env={**env_for(tmp_path), "LLAMA_SERVER": "true", "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        timeout=30,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "slotkeeper: error: invalid --drain-timeout: input should be a valid number, "
        "unable to parse string as a number (got 'soon')"
    )


@pytest.mark.parametrize(
    ("given", "sleeps_after"), [(["--sleep-idle-seconds", "30"], 30), (["--sleep-idle-seconds=-1"], None), ([], None)]
)
def test_llama_servers_own_sleep_is_read_and_left_to_it(tmp_path, given, sleeps_after):
    """--sleep-idle-seconds is llama-server's: slotkeeper reads it (its idle save must come first) and passes it on."""
    config = build_run_config(["-m", "m.gguf", *given], env_for(tmp_path))
    assert config.child_sleeps_after == sleeps_after
    assert ("--sleep-idle-seconds" in config.child_args) == bool(given)


@pytest.mark.parametrize(
    ("sleep_s", "autosave", "after"), [(3, 5.0, 1.5), (60, 5.0, 5.0), (60, 0.0, 58.0), (300, 600.0, 298.0)]
)
def test_the_idle_save_comes_before_llama_servers_sleep(sleep_s, autosave, after):
    from slotkeeper.llama.sleep import save_after

    assert save_after(sleep_s, autosave) == after


@pytest.mark.parametrize(
    ("given", "models_max", "autoload"),
    [([], 4, True), (["--models-max", "2", "--no-models-autoload"], 2, False), (["--models-max=0"], 0, True)],
)
def test_a_router_is_run_so_that_slotkeeper_decides_its_unloads(tmp_path, given, models_max, autoload):
    """Router mode (no model, --models-dir): the user's --models-max is slotkeeper's to apply; the router
    itself gets no limit, so it never unloads a model whose chats are unsaved. Autoload stays the user's."""
    config = build_run_config(["--models-dir", str(tmp_path), *given], env_for(tmp_path))
    assert config.router and (config.models_max, config.models_autoload) == (models_max, autoload)
    assert config.child_args[-2:] == ["--models-max", "0"]
    assert config.child_args.count("--models-max") == 1
    assert ("--no-models-autoload" in config.child_args) == (not autoload)
    one_model = build_run_config(["-m", "m.gguf", "--models-dir", str(tmp_path), *given], env_for(tmp_path))
    assert not one_model.router


def test_plain_own_options_mean_no_pydantic_import(tmp_path):
    """Importing pydantic and building its model cost ~125 ms of every start (config.py): with no option of
    slotkeeper's own, or only plain values, there is nothing for it to judge; a value that is not plain is
    judged by it, and its message is the one line."""
    code = (
        "import sys\n"
        "from slotkeeper.cmdline import ConfigError\n"
        "from slotkeeper.config import build_run_config\n"
        "try:\n"
        "    config = build_run_config(sys.argv[1:], {'LLAMA_SERVER': sys.executable, 'HOME': sys.argv[-1]})\n"
        "    print(config.options.drain_timeout, config.options.max_cache_bytes, config.port)\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
        "print('pydantic' in sys.modules)\n"
    )
    save_dir = str(tmp_path / "c")
    run = [sys.executable, "-c", code, "-m", "m.gguf", "--slot-save-path", save_dir]

    def started(*own: str) -> list[str]:
        head = [*run[:3], *own, "--"] if own else run[:3]
        done = subprocess.run([*head, *run[3:]], capture_output=True, text=True, timeout=30, check=True)
        return done.stdout.strip().splitlines()

    assert started() == ["5.0 None 8080", "False"]
    assert started("--drain-timeout", "2.5", "--max-cache-bytes", "20GB", "--log-level=debug", "--no-fsync") == [
        "2.5 20000000000 8080",
        "False",
    ]
    message, imported = started("--drain-timeout", "soon")
    assert message.startswith("invalid --drain-timeout: input should be a valid number") and imported == "True"


# Raw values as command lines and environments give them: plain forms, near misses and junk.
RAW_WORDS = [
    *("0", "1", "5", "007", "0.5", "2.5", ".5", "5.", "1e3", "-1", "+1", " 5", "5 ", "1_000", "inf", "nan"),
    *("10GB", "10gb", "10 GB", "1.5GiB", "2kib", "3KB", "4k", "5Mb", "10XB", "20G", "0b", "0.4b", "1.0000001TB"),
    *("true", "True", "TRUE", "on", "Off", "yes", "no", "enabled", "t", "f", ""),
    *("debug", "DEBUG", "info", "json", "plain", "auto", "full", "sliding-window", "recurrent", "s3://b/p", "abc"),
    *("99999999999999999999", "9" * 16, "1.1234567", str(10**15), "12345678901234567", "12345678901234567GB"),
]
raw_value = st.one_of(
    st.sampled_from(RAW_WORDS), st.booleans(), st.text(alphabet="0123456789.-+eE _kKmMgGtTbBiI", max_size=10)
)
raw_options = st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(Options)]), raw_value, max_size=4)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(Options)])
def test_each_option_reads_every_raw_word_as_pydantic_does(name: str) -> None:
    values: list[str | bool] = [*RAW_WORDS, True, False]
    for value in values:
        assert_read_as_pydantic_reads({name: value})


@settings(max_examples=3000, deadline=None)
@given(raw_options)
def test_plain_values_are_read_as_pydantic_reads_them(raw):
    assert_read_as_pydantic_reads(raw)


def assert_read_as_pydantic_reads(raw: dict[str, str | bool]) -> None:
    """What plain_options reads, pydantic reads the same (value and kind); what pydantic refuses, it leaves to
    pydantic (None), so that every message about a bad value stays pydantic's."""
    from pydantic import ValidationError

    from slotkeeper.config import _options_model

    plain = plain_options(raw)
    try:
        judged = Options(**dict(_options_model().model_validate(raw)))
    except ValidationError:
        assert plain is None, raw
        return
    if plain is not None:
        fast = Options(**plain)
        assert fast == judged, raw
        for spec in dataclasses.fields(Options):
            assert isinstance(getattr(fast, spec.name), float) == isinstance(getattr(judged, spec.name), float)


@pytest.mark.parametrize(
    "raw",
    [
        {"max_cache_bytes": "20GB"},
        {"max_cache_bytes": "1.5GiB"},
        {"max_cache_bytes": "20000000000"},
        {"max_cache_bytes": str(10**15)},
        {"log_level": "debug", "log_format": "json"},
        {"fsync": False, "child_tcp": True},
        {"llama_idle_slot_caching": "on", "placement": "false"},
        {"drain_timeout": "5", "autosave_idle": "2.5", "startup_timeout": "120"},
        {"remote_store": "s3://bucket/prefix", "llama_server": "/opt/llama/llama-server"},
        {"recompute": "0", "min_save_tokens": "512", "model_memory": "sliding-window"},
    ],
)
def test_a_usual_command_line_is_read_without_pydantic(raw):
    """What command lines hold is plain (or every start with an option pays for pydantic again), and read as
    pydantic reads it."""
    from slotkeeper.config import _options_model

    plain = plain_options(raw)
    assert plain is not None and Options(**plain) == Options(**dict(_options_model().model_validate(raw)))
