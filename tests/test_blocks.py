"""Each token's cache reaches the disk once, each shared opening is stored once: the store keeps saves as blocks
(store/blocks.py), on the real llama-server, on every model family and KV layout.

An agent-shaped chat (turns with pauses longer than --autosave-idle, so each pause saves it again) writes each
full block of cells once: the blocks a save adds beyond the chat's final ones are only each save's skeleton
(header, tokens, cell metadata, a recurrent state) and its unfilled last block. Chats that share a system
prompt share its blocks. Every entry put back together is byte for byte the file llama-server wrote (its
checksum, taken from that file), and a restored chat answers as a cold run does.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import xxhash
from family_helpers import BASE, FAMILIES, LOGPROB_TOLERANCE, Chat, Family, answer, same_answer_up_to_a_tie, swap_out
from store_helpers import (
    block_files,
    blocks_dir,
    edit_manifest,
    entry_bytes,
    entry_ids,
    entry_parts,
    only_files_of,
    quarantine_dir,
    read_manifest,
    staged_in_ram,
    transients,
)

from slotkeeper.store.blockfiles import block_path
from slotkeeper.store.blocks import CellSection, Parts
from slotkeeper.store.conversations import ConversationStore
from slotkeeper.store.entries import CHECKSUM_ALGORITHM
from slotkeeper.store.statefile import read_header
from slotkeeper.testing.harness import PlainServer, clean_env, free_port, http_call, pid_alive, wait_until
from slotkeeper.testing.tinymodel import image_part, solid_png

IDLE = ("--autosave-idle", "0.5")
PAUSE_S = 1.5  # longer than the idle delay: every pause saves the chat again

LAYOUTS = {
    "llama": FAMILIES["llama"],
    "llama-fa-off": Family("llama", ("-fa", "off")),  # V stored transposed, by element
    "qwen35": FAMILIES["qwen35-thinking-off"],  # hybrid: a recurrent state in every skeleton
    "qwen35-thinking-on": FAMILIES["qwen35-thinking-on"],
    "gemma3-270m-swa-full": FAMILIES["gemma3-270m-swa-full"],  # the real model
    "gemma3-swa-full": FAMILIES["gemma3-swa-full"],  # a sliding-window cache beside the full one
    "llama-image": FAMILIES["llama"],  # a picture in the first message (--mmproj): its chunk in the skeleton
    # (without --swa-full slotkeeper saves no gemma3 chat: llama-server reuses none restored)
}


def saves_seen(sk) -> int:
    return sk.logs().count(" saved from slot ")


def saved_since(sk, count: int) -> bool:
    return saves_seen(sk) > count


def block_sizes_now(save_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in blocks_dir(save_dir).glob("*/*") if len(p.name) == 32}


def tool_output(turn: int) -> str:
    """What an agent's tool printed: ~400 tokens of log lines."""
    return "\n".join(f"[{turn}.{i}] test_case_{turn}_{i} passed in {i * 7 % 50} ms" for i in range(40))


def checksum_of(data: bytes) -> str:
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"


def assert_entries_whole(save_dir: Path, scratch: Path) -> None:
    """Every entry, put together from its blocks, has the checksum slotkeeper took of llama-server's file."""
    for entry_id in entry_ids(save_dir):
        manifest = read_manifest(save_dir, entry_id)
        assert manifest.get("parts") is not None, f"entry {entry_id} kept as one file"
        data = entry_bytes(save_dir, entry_id, scratch)
        assert len(data) == manifest["bytes"] and checksum_of(data) == manifest["checksum"], entry_id


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_chat_saved_at_every_pause_writes_each_full_block_of_cells_once(family_start, tiny_mmproj, name, tmp_path):
    """Six turns, each followed by a pause that saves the chat. Every full block of a full-attention cache's
    cells that one save holds is the same block in the next (never written again), and all the blocks that
    ever stood in the store are the final entry's plus, per save, its skeleton and unfilled last block."""
    family = LAYOUTS[name]
    picture = name.endswith("image")
    sk = family_start(family, *(("--mmproj", str(tiny_mmproj(64))) if picture else ()), own=IDLE)
    save_dir = sk.extra["save_dir"]
    chat = Chat(0, family.request, facts=60)
    if picture:
        chat.messages[1]["content"] = [
            {"type": "text", "text": chat.messages[1]["content"]},
            image_part(solid_png((230, 20, 20))),
        ]
    seen: dict[str, int] = {}  # every block that stood in the store, and its size
    entries: dict[str, Parts] = {}  # every entry that did
    for turn in range(6):
        before = saves_seen(sk)
        chat.turn(sk.port)
        chat.messages[-1]["content"] = tool_output(turn)
        assert wait_until(partial(saved_since, sk, before), 30), sk.logs()[-3000:]
        time.sleep(PAUSE_S)
        seen.update(block_sizes_now(save_dir))
        for entry_id in entry_ids(save_dir):
            entries.setdefault(entry_id, entry_parts(save_dir, entry_id))  # type: ignore[arg-type]
    if picture:
        assert any(read_manifest(save_dir, i)["images"] for i in entry_ids(save_dir)), "no picture was saved"
    chats = sorted((p for p in entries.values() if p.sections), key=lambda p: p.nbytes)
    assert len(chats) >= 5, sk.logs()[-3000:]
    final = chats[-1]
    tokens = max(s.cells for s in final.sections)

    def full_cache(section: CellSection, parts: Parts) -> bool:
        return section.cells == max(s.cells for s in parts.sections)  # not a sliding window's

    for earlier, later in itertools.pairwise(chats):
        for a, b in zip(earlier.sections, later.sections):
            if full_cache(a, earlier):
                full = a.cells // earlier.block_cells
                assert a.blocks[:full] == b.blocks[:full], f"{name}: a save rewrote cells an earlier one had written"
    rewritten = 0
    for parts in entries.values():
        if parts is final:
            continue
        rewritten += parts.skeleton_bytes
        for section in parts.sections:
            tail = section.cells % parts.block_cells
            rewritten += (section.cells if not full_cache(section, parts) else tail) * section.cell_bytes
    written = sum(seen.values())
    assert written <= final.nbytes + rewritten, (written, final.nbytes, rewritten, tokens)
    assert_entries_whole(save_dir, tmp_path)
    in_use = {block for i in entry_ids(save_dir) for block in (entry_parts(save_dir, i) or final).block_sizes()}
    assert sorted(block_files(save_dir)) == sorted(in_use), "blocks no entry uses are left in the store"


def test_six_chats_sharing_a_system_prompt_store_its_blocks_once_and_come_back_as_a_cold_run_answers(
    family_start, starter, llama_server, family_models, tmp_path
):
    """Six chats with one long system prompt: its full blocks are one set of files that all six entries use.
    After a swap each answers as a plain llama-server answers cold (temperature 0)."""
    family = FAMILIES["llama"]
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and kindly." for i in range(90))
    sk = family_start(family)
    save_dir = sk.extra["save_dir"]
    chats = [Chat(i, family.request, system=system, facts=10) for i in range(6)]
    for chat in chats:
        chat.turn(sk.port)
    swap_out(sk)
    ids = entry_ids(save_dir)
    chat_parts = [p for p in (entry_parts(save_dir, i) for i in ids) if p is not None and p.sections]
    assert len(chat_parts) >= 6, ids
    shared = set(chat_parts[0].sections[0].blocks)
    for parts in chat_parts[1:]:
        shared &= set(parts.sections[0].blocks)
    per_block = chat_parts[0].block_cells * chat_parts[0].sections[0].cell_bytes
    assert len(shared) >= 3, f"the chats share {len(shared)} blocks"
    on_disk = sum(block_sizes_now(save_dir).values())
    as_files = sum(parts.nbytes for parts in chat_parts)
    assert on_disk <= as_files - (len(chat_parts) - 1) * len(shared) * per_block, (on_disk, as_files)
    assert_entries_whole(save_dir, tmp_path)

    sk2 = family_start(family)
    warm = [answer(sk2.port, chat, chat.messages) for chat in chats]
    swap_out(sk2)
    plain = PlainServer(
        llama_server, ["-m", str(family_models["llama"]), *BASE], free_port(), tmp_path / "plain.log", clean_env()
    )
    try:
        plain.wait_ready()
        cold = [answer(plain.port, chat, chat.messages) for chat in chats]
    finally:
        plain.stop()
    assert all(same_answer_up_to_a_tie(w, c, LOGPROB_TOLERANCE) for w, c in zip(warm, cold)), (warm, cold)


def test_a_flipped_byte_in_a_shared_block_quarantines_exactly_the_entries_that_use_it(family_start, tmp_path):
    """Three chats share a system prompt's blocks, a fourth has its own. A byte flipped in a shared block: the
    first restore that reads it quarantines the three (one line each) and only them; the fourth restores, and
    the chats whose entries went answer from a cold prefill."""
    family = FAMILIES["llama"]
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and kindly." for i in range(90))
    other = "You are a terse assistant. " + " ".join(f"Law {i}: reply in one short line." for i in range(90))
    sk = family_start(family)
    save_dir = sk.extra["save_dir"]
    chats = [Chat(i, family.request, system=system, facts=10) for i in range(3)]
    lone = Chat(3, family.request, system=other, facts=10)
    for chat in [*chats, lone]:
        chat.turn(sk.port)
    swap_out(sk)
    users: dict[str, set[str]] = {}
    for entry_id in entry_ids(save_dir):
        parts = entry_parts(save_dir, entry_id)
        assert parts is not None
        for block in parts.block_sizes():
            users.setdefault(block, set()).add(entry_id)
    shared = [b for b, who in users.items() if len(who) >= 3]
    assert shared, users
    victim = shared[0]
    using = users[victim]
    path = block_path(blocks_dir(save_dir), victim)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    untouched = set(entry_ids(save_dir)) - using
    assert untouched

    sk2 = family_start(family)
    for chat in [*chats, lone]:
        chat.turn(sk2.port)
    quarantined = {p.name.split("-")[-1].removesuffix(".json") for p in quarantine_dir(save_dir).glob("*.json")}
    assert quarantined == using, (quarantined, using, sk2.logs()[-3000:])
    assert sk2.logs().count("quarantined (") == len(using), sk2.logs()[-3000:]
    assert untouched <= set(entry_ids(save_dir))
    # the chats saved again hold the same prompt: its block may be back, as it was before the flip
    assert not path.exists() or xxhash.xxh3_128_hexdigest(path.read_bytes()) == victim, "a changed block stayed"


def test_a_sigkill_at_random_moments_of_a_save_loses_nothing_and_leaves_nothing(family_start, tmp_path):
    """SIGTERM (a save at stop), then SIGKILL of the group at a random moment of the save, 12 times, the chat
    growing by a tool's output each time. After each kill every committed entry is whole (its blocks put
    together have its checksum), an entry is gone only when a committed one extends it, and the next start
    leaves nothing else: no block no entry uses, no transient file, nothing the killed run staged in RAM."""
    rng = random.Random(12)
    family = FAMILIES["llama"]
    chat = Chat(0, family.request, facts=60)
    committed: dict[str, int] = {}  # entry id -> its tokens, as the previous kill left them
    outcomes = {"kept old": 0, "new committed": 0}
    killed = 0
    save_dir = tmp_path / "cache"
    for trial in range(12):
        sk = family_start(family, "-np", "1", own=("--autosave-idle", "0"), save_dir=save_dir)
        assert set(entry_ids(save_dir)) == set(committed), f"trial {trial}: a committed entry went at start"
        assert only_files_of(save_dir, *committed), f"trial {trial}: leftovers kept: {block_files(save_dir)}"
        assert not transients(save_dir) and not staged_in_ram(killed), f"trial {trial}: staged files kept"
        timings = chat.turn(sk.port)
        if trial:
            assert timings["cache_n"] > 0, f"trial {trial}: the chat came back cold\n{sk.logs()[-3000:]}"
        chat.messages[-1]["content"] = tool_output(trial)
        child = http_call(sk.port, "GET", "/slotkeeper/status").body["child_pid"]
        killed = sk.pid
        sk.killpg(signal.SIGTERM)
        time.sleep(rng.uniform(0.0, 0.12))
        sk.killpg(signal.SIGKILL)
        sk.wait()
        assert wait_until(partial(lambda pid: not pid_alive(pid), child), 5), "llama-server outlived slotkeeper"
        assert_entries_whole(save_dir, tmp_path)
        after = {i: read_manifest(save_dir, i)["tokens"] for i in entry_ids(save_dir)}
        new = set(after) - set(committed)
        for gone in set(committed) - set(after):  # only ever superseded by a committed entry that extends it
            assert any(after[i] > committed[gone] for i in new), f"trial {trial}: entry {gone} lost"
        outcomes["new committed" if new else "kept old"] += 1
        committed = after
    assert outcomes["kept old"] and outcomes["new committed"], f"kills did not cover both moments: {outcomes}"


# A save's commit, in a process of its own that the test kills: the store (fsync on) takes a slot file that a
# real llama-server wrote earlier, which a stand-in child copies under the transient name the store asks for.
# It says "block" after each block it writes, so that kills can be aimed between two of them.
COMMIT = """
import asyncio, shutil, sys, time
from pathlib import Path
from typing import Any
from slotkeeper.llama.client import ChildReply
from slotkeeper.store import blockfiles
from slotkeeper.store.conversations import ConversationStore

write = blockfiles.BlockWriter.__call__
def told(self, name, data):  # each block written, told to the test (which kills the process in between)
    write(self, name, data)
    print("block", flush=True)
blockfiles.BlockWriter.__call__ = told

class SavedEarlier:
    def __init__(self, source, store):
        self.source, self.store = Path(source), store
    async def slot_action(self, slot_id, action, filename=None):
        shutil.copyfile(self.source, self.store.snapshots_dir / filename)  # (a link into RAM is followed)
        size = self.source.stat().st_size
        return ChildReply(200, {"n_saved": int(sys.argv[3]), "n_written": size, "timings": {"save_ms": 1.0}})

async def main():
    Path(sys.argv[1]).mkdir(exist_ok=True)
    store = ConversationStore(Path(sys.argv[1]), None, {"test": "commit"}, fsync=True)
    await store.load()
    store.client = SavedEarlier(sys.argv[2], store)
    print("ready", flush=True)
    started = time.monotonic()
    result = await store.save_slot(0, expected_bytes=Path(sys.argv[2]).stat().st_size)
    await store.flush()
    print("saved" if result.entry else result.reason, time.monotonic() - started, flush=True)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def two_saves(llama_server, family_models, tmp_path_factory) -> tuple[Path, Path, int]:
    """One chat saved by a real llama-server at ~1,200 tokens and at ~2,400 (which extends it)."""
    folder = tmp_path_factory.mktemp("saves")
    server = PlainServer(
        llama_server,
        ["-m", str(family_models["llama"]), *BASE, "--slot-save-path", str(folder)],
        free_port(),
        folder / "plain.log",
        clean_env(),
    )
    words = " ".join(f"word{i}" for i in range(900))
    try:
        server.wait_ready()
        for name, n in (("short.bin", 450), ("long.bin", 900)):
            body = {"prompt": " ".join(words.split()[:n]), "n_predict": 1, "id_slot": 0}
            assert http_call(server.port, "POST", "/completion", body).status == 200
            assert http_call(server.port, "POST", "/slots/0?action=save", {"filename": name}).status == 200
    finally:
        server.stop()
    tokens = read_header(folder / "long.bin").n_tokens
    return folder / "short.bin", folder / "long.bin", tokens


def commit_process(root: Path, source: Path, tokens: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", COMMIT, str(root), str(source), str(tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=clean_env(),
    )


def test_a_commit_killed_at_random_moments_leaves_the_store_whole(two_saves, tmp_path):
    """A store holding a chat's earlier save; its next save's commit (blocks, fsync, manifest, then the
    superseded entry's removal) SIGKILLed at 12 random moments: half of them after a random number of its new
    blocks, half anywhere in the save. After each kill and the next open: the entries are the earlier one,
    the new one, or both, each whole (its blocks put together have its checksum), and no block, partial file
    or staged file is left beside them."""
    short, long, tokens = two_saves
    pristine = tmp_path / "pristine"
    first = commit_process(pristine, short, read_header(short).n_tokens)
    assert first.communicate(timeout=60)[0].split()[-2] == "saved"
    timed = tmp_path / "timed"
    shutil.copytree(pristine, timed)
    calibration = commit_process(timed, long, tokens)
    out = calibration.communicate(timeout=60)[0].split()
    assert out[-2] == "saved", out
    commit_s, new_blocks = float(out[-1]), out.count("block")
    assert new_blocks >= 4, out
    rng = random.Random(46)
    interrupted = 0
    outcomes: set[tuple[int, ...]] = set()
    for trial in range(12):
        root = tmp_path / f"trial{trial}"
        shutil.copytree(pristine, root)
        proc = commit_process(root, long, tokens)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        if trial % 2:
            time.sleep(rng.uniform(0.0, commit_s))
        else:
            for _ in range(rng.randint(1, new_blocks - 1)):
                assert proc.stdout.readline().strip() == "block"
            time.sleep(rng.uniform(0.0, 0.002))
        proc.kill()
        proc.wait()
        orphans = set(block_files(root)) - {
            b for i in entry_ids(root) for b in (entry_parts(root, i) or Parts(0, 1, "", ())).block_sizes()
        }
        interrupted += bool(orphans)
        store = ConversationStore(root, None, {"test": "commit"})
        store.open()
        store.staging.clean()
        ids = entry_ids(root)
        assert ids and only_files_of(root, *ids), (trial, ids, block_files(root))
        assert not transients(root) and not staged_in_ram(proc.pid), trial
        assert_entries_whole(root, tmp_path)
        outcomes.add(tuple(sorted(read_manifest(root, i)["tokens"] for i in ids)))
    assert outcomes <= {(read_header(short).n_tokens,), (tokens,), (read_header(short).n_tokens, tokens)}, outcomes
    assert interrupted >= 3, f"few kills fell between its blocks ({interrupted}): {outcomes}"


def as_version_2(manifest: dict[str, Any]) -> None:
    del manifest["parts"]
    manifest["version"] = 2


def as_whole_files(save_dir: Path, scratch: Path) -> None:
    """The store as a slotkeeper before blocks wrote it: each entry its file (entries/<id>.bin) and a version 2
    manifest, the same fields but the parts; no blocks/."""
    for entry_id in entry_ids(save_dir):
        data = entry_bytes(save_dir, entry_id, scratch)
        (save_dir / "entries" / f"{entry_id}.bin").write_bytes(data)
        edit_manifest(save_dir, entry_id, as_version_2)
    shutil.rmtree(blocks_dir(save_dir))


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_a_store_of_whole_files_comes_back_warm_and_becomes_blocks_as_its_chats_are_saved(family_start, name, tmp_path):
    """A store written before blocks (whole files, version 2 manifests): after the upgrade both chats come back
    warm; the one that goes on is saved as blocks (its old file superseded), the other stays as it was,
    byte for byte, until it is saved in its turn (a downgrade still reads it; the new manifests, version 3,
    it keeps without reading)."""
    family = LAYOUTS[name]
    sk = family_start(family)
    save_dir = sk.extra["save_dir"]
    going_on, waiting = Chat(0, family.request), Chat(1, family.request)
    for chat in (going_on, waiting):
        chat.turn(sk.port)
    swap_out(sk)
    as_whole_files(save_dir, tmp_path)
    old = {
        i: (read_manifest(save_dir, i), (save_dir / "entries" / f"{i}.bin").read_bytes()) for i in entry_ids(save_dir)
    }

    upgraded = time.time()
    sk2 = family_start(family)
    timings = going_on.turn(sk2.port)
    assert going_on.reused_enough(timings), (timings, sk2.logs()[-3000:])
    swap_out(sk2)
    now = {i: read_manifest(save_dir, i) for i in entry_ids(save_dir)}
    kept = {i for i in now if i in old}
    assert kept and all(now[i]["version"] == 2 and now[i].get("parts") is None for i in kept), now
    for i in kept:
        assert (save_dir / "entries" / f"{i}.bin").read_bytes() == old[i][1], f"entry {i} was changed"
    new = [i for i in now if i not in old]
    assert new and all(now[i]["version"] == 3 and now[i]["parts"] for i in new), now

    sk3 = family_start(family)
    timings = waiting.turn(sk3.port)
    assert waiting.reused_enough(timings), (timings, sk3.logs()[-3000:])
    swap_out(sk3)
    since = [read_manifest(save_dir, i) for i in entry_ids(save_dir)]
    since = [m for m in since if m["saved_at"] >= upgraded]
    assert len(since) >= 2 and all(m["version"] == 3 for m in since), since


def test_after_a_crash_no_block_is_swept_while_a_manifest_cannot_be_made_sense_of(two_saves, tmp_path):
    """A start after a crash removes the blocks no manifest names, except while some manifest in entries/ is
    one it cannot read or parse (a newer slotkeeper's, or damaged): any block may be that one's. Then it keeps
    them, with one line, and removes them once that manifest is gone."""
    short, _, _ = two_saves
    root = tmp_path / "store"
    done = commit_process(root, short, read_header(short).n_tokens)
    assert done.communicate(timeout=60)[0].split()[-2] == "saved"
    (entry,) = entry_ids(root)
    orphan = "0" * 32
    block_path(blocks_dir(root), orphan).parent.mkdir(exist_ok=True)
    block_path(blocks_dir(root), orphan).write_bytes(b"left by a save a crash cut short")
    strange = read_manifest(root, entry) | {"id": "f" * 16, "parts": {"bytes": "many"}}
    (root / "entries" / f"{'f' * 16}.json").write_text(json.dumps(strange))
    (blocks_dir(root) / ".unclean").touch()
    ConversationStore(root, None, {"test": "commit"}).open()
    assert orphan in block_files(root), "a block was swept while a manifest could not be made sense of"
    (root / "entries" / f"{'f' * 16}.json").unlink()
    ConversationStore(root, None, {"test": "commit"}).open()
    assert only_files_of(root, entry), block_files(root)
