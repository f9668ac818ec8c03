"""An agent's session, plain llama-server vs slotkeeper side by side: what the idle saves cost in disk writes,
turn latency and llama-server's time.

An agent's chat is long and grows in steps: a long opening (system prompt and tools, then the task), then turns
that each add the model's short reply and a tool's output, with a pause after each while the tool runs. Every
pause longer than slotkeeper's --autosave-idle saves the chat, so a session of N turns makes about N saves of an
ever longer state. This measures what that costs, on the 16 KiB-a-token model of turns.py (TURNS_MODEL: 8 layers
x 512, 8 KV heads of 64, f16 KV), with one slot and the same llama-server arguments on every side. The sides run
at the same time, interleaved turn by turn (the order of the sides rotating), each with its own copy of the chat.
The pause follows each slotkeeper's turn, so that its idle save runs with nothing else running and never slows
another side's turn: a side's next turn thus comes more than a pause later, and a save slower than the pause's
margin over --autosave-idle (which would delay a real agent's next turn) shows in the save times, not in the
latency. Every server's output goes through a pipe (turns.Server), so that its log lines are not disk writes of
its own. Prints:

  - bytes that reached the disk during the session (the opening's turn to the last turn's idle save):
    write_bytes - cancelled_write_bytes from /proc/<pid>/io of plain llama-server, slotkeeper and slotkeeper's
    llama-server, the save directory's growth (allocated and apparent), and wchar for information; over the
    final state's size (one save of the final chat: the largest entry's `bytes` in entries/*.json). Target
    <= 1.5 (every idle save rewriting the whole chat makes it about half the number of saves);
  - each turn's latency (streamed, to the last token) through slotkeeper over plain's, paired per turn: the
    median (target <= 1.05) and p90, and the first token's; and, to tell slotkeeper from a busy machine, the
    same ratio of llama-server's own prompt_ms + predicted_ms, and the paired difference of the rest of the
    turn (HTTP, templating, slotkeeper);
  - the saves: how many (slotkeeper's log lines, by reason), the time llama-server's loop spent in each
    (`save_ms` of the manifests, read after every pause, since a save supersedes the chat's previous entry),
    and slotkeeper's own time per save (its log);
  - with --before REV, the same for slotkeeper from an older revision (a temporary `git worktree` of it, its src
    put on PYTHONPATH), in a column beside the current one.

    uv run python benchmarks/agent_session.py [--turns 20] [--opening-tokens 3000] [--tool-tokens 600]
        [--generate 16] [--idle 2] [--pause SECONDS] [--before REV] [--skip-current] [--keep]
"""

from __future__ import annotations

import argparse
import compileall
import itertools
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from benchsetup import bench_model, llama_server, slotkeeper_args, work_dir
from turns import MB, TURNS_MODEL, Server, pct

from slotkeeper.demo import Turn, stream_chat
from slotkeeper.testing.harness import clean_env, free_port, http_call, wait_until

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 32768
SAVE_WAIT_S = 120.0  # at most this long after the last pause for the last idle save's line
SETTLE_S = 1.0  # and then this much more before the last sample
# slotkeeper's line for a save: `chat 3f2a saved from slot 0 (idle): 12,345 tokens, 202.3 MB in 310 ms` (a hybrid
# model's: `... saved from slot 0 at its turn boundary (idle): 12,345 tokens (...), 202.3 MB in 310 ms`), where a
# store that keeps blocks says what it wrote: `202.3 MB (6.2 MB new) in 310 ms`
SAVE_LINE = re.compile(
    r"\b(chat|opening) \S+ saved from slot \d+ (?:at its turn boundary )?\((?P<why>[^)]*)\).*?"
    r"(?P<size>[\d.]+ [kKMGT]?B)(?: \((?P<new>[\d.]+ [kKMGT]?B) new\))? in (?P<ms>[\d,]+) ms"
)
UNITS = {"B": 1, "kB": 1000, "KB": 1000, "MB": MB, "GB": 1000 * MB, "TB": 1000_000 * MB}
VOCABULARY = (  # the words of the chat's made-up text
    "cache slot token prompt server request reply worker build index parser module config buffer thread socket "
    "header payload checksum manifest entry store layer tensor batch queue handler client upstream timeout retry "
    "commit branch patch diff test fixture assert record stream event metric counter sample window context"
)
WORDS = VOCABULARY.split()
TOOLS = ("read_file", "grep", "run_tests", "list_dir", "shell", "edit_file", "git_diff", "search_docs")


# ---- what the chat says: deterministic text of a given length in the model's tokens -------------------------


def fitted(port: int, make: Callable[[int], str], tokens: int) -> str:
    """Text from `make(n)` (n lines) cut to exactly `tokens` tokens of the model's tokenizer (llama-server's
    /tokenize and /detokenize), more lines asked for until there are enough."""
    lines = max(8, tokens // 12)
    while True:
        ids = http_call(port, "POST", "/tokenize", {"content": make(lines)}).body["tokens"]
        if len(ids) >= tokens:
            return str(http_call(port, "POST", "/detokenize", {"tokens": ids[:tokens]}).body["content"])
        lines *= 2


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def system_lines(n: int) -> str:
    rng = random.Random(1)
    head = [
        "You are a coding agent working in a repository on the user's behalf. You call tools, read what they "
        "return, and keep going until the task is done. The tools:"
    ]
    tools = [f"- {name}(path, query): {words(rng, 14)}." for name in TOOLS]
    rules = [f"Rule {i}: {words(rng, 10)}; say which file you used." for i in range(1, n + 1)]
    return "\n".join(head + tools + rules)


def task_lines(n: int) -> str:
    rng = random.Random(2)
    return "\n".join(
        ["Task: the daemon's store writes too much. Here is what I know so far:"]
        + [f"{i}. In src/{rng.choice(WORDS)}/{rng.choice(WORDS)}.py, {words(rng, 12)}." for i in range(1, n + 1)]
    )


def tool_lines(turn: int, n: int) -> str:
    """A tool's output for `turn`: log lines, test results or grep hits, the same on every side and every run."""
    rng = random.Random(1000 + turn)
    kind = turn % 3
    lines = []
    for i in range(n):
        a, b, c = rng.choice(WORDS), rng.choice(WORDS), rng.choice(WORDS)
        if kind == 0:
            level = rng.choice(("INFO", "INFO", "DEBUG", "WARN"))
            lines.append(
                f"12:{turn:02d}:{i % 60:02d}.{rng.randrange(1000):03d} {level} {a}[{rng.randrange(99)}] {b} {c}"
            )
        elif kind == 1:
            verdict = rng.choice(("PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"))
            lines.append(f"tests/test_{a}.py::test_{b}_{c} {verdict} [{min(100, i * 2):3d}%]")
        else:
            lines.append(f"src/{a}/{b}.py:{rng.randrange(1, 900)}:    {c} = {words(rng, 3).replace(' ', '_')}()")
    return "\n".join(lines)


# ---- what is measured of a process and a directory ----------------------------------------------------------


def proc_io(pid: int) -> dict[str, int]:
    """/proc/<pid>/io (all the process's threads): rchar, wchar, ..., write_bytes, cancelled_write_bytes."""
    with open(f"/proc/{pid}/io") as f:
        return {key: int(value) for key, value in (line.split(":") for line in f if ":" in line)}


def to_disk(io: dict[str, int]) -> int:
    """Bytes the process sent toward the disk: dirtied page-cache bytes less those truncated away before
    writeback (a file deleted before it was written out)."""
    return io["write_bytes"] - io["cancelled_write_bytes"]


def tree_usage(root: Path) -> tuple[int, int]:
    """(allocated, apparent) bytes of the files under `root`: `du` and `du --apparent-size`."""
    allocated = apparent = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:  # a transient file, gone since it was listed
                continue
            allocated += st.st_blocks * 512
            apparent += st.st_size
    return allocated, apparent


def read_manifests(save_dir: Path) -> dict[str, dict[str, Any]]:
    """The store's manifests now (entries/<id>.json), by entry id; one being written is skipped."""
    found = {}
    for path in (save_dir / "entries").glob("*.json"):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and "bytes" in manifest:
            found[path.stem] = manifest
    return found


def child_pid(sk: Server) -> int:
    """slotkeeper's llama-server: from its status, else the one child of its process."""
    try:
        return int(http_call(sk.port, "GET", "/slotkeeper/status").body["child_pid"])
    except (OSError, KeyError, TypeError, ValueError):
        children = [
            int(pid)
            for task in Path(f"/proc/{sk.proc.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()
        ]
        if len(children) != 1:
            raise RuntimeError(f"slotkeeper {sk.proc.pid} has children {children}, not one llama-server") from None
        return children[0]


# ---- one side: a server and its copy of the chat ------------------------------------------------------------


@dataclass
class Side:
    """A server (plain llama-server, or slotkeeper around one) and everything measured of it."""

    name: str
    server: Server
    save_dir: Path | None = None  # slotkeeper's
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)  # the opening's first, then one per turn
    warm: int = 0  # turns whose prompt reused all of the previous one
    pids: dict[str, int] = field(default_factory=dict)  # "server" and, for slotkeeper, "child"
    io_before: dict[str, dict[str, int]] = field(default_factory=dict)
    io_after: dict[str, dict[str, int]] = field(default_factory=dict)
    dir_before: tuple[int, int] = (0, 0)
    dir_after: tuple[int, int] = (0, 0)
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)  # every one seen during the session
    saves_before: int = 0  # slotkeeper's save lines before the session

    def send(self, generate: int) -> Turn:
        turn = stream_chat(self.server.port, self.messages, generate)
        if self.turns and turn.cache_n >= self.turns[-1].prompt_tokens:
            self.warm += 1
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": turn.content})
        return turn

    def saves(self) -> list[re.Match[str]]:
        """slotkeeper's save lines in its log so far."""
        return list(SAVE_LINE.finditer(self.server.log_path.read_text(errors="replace")))

    def sample(self) -> dict[str, dict[str, int]]:
        return {label: proc_io(pid) for label, pid in self.pids.items()}

    def note_manifests(self) -> None:
        if self.save_dir is not None:
            self.manifests.update(read_manifests(self.save_dir))


def start_servers(args: argparse.Namespace, work: Path, before: tuple[Path, str] | None) -> list[Side]:
    binary = llama_server()
    model = bench_model("model-turns.gguf", TURNS_MODEL)
    env = clean_env(binary)
    llama_args = ["-m", str(model), "-c", str(CONTEXT), "-np", "1", "-t", "2", "-ctk", "f16", "-ctv", "f16"]
    llama_args.append("--no-cache-idle-slots")  # slotkeeper adds it otherwise: the same arguments on every side
    own = ["--autosave-idle", f"{args.idle:g}"]
    port = free_port()
    plain_command = [binary, *llama_args, "--host", "127.0.0.1", "--port", str(port)]
    sides = [Side("plain", Server(plain_command, port, work / "plain.log", env))]
    slotkeepers: list[tuple[str, dict[str, str]]] = []
    if not args.skip_current:
        slotkeepers.append(("slotkeeper", env))
        if args.disk_staging:  # the same, staging its saves on disk (as where there is no RAM filesystem)
            slotkeepers.append(("slotkeeper, disk staging", {**env, "SLOTKEEPER_RAM_STAGING": "false"}))
    if before is not None:
        path, commit = before
        slotkeepers.append((f"slotkeeper@{commit}", {**env, "PYTHONPATH": str(path / "src")}))
    for i, (name, side_env) in enumerate(slotkeepers):
        port = free_port()
        save_dir = work / f"sk{i}-cache"
        command = [sys.executable, "-m", "slotkeeper.cli", *slotkeeper_args(llama_args, port, save_dir, own)]
        sides.append(Side(name, Server(command, port, work / f"sk{i}.log", side_env), save_dir))
    for side in sides:
        side.server.wait_ready()
        side.pids["server"] = side.server.proc.pid
        if side.save_dir is not None:
            side.pids["child"] = child_pid(side.server)
    return sides


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def describe_tree() -> str:
    """What the current slotkeeper is: the working tree's commit, and whether its src differs from it."""
    try:
        head, changes = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "src")
    except (OSError, subprocess.CalledProcessError):
        return "the working tree"
    return f"the working tree (HEAD {head}{', src modified' if changes else ''})"


def older_checkout(rev: str, work: Path) -> tuple[Path, str]:
    """A detached worktree of `rev` under `work`, its slotkeeper compiled as an install has it; and its commit."""
    commit = git("rev-parse", "--short", f"{rev}^{{commit}}")
    path = work / "before"
    git("worktree", "add", "--detach", "--quiet", str(path), rev)
    compileall.compile_dir(path / "src" / "slotkeeper", quiet=1, force=True)
    return path, commit


# ---- the session ----------------------------------------------------------------------------------------------


def run_session(sides: list[Side], args: argparse.Namespace, pause: float) -> dict[str, Any]:
    port = sides[0].server.port  # the plain llama-server tokenizes
    system = fitted(port, system_lines, args.opening_tokens * 2 // 3)
    task = fitted(port, task_lines, args.opening_tokens - args.opening_tokens * 2 // 3)
    outputs = [fitted(port, partial(tool_lines, t), args.tool_tokens) for t in range(args.turns)]
    for side in sides:
        side.messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        side.io_before = side.sample()
        if side.save_dir is not None:
            side.dir_before = tree_usage(side.save_dir)
            side.saves_before = len(side.saves())
    orders = list(itertools.permutations(sides))
    marks: dict[str, int] = {}  # each slotkeeper's save lines after the last turn
    started = time.monotonic()
    for i in range(args.turns + 1):  # the opening, then the turns
        if i > 0:
            name = TOOLS[(i - 1) % len(TOOLS)]
            for side in sides:
                side.messages.append({"role": "user", "content": f"Tool output ({name}):\n{outputs[i - 1]}"})
        for side in orders[i % len(orders)]:
            side.send(args.generate)
            if side.save_dir is None:
                continue
            if i == args.turns:  # the last turn's idle save is the first save line after this
                marks[side.name] = len(side.saves())
            time.sleep(pause)  # its idle save, with nothing else running
            side.note_manifests()
        shown = ", ".join(f"{side.name} {side.turns[-1].total_s:.2f} s" for side in sides)
        label = "opening" if i == 0 else f"turn {i}/{args.turns}"
        print(f"  {label}: {sides[0].turns[-1].prompt_tokens:,} tokens; {shown}", flush=True)
    # the last turn's idle save: its line in each slotkeeper's log, then a little more
    last = [side for side in sides if side.save_dir is not None]
    if not wait_until(lambda: all(len(side.saves()) > marks[side.name] for side in last), SAVE_WAIT_S, 0.1):
        print(f"  (no save line after the last turn within {SAVE_WAIT_S:g} s: sampled anyway)", flush=True)
    time.sleep(SETTLE_S)
    for side in sides:
        side.io_after = side.sample()
        side.note_manifests()
        if side.save_dir is not None:
            side.dir_after = tree_usage(side.save_dir)
    return {"seconds": time.monotonic() - started, "opening": sides[0].turns[0].prompt_tokens}


# ---- the report -------------------------------------------------------------------------------------------------


def fmt_mb(n: float) -> str:
    """`2,306.4 MB`; under a megabyte, `12.3 kB` or `0 B`."""
    if abs(n) < 1000:
        return f"{n:.0f} B"
    return f"{n / 1000:.1f} kB" if abs(n) < MB else f"{n / MB:,.1f} MB"


def parse_size(text: str) -> float:
    """`202.3 MB` (log.fmt_bytes) in bytes."""
    number, unit = text.split()
    return float(number) * UNITS[unit]


def column(side: Side, plain: Side) -> dict[str, str]:
    """One column of the table: what it says of `side`."""
    out: dict[str, str] = {}
    disk = {label: to_disk(side.io_after[label]) - to_disk(side.io_before[label]) for label in side.pids}
    wchar = {label: side.io_after[label]["wchar"] - side.io_before[label]["wchar"] for label in side.pids}
    total = sum(disk.values())
    out["to disk"] = fmt_mb(total)
    out["wchar"] = fmt_mb(sum(wchar.values()))
    if side is not plain:
        ratios = [s.total_s / p.total_s for s, p in zip(side.turns[1:], plain.turns[1:])]
        firsts = [s.first_token_s / p.first_token_s for s, p in zip(side.turns[1:], plain.turns[1:])]
        out["latency"] = f"{statistics.median(ratios):.2f} med, {pct(ratios, 0.9):.2f} p90"
        out["first token"] = f"{statistics.median(firsts):.2f} med, {pct(firsts, 0.9):.2f} p90"
        out["opening"] = f"{side.turns[0].total_s / plain.turns[0].total_s:.2f}"
        compute = [s.server_ms / p.server_ms for s, p in zip(side.turns[1:], plain.turns[1:]) if p.server_ms]
        if compute:
            out["own time"] = f"{statistics.median(compute):.2f} med, {pct(compute, 0.9):.2f} p90"
        outside = [
            (s.total_s - s.server_ms / 1000) - (p.total_s - p.server_ms / 1000)
            for s, p in zip(side.turns[1:], plain.turns[1:])
        ]
        out["outside"] = f"{statistics.median(outside) * 1000:+.1f} ms med"
    out["turn median"] = f"{statistics.median(t.total_s for t in side.turns[1:]) * 1000:,.0f} ms"
    out["warm"] = f"{side.warm} of {len(side.turns) - 1}"
    if side.save_dir is None:
        return out
    out["to disk: slotkeeper"] = fmt_mb(disk["server"])
    out["to disk: its child"] = fmt_mb(disk["child"])
    entries = read_manifests(side.save_dir)
    final = max(entries.values(), key=lambda m: int(m["bytes"]), default=None)
    if final is not None:
        out["final state"] = f"{fmt_mb(int(final['bytes']))}"
        out["final tokens"] = f"{int(final['tokens']):,}"
        out["/ final state"] = f"{total / int(final['bytes']):.2f}x"
    grown = (side.dir_after[0] - side.dir_before[0], side.dir_after[1] - side.dir_before[1])
    out["dir growth"] = f"{fmt_mb(grown[0])} ({fmt_mb(grown[1])} apparent)"
    out["entries"] = f"{len(entries)} ({len(side.manifests)} seen)"
    lines = side.saves()[side.saves_before :]
    reasons = Counter("opening" if line[1] == "opening" else line["why"] for line in lines)
    out["saves"] = f"{len(lines)}: " + ", ".join(f"{n} {why}" for why, n in reasons.most_common())
    own = [float(m["save_ms"]) for m in side.manifests.values() if m.get("save_ms") is not None]
    if own:
        out["save_ms"] = f"{len(own)}: med {statistics.median(own):,.0f}, max {max(own):,.0f}"
    new = [parse_size(line["new"] or line["size"]) for line in lines]
    if new:
        out["new per save"] = f"{fmt_mb(sum(new))}; med {fmt_mb(statistics.median(new))}, max {fmt_mb(max(new))}"
    walls = [float(line["ms"].replace(",", "")) for line in lines]
    if walls:
        out["save wall"] = f"med {statistics.median(walls):,.0f}, max {max(walls):,.0f} ms"
    return out


ROWS = [
    ("final state", "final state (one save)"),
    ("final tokens", "  its tokens"),
    ("to disk", "to disk (write-cancel)"),
    ("to disk: slotkeeper", "  slotkeeper process"),
    ("to disk: its child", "  its llama-server"),
    ("/ final state", "  / final state"),
    ("dir growth", "save dir growth (du)"),
    ("wchar", "wchar (all writes)"),
    ("entries", "entries at the end"),
    ("latency", "turn latency / plain"),
    ("first token", "first token / plain"),
    ("own time", "  llama-server's own"),
    ("outside", "  the rest, minus plain's"),
    ("opening", "opening's turn / plain"),
    ("turn median", "turn latency"),
    ("warm", "warm turns"),
    ("saves", "saves (log, by reason)"),
    ("new per save", "  written (log): sum; each"),
    ("save_ms", "llama-server save_ms"),
    ("save wall", "slotkeeper's save time"),
]


def report(sides: list[Side], args: argparse.Namespace, pause: float, session: dict[str, Any]) -> None:
    plain = sides[0]
    columns = [column(side, plain) for side in sides]
    widths = [max(len(side.name), *(len(c.get(key, "")) for key, _ in ROWS)) + 3 for side, c in zip(sides, columns)]
    label_width = max(len(label) for _, label in ROWS) + 2
    print()
    print(
        f"agent session: {session['opening']:,}-token opening + {args.turns} turns x {args.tool_tokens} tokens of "
        f"tool output and {args.generate} generated, pauses {pause:g} s (> --autosave-idle {args.idle:g}); "
        f"model {TURNS_MODEL.n_layers} layers x {TURNS_MODEL.width}, f16 KV, 16 KiB a token; -c {CONTEXT} -np 1; "
        f"{session['seconds']:.0f} s"
    )
    if not args.skip_current:
        print(f"slotkeeper: {describe_tree()}")
    if args.before is not None:
        print(f"{sides[-1].name}: --before {args.before}, a temporary worktree of it on PYTHONPATH")
    print(" " * label_width + "".join(side.name.rjust(w) for side, w in zip(sides, widths)))
    for key, label in ROWS:
        if any(key in c for c in columns):
            print(label.ljust(label_width) + "".join(c.get(key, "-").rjust(w) for c, w in zip(columns, widths)))
    print(
        "(to disk: write_bytes - cancelled_write_bytes of /proc/<pid>/io, from before the opening's turn to after "
        "the last idle save. The bytes of a file deleted before writeback are cancelled in the process that deletes "
        "it, so slotkeeper's own count may be negative: the sum is what reached the disk. Targets: / final state "
        "<= 1.5, turn latency / plain <= 1.05 median.)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=20, help="turns after the opening (default 20)")
    parser.add_argument("--opening-tokens", type=int, default=3000, help="system prompt + task (default 3000)")
    parser.add_argument("--tool-tokens", type=int, default=600, help="tool output per turn (default 600 tokens)")
    parser.add_argument("--generate", type=int, default=16, help="tokens generated per turn (default 16)")
    parser.add_argument("--idle", type=float, default=2.0, help="slotkeeper's --autosave-idle (default 2 s)")
    parser.add_argument("--pause", type=float, help="seconds after each turn (default: --idle + 1.5)")
    parser.add_argument("--before", metavar="REV", help="also run slotkeeper from this git revision")
    parser.add_argument("--skip-current", action="store_true", help="no slotkeeper from the working tree")
    parser.add_argument(
        "--disk-staging", action="store_true", help="also the working tree's slotkeeper with --no-ram-staging"
    )
    parser.add_argument("--keep", action="store_true", help="keep the working directory (logs, stores)")
    args = parser.parse_args()
    if args.skip_current and args.before is None:
        parser.error("--skip-current leaves nothing to compare without --before")
    pause = args.pause if args.pause is not None else args.idle + 1.5
    if (args.opening_tokens + args.turns * (args.tool_tokens + args.generate + 32)) > CONTEXT:
        parser.error(f"the session would not fit in -c {CONTEXT}")

    work = work_dir("agent-session")
    before = None
    sides: list[Side] = []
    try:
        if args.before is not None:
            before = older_checkout(args.before, work)
        print("starting the servers ...", flush=True)
        sides = start_servers(args, work, before)
        session = run_session(sides, args, pause)
        report(sides, args, pause, session)  # before the logs and stores go
    finally:
        for side in sides:
            side.server.stop()
        if before is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before[0])], check=False)
        if args.keep:
            print(f"(logs and stores kept in {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
