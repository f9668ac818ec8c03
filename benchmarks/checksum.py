"""What checking an entry's checksum costs its restore.

Every entry carries `xxh3_128` of its file (entries.file_checksum), checked while llama-server restores it
(ConversationStore.restore). On the benchmarks' state-heavy model (turns.py's: 8 layers x 512, f16 KV, 16 KiB
per token) one ~N-token chat is saved through a real ConversationStore, then restored through it, alternating
in one run so that the machine's drift hits both alike:

  unchecked  ConversationStore.restore of the entry with its checksum left out (as an old manifest's)
  checked    ConversationStore.restore of the same entry, checksum and all
  alone      file_checksum() of its file, by itself (what checking it first, in series, would add)

from the page cache, and from disk (the file's pages dropped with posix_fadvise(DONTNEED) before each one).
Prints the medians and what the check adds to a restore (target: at most 10%).

    uv run python benchmarks/checksum.py [--tokens 7500] [--repeat 20]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from slotkeeper.cmdline import find_llama_server
from slotkeeper.llama.client import LlamaClient
from slotkeeper.proxy.upstream import ChildPool
from slotkeeper.store.conversations import ConversationStore
from slotkeeper.store.entries import file_checksum
from slotkeeper.testing.harness import free_port, health_status, http_call, wait_until
from slotkeeper.testing.tinymodel import TinyModelSpec, write_tiny_model

MODEL = TinyModelSpec(n_layers=8, width=512, n_heads=8, n_kv_heads=8, f16=True, name="slotkeeper-bench-turns")


def drop_pages(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def measure(port: int, root: Path, tokens: list[int], repeat: int) -> None:
    client = LlamaClient(ChildPool(port=port), None)
    store = ConversationStore(root, client, {"bench": "checksum"}, {}, fsync=True)
    store.open()
    reply = await client.call_json("POST", "/completion", payload={"prompt": tokens, "n_predict": 0, "id_slot": 0})
    assert reply.ok, reply.error
    saved = await store.save_slot(0)
    assert saved.entry is not None, saved.reason
    checked = saved.entry
    unchecked = dataclasses.replace(checked, checksum="")
    path = store.entries_dir / f"{checked.id}.bin"

    async def timed(action: Callable[[], Awaitable[object]], cold: bool) -> float:
        if cold:
            drop_pages(path)
        started = time.perf_counter()
        await action()
        return time.perf_counter() - started

    async def restore(entry):  # type: ignore[no-untyped-def]
        result = await store.restore(entry, 0)
        assert result.ok, result.reason

    print(f"{checked.n_tokens:,} tokens, {checked.nbytes / 1e6:.1f} MB; {repeat} of each, alternating")
    print(f"{'':12}{'unchecked':>11}{'checked':>10}{'added':>8}{'alone':>10}{'alone/unchecked':>17}")
    for label, cold in (("page cache", False), ("disk", True)):
        plain, with_check, alone = [], [], []
        for _ in range(repeat):
            plain.append(await timed(lambda: restore(unchecked), cold))
            with_check.append(await timed(lambda: restore(checked), cold))
            alone.append(await timed(lambda: asyncio.to_thread(file_checksum, path), cold))
        u, c, a = statistics.median(plain), statistics.median(with_check), statistics.median(alone)
        print(f"{label:12}{u * 1e3:>9.1f}ms{c * 1e3:>8.1f}ms{(c - u) / u:>8.1%}{a * 1e3:>8.1f}ms{a / u:>17.0%}")
    await store.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=7500)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="slotkeeper-bench-checksum-"))
    model = write_tiny_model(work / "model.gguf", MODEL)
    root = work / "store"
    root.mkdir()
    ConversationStore(root, None, {}).open()  # the layout, so that llama-server's save path exists
    port = free_port()
    server = subprocess.Popen(
        [
            *find_llama_server(None, os.environ),
            "-m",
            str(model),
            "--port",
            str(port),
            "-np",
            "1",
            "-c",
            str(args.tokens + 512),
            "-t",
            "2",
            "--no-warmup",
            "--slot-save-path",
            str(root / "snapshots"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert wait_until(lambda: health_status(port) == 200, 120), "llama-server not healthy"
        prompt = " ".join(f"note {i} is {i * 7 % 100}." for i in range(args.tokens // 6))
        tokens = http_call(port, "POST", "/tokenize", {"content": prompt}).body["tokens"][: args.tokens]
        asyncio.run(measure(port, root, tokens, args.repeat))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
