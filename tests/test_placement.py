"""Placement's policy and the pieces under it, in process: prefix keys, slot-file headers, slot decisions.

The claims on traffic (chats warm after a swap) run against the real llama-server in test_conversations.py;
these pin down the rules so that a change to one shows up here first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotkeeper.chat.media import image_tokens
from slotkeeper.chat.openings import Opening
from slotkeeper.chat.prefix import BLOCK_TOKENS, block_keys, common_keys, exact_key
from slotkeeper.llama.policy import CachePolicy
from slotkeeper.placement.decide import Plan, Rules, decide
from slotkeeper.placement.hook import Placement
from slotkeeper.placement.request import NO_KEY, RequestKey, RequestView, request_key, with_id_slot
from slotkeeper.store.conversations import ConversationStore
from slotkeeper.store.entries import Entry
from slotkeeper.store.statefile import SEQ_MAGIC, StateFileError, read_header

# ---- prefix keys ------------------------------------------------------------------------------------------


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=400), st.lists(st.integers(0, 3), max_size=400))
def test_shared_keys_are_the_common_prefix_in_whole_blocks(a, b):
    """Two token lists share exactly as many keys as their common prefix has whole blocks."""
    assert common_keys(block_keys(a), block_keys(b)) == min(lcp(a, b), len(a), len(b)) // BLOCK_TOKENS


def test_a_key_covers_everything_before_it():
    a = list(range(300))
    b = a.copy()
    b[10] = 9999  # a difference in block 0 changes every key after it
    assert block_keys(a)[0] != block_keys(b)[0]
    assert all(x != y for x, y in zip(block_keys(a), block_keys(b)))


# ---- slot-file headers ----------------------------------------------------------------------------------


def slot_file(tmp_path: Path, words: list[int], version: int = 4, magic: int = SEQ_MAGIC) -> Path:
    path = tmp_path / "x.bin"
    path.write_bytes(struct.pack("<III", magic, version, len(words)) + array("i", words).tobytes() + b"state")
    return path


def test_plain_and_packed_token_lists_are_read(tmp_path):
    plain = read_header(slot_file(tmp_path, [5, 6, 7]))
    assert (plain.layout, list(plain.token_ids), plain.version) == ("plain", [5, 6, 7], 4)
    packed = read_header(slot_file(tmp_path, [-1, 1, 3, 5, 6, 7, 0], version=5))
    assert (packed.layout, list(packed.token_ids), packed.version) == ("packed-1", [5, 6, 7], 5)


@pytest.mark.parametrize("words, magic", [([-1, 1, 9, 5], SEQ_MAGIC), ([1, 2], 0x12345678)])
def test_a_file_that_is_no_slot_file_is_refused(tmp_path, words, magic):
    with pytest.raises(StateFileError):
        read_header(slot_file(tmp_path, words, magic=magic))
    path = slot_file(tmp_path, [1, 2, 3])
    path.write_bytes(path.read_bytes()[:14])
    with pytest.raises(StateFileError):
        read_header(path)


# ---- the body change ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"{}", b' { "a" : 1 }\n', b'{"a":[1,{"b":2}],"id_slot":-1}', b'{"x":"}"}  '])
def test_id_slot_is_the_last_member_and_nothing_else_changes(body):
    out = with_id_slot(body, 3)
    assert json.loads(out) == {**json.loads(body), "id_slot": 3}
    removed = out.replace(b',"id_slot":3', b"").replace(b'"id_slot":3', b"")
    assert removed == body


# ---- recognising a chat without tokens ------------------------------------------------------------------


def chat(*contents: str, **extra) -> dict:
    roles = ["system"] + ["user", "assistant"] * len(contents)
    return {"messages": [{"role": role, "content": c} for role, c in zip(roles, contents)], **extra}


def test_the_next_turn_of_a_chat_continues_its_request_key():
    turn1, _ = request_key("/v1/chat/completions", chat("sys", "hello"))
    turn2, _ = request_key("/v1/chat/completions", chat("sys", "hello", "hi!", "more", temperature=0.3))
    other, _ = request_key("/v1/chat/completions", chat("sys", "goodbye"))
    tools, _ = request_key("/v1/chat/completions", chat("sys", "hello", "hi!", "more", tools=[{"x": 1}]))
    assert turn1.continued_by(turn2)
    assert not turn1.continued_by(other) and not other.continued_by(turn2)
    assert not turn1.continued_by(tools), "a setting that changes the prompt makes it another prompt"
    assert not RequestKey().continued_by(turn2)


def test_prompt_form_continues_only_on_whole_items():
    a, _ = request_key("/completion", {"prompt": [1, 2, 3]})
    assert a.continued_by(request_key("/completion", {"prompt": [1, 2, 3, 4]})[0])
    assert not a.continued_by(request_key("/completion", {"prompt": [1, 2, 34]})[0])
    text, _ = request_key("/completion", {"prompt": "abc"})
    assert text.continued_by(request_key("/completion", {"prompt": "abcdef"})[0])


# ---- decisions ------------------------------------------------------------------------------------------


@pytest.fixture
def placement(tmp_path) -> Placement:
    store = ConversationStore(tmp_path, None, {"model": "m"})
    store.open()
    return Placement(store, None, 3, rules=Rules(min_tokens=128))  # type: ignore[arg-type]


def choose_or_wait(
    placement: Placement,
    keys: list[str] | None,
    n_tokens: int,
    pinned: int | None,
    unpinnable: bool,
    tokens: list[int] | None = None,
    opening: Opening | None = None,
    key: RequestKey = NO_KEY,
) -> Plan | None:
    """The decision for a request (None: it waits), its slot reserved in the same step, as the hook does."""
    view = RequestView(
        keys=keys, n_tokens=n_tokens, token_ids=tokens, pinned=pinned, unpinnable=unpinnable, opening=opening, key=key
    )
    plan = decide(placement.slots.slots, view, placement.store, placement.rules)
    if plan is not None:
        placement.slots.reserve(plan.slot)
    return plan


def choose(
    placement: Placement,
    keys: list[str] | None,
    n_tokens: int,
    pinned: int | None,
    unpinnable: bool,
    tokens: list[int] | None = None,
    opening: Opening | None = None,
    key: RequestKey = NO_KEY,
) -> Plan:
    """The decision for a request that need not wait (a slot is idle)."""
    plan = choose_or_wait(placement, keys, n_tokens, pinned, unpinnable, tokens, opening, key)
    assert plan is not None, "the request waits"
    return plan


def keys_of(n_tokens: int, seed: int) -> list[str]:
    return block_keys([seed * 100_000 + i for i in range(n_tokens)])


def saved_entry(
    entry_id: str,
    n_tokens: int,
    keys: Sequence[str],
    *,
    nbytes: int = 1,
    last_used: float = 0,
    fingerprint: dict | None = None,
    **fields,
) -> Entry:
    """An entry as a save leaves it (what a decision reads of it; the rest as these tests' saves make it)."""
    return Entry(
        id=entry_id,
        n_tokens=n_tokens,
        nbytes=nbytes,
        keys=keys,
        saved_at=0,
        last_used=last_used,
        fingerprint={"model": "m"} if fingerprint is None else fingerprint,
        seq_version=4,
        layout="packed-1",
        **fields,
    )


def held(
    placement: Placement,
    slot: int,
    keys: Sequence[str],
    *,
    dirty: bool = True,
    entry: Entry | None = None,
    key: RequestKey = NO_KEY,
    partial: bool = False,
    chat: dict | None = None,
) -> None:
    """What the slot table records when a request with these block keys ran on the slot (changed since saved);
    `dirty` False: then saved, as `entry` when given. Each call makes the slot the most recently used."""
    table, s = placement.slots, placement.slots[slot]
    view = RequestView(keys=list(keys), n_tokens=len(keys) * BLOCK_TOKENS, key=key, partial=partial)
    table.ran(s, view, resident=False, chat=chat, reply=None)
    if not dirty:
        table.held(s, entry, keys, len(keys) * BLOCK_TOKENS)


def test_a_chat_in_its_slot_goes_there_without_a_write_back(placement):
    chat_a = keys_of(640, 1)
    held(placement, 1, chat_a[:8])
    plan = choose(placement, chat_a, 640, None, False)
    assert (plan.slot.id, plan.outcome, plan.write_back) == (1, "resident", False)


def test_a_new_chat_takes_an_empty_slot_first_then_the_least_recently_used(placement):
    for i in (1, 2, 0):  # least recently used first
        held(placement, i, keys_of(640, i))
    placement.slots.cleared(placement.slots[2])
    plan = choose(placement, keys_of(640, 9), 640, None, False)
    assert (plan.slot.id, plan.outcome) == (2, "new")
    placement.slots.release(plan.slot)
    held(placement, 2, keys_of(640, 2))
    assert choose(placement, keys_of(640, 8), 640, None, False).slot.id == 1  # LRU


def test_a_chat_in_the_store_only_is_restored_into_a_victim(placement):
    chat_a = keys_of(640, 1)
    entry = saved_entry("aaaa", 640, chat_a)
    placement.store.index(entry)
    for i in range(3):
        held(placement, i, keys_of(640, 10 + i))
    plan = choose(placement, chat_a + keys_of(64, 5), 704, None, False)
    assert (plan.slot.id, plan.restore, plan.write_back, plan.outcome) == (0, entry, True, "restored")


def test_concurrent_decisions_never_share_a_slot_and_wait_when_all_are_busy(placement):
    plans = [choose(placement, keys_of(640, i), 640, None, False) for i in range(3)]
    assert sorted(p.slot.id for p in plans) == [0, 1, 2]
    assert choose_or_wait(placement, keys_of(640, 7), 640, None, False) is None  # waits
    assert choose_or_wait(placement, keys_of(640, 7), 640, 1, False) is None  # the client's slot is busy: waits too


def test_a_decision_changes_nothing_until_its_slot_is_reserved(placement):
    """decide() is a pure function: deciding again gives the same plan, and no slot or counter moved."""
    chat_a = keys_of(640, 1)
    held(placement, 1, chat_a[:8])
    before = [dataclasses.replace(s) for s in placement.slots]
    view = RequestView(keys=chat_a, n_tokens=640)
    first = decide(placement.slots.slots, view, placement.store, placement.rules)
    again = decide(placement.slots.slots, view, placement.store, placement.rules)
    assert first is not None and again is not None
    assert (first.slot.id, first.outcome) == (again.slot.id, again.outcome) == (1, "resident")
    assert [dataclasses.replace(s) for s in placement.slots] == before, "a decision wrote slot state"
    assert not any(placement.metrics.placements.values())


async def test_a_waiting_request_gets_the_slot_once_it_is_freed(tmp_path):
    store = ConversationStore(tmp_path, None, {"model": "m"})
    store.open()
    p = Placement(store, None, 1, rules=Rules(min_tokens=128))  # type: ignore[arg-type]
    busy = choose(p, keys_of(640, 1), 640, None, False)
    asyncio.get_running_loop().call_later(0.05, p.slots.release, busy.slot)
    waited = 0
    while (plan := choose_or_wait(p, keys_of(640, 2), 640, None, False)) is None:
        waited += 1
        await asyncio.wait_for(p.slots.wait_freed(), 5)
    assert (plan.slot.id, waited) == (0, 1)


def test_a_title_slot_goes_before_a_saved_chat_and_a_saved_chat_before_a_changed_one(placement):
    saved = saved_entry("bbbb", 640, keys_of(640, 1))
    held(placement, 2, keys_of(640, 3))  # changed, and the least recently used
    held(placement, 0, keys_of(640, 1), dirty=False, entry=saved)
    held(placement, 1, keys_of(64, 2))  # a title request: under min_tokens
    order = []
    for _ in range(3):
        plan = choose(placement, keys_of(640, 9), 640, None, False)
        order.append(plan.slot.id)
    assert order == [1, 0, 2]


def test_a_new_chat_reuses_a_saved_slot_that_holds_its_system_prompt(placement):
    system = [7] * 320
    saved = saved_entry("cccc", 640, block_keys(system + [1] * 320))
    held(placement, 0, saved.keys, dirty=False, entry=saved)
    plan = choose(placement, block_keys(system + [2] * 320), 640, None, False)
    assert (plan.slot.id, plan.write_back) == (0, False)


def test_a_grown_chat_supersedes_its_older_save_despite_a_re_templated_answer():
    from slotkeeper.store.index import extends

    old_tokens = list(range(1000))
    old = saved_entry("old1", 1000, block_keys(old_tokens), fingerprint={})
    grown = old_tokens[:930] + [-5] * 370  # the answer's last tokens came back re-templated (its last block differs)
    new = saved_entry("new1", 1300, block_keys(grown), fingerprint={})
    other = saved_entry("oth1", 1300, block_keys(old_tokens[:800] + [-6] * 500), fingerprint={})
    assert extends(new, old) and not extends(other, old) and not extends(old, new)


# ---- shared openings ----------------------------------------------------------------------------------------


def opening_entry(tokens: list[int], entry_id: str = "open") -> Entry:
    return saved_entry(
        entry_id,
        len(tokens),
        block_keys(tokens),
        nbytes=1000,
        exact=exact_key(tokens),
        boundary=True,
        opening=True,
        uses=1,
    )


def test_a_new_chat_reuses_its_opening_live_after_the_chat_there_is_written_back(placement):
    """Full attention: the slot holding a changed chat with the same system prompt is written back and the new
    chat reuses the opening there, as llama-server would (measured faster than restoring the opening into
    another slot); the opening is not restored, and the chat there is not lost."""
    system = [7] * 320
    opening = opening_entry(system)
    chat = saved_entry("chat", 640, block_keys(system + [1] * 320), nbytes=9000, last_used=5)
    placement.store.index(opening)
    placement.store.index(chat)
    held(placement, 2, keys_of(640, 2))
    held(placement, 1, keys_of(640, 1))
    held(placement, 0, chat.keys)  # the chat, changed since: worth keeping
    request = system + [3] * 320
    plan = choose(
        placement,
        block_keys(request),
        640,
        None,
        False,
        request,
        Opening(token_ids=system, key=opening.exact, message_keys=[]),
    )
    assert (plan.slot.id, plan.restore, plan.outcome, plan.write_back) == (0, None, "new", True)


def test_on_a_hybrid_a_new_chat_gets_its_opening_restored_into_a_victim(tmp_path):
    """Extend-only: a live state goes back only to its checkpoints, so the saved opening is restored into the
    least recently used slot instead (not a chat that shares the opening, though it shares as much)."""
    store = ConversationStore(tmp_path, None, {"model": "m"})
    store.open()
    hybrid = Placement(store, None, 3, rules=Rules(policy=CachePolicy.EXTEND_ONLY, min_tokens=128))  # type: ignore[arg-type]
    system = [7] * 320
    opening = opening_entry(system)
    store.index(opening)
    for i in (2, 1, 0):  # least recently used first; each a chat whose boundaries are known: worth keeping
        held(hybrid, i, block_keys(system + [i + 1] * 320) if i == 0 else keys_of(640, i), chat={"messages": []})
    request = system + [3] * 320
    plan = choose(
        hybrid,
        block_keys(request),
        640,
        None,
        False,
        request,
        Opening(token_ids=system, key=opening.exact, message_keys=[]),
    )
    assert (plan.slot.id, plan.restore, plan.outcome, plan.write_back) == (2, opening, "opening", True)


def test_an_opening_is_not_restored_when_prefilling_it_is_estimated_faster(placement):
    system = [7] * 320
    opening = opening_entry(system)
    placement.store.index(opening)
    placement.store.restore_bytes_per_s = 100.0  # 10 s to read its 1,000 bytes; 320 tokens prefill in 0.64 s
    request = system + [3] * 320
    plan = choose(
        placement,
        block_keys(request),
        640,
        None,
        False,
        request,
        Opening(token_ids=system, key=opening.exact, message_keys=[]),
    )
    assert (plan.restore, plan.outcome) == (None, "new")


def test_a_slot_holding_just_the_opening_is_used_first(placement):
    system = [7] * 320
    opening = opening_entry(system)
    placement.store.index(opening)
    held(placement, 1, opening.keys, dirty=False, entry=opening)
    request = system + [3] * 320
    plan = choose(
        placement,
        block_keys(request),
        640,
        None,
        False,
        request,
        Opening(token_ids=system, key=opening.exact, message_keys=[]),
    )
    assert (plan.slot.id, plan.restore, plan.write_back) == (1, None, False)


def test_an_opening_is_never_superseded_by_the_chats_that_start_from_it():
    from slotkeeper.store.index import extends

    system = list(range(640))
    opening = opening_entry(system)
    chat = saved_entry("chat", 660, block_keys(system + [1] * 20), fingerprint={})
    assert not extends(chat, opening)
    earlier = dataclasses.replace(opening, opening=False)  # the same pair of files as a chat's earlier save
    assert extends(chat, earlier)


def test_of_the_entries_sharing_a_prefix_the_smallest_is_found(placement):
    system = [7] * 320
    long_chat = saved_entry("long", 4000, block_keys(system + [1] * 3680), nbytes=9000, last_used=9)
    opening = opening_entry(system)
    for entry in (long_chat, opening):
        placement.store.index(entry)
    assert placement.store.lookup(block_keys(system + [3] * 320)) == (opening, 5)


def test_a_slot_whose_chat_shares_only_the_opening_is_not_taken_for_continuing(placement):
    """A new chat shares all of a short chat's blocks but its last (the opening is most of it): the slot holds
    another chat, which must not be overwritten as if the request continued it."""
    system = [7] * 320
    opening = opening_entry(system)
    placement.store.index(opening)
    short_chat = system + [1] * 64  # the opening, a short first message and a reply: one block more
    held(placement, 0, block_keys(short_chat))
    request = system + [3] * 40
    plan = choose(
        placement,
        block_keys(request),
        len(request),
        None,
        False,
        request,
        Opening(token_ids=system, key=opening.exact, message_keys=[]),
    )
    assert (plan.slot.id, plan.outcome) != (0, "resident"), plan
    assert plan.slot.id != 0 or plan.write_back, plan  # that chat is written back before its slot is reused


def test_a_short_chat_is_not_superseded_by_another_that_shares_its_opening():
    """Two agent sessions: the same ~8k-token opening, first messages shorter than a block. The second's save
    shares all of the first's blocks but its last, yet it is another chat; the first's next turn supersedes it."""
    from slotkeeper.store.index import extends

    opening = list(range(8026))
    first = saved_entry("one1", 8091, block_keys(opening + [1] * 65), fingerprint={}, message_keys=["s", "o", "u1"])
    second = saved_entry("two2", 8093, block_keys(opening + [2] * 67), fingerprint={}, message_keys=["s", "o", "u2"])
    grown = saved_entry(
        "one2", 8200, block_keys(opening + [1] * 174), fingerprint={}, message_keys=["s", "o", "u1", "a1", "u3"]
    )
    assert not extends(second, first)
    assert extends(grown, first)


def test_a_slot_whose_chat_differs_only_in_its_last_block_is_another_chat_by_its_messages(placement):
    """A short session in a slot shares all but its last block with a new session (the slack `_holds` allows a
    re-templated reply): the messages say it is another chat, so the slot is not taken as the new one's."""
    system = [7] * 330  # 5 full blocks and a partial one
    opening = opening_entry(system)
    placement.store.index(opening)
    # 7 blocks; both sessions' messages open alike ("Task: ..."), so the request shares 6 of them
    held(placement, 0, block_keys(system + [1] * 54 + [5] * 70), key=RequestKey(message_keys=("s", "o", "u1")))
    request = system + [1] * 54 + [6] * 70
    new_session = RequestKey(message_keys=("s", "o", "u2"))
    plan = choose(
        placement,
        block_keys(request),
        len(request),
        None,
        False,
        request,
        Opening(token_ids=system, key=opening.exact, message_keys=["s", "o"]),
        new_session,
    )
    assert (plan.slot.id, plan.outcome) != (0, "resident") and (plan.slot.id != 0 or plan.write_back), plan
    placement.slots.release(plan.slot)
    same_chat = RequestKey(
        message_keys=("s", "o", "u1", "a1", "u3")
    )  # its messages continue the slot's: the slack holds
    grown = system + [1] * 54 + [5] * 70 + [3] * 10
    plan = choose(
        placement,
        block_keys(grown),
        len(grown),
        None,
        False,
        grown,
        Opening(token_ids=system, key=opening.exact, message_keys=["s", "o"]),
        same_chat,
    )
    assert (plan.slot.id, plan.outcome) == (0, "resident"), plan


# ---- pictures a view does not show (`promptview`: tokens stop before a picture not known yet) -------------


def test_a_slot_whose_tokens_stop_before_a_picture_is_saved_before_a_request_that_shares_them(placement):
    """Two chats with the same text before a red or a blue picture that no slot file has shown yet: their
    tokens are alike up to the picture. The slot holding the red one is saved before the blue one runs there;
    a slot whose tokens show all it holds is not."""
    text = keys_of(640, 1)
    held(placement, 0, text, partial=True)  # its view stopped before a picture: it holds more, unseen
    partial_view = RequestView(keys=text, n_tokens=640, partial=True)
    plan = decide(placement.slots.slots, partial_view, placement.store, placement.rules)
    assert plan is not None and plan.outcome != "resident" and plan.write_back, plan
    held(placement, 0, text)  # a view that shows all it holds
    plan = decide(placement.slots.slots, RequestView(keys=text, n_tokens=640), placement.store, placement.rules)
    assert plan is not None and (plan.slot.id, plan.outcome, plan.write_back) == (0, "resident", False), plan


def test_a_request_whose_tokens_stop_before_a_picture_does_not_take_a_slot_holding_more(placement):
    """The request's tokens stop at its (new) picture; the slot holds more than that, so what it holds there is
    another picture or other text: it is saved first. A slot holding no more than the request shows is its."""
    text = keys_of(640, 1)
    held(placement, 0, text + keys_of(64, 2))
    plan = decide(
        placement.slots.slots, RequestView(keys=text, n_tokens=640, partial=True), placement.store, placement.rules
    )
    assert plan is not None and plan.outcome != "resident" and plan.write_back, plan
    held(placement, 0, text)
    plan = decide(
        placement.slots.slots, RequestView(keys=text, n_tokens=640, partial=True), placement.store, placement.rules
    )
    assert plan is not None and (plan.outcome, plan.write_back) == ("resident", False), plan


@pytest.mark.parametrize("shows_picture", [True, False])
def test_an_entry_one_block_ahead_is_restored_when_that_block_shows_a_picture(placement, shows_picture):
    """An entry that covers one block more than the live slot shares: restored when that block holds a
    picture (restoring spares the vision encoder), not when it is text (RESTORE_MIN_GAIN_BLOCKS)."""
    text = [100_000 + i for i in range(600)]
    tokens = text + (image_tokens("ab" * 32, 40) if shows_picture else [7] * 40)  # 10 blocks
    keys = block_keys(tokens)
    entry = saved_entry("eeee", len(keys) * BLOCK_TOKENS, keys)
    placement.store.index(entry)
    held(placement, 0, keys[:9])  # the live slot shares the text before the picture
    plan = decide(
        placement.slots.slots,
        RequestView(keys=keys, n_tokens=len(tokens), token_ids=tokens),
        placement.store,
        placement.rules,
    )
    assert plan is not None and plan.outcome == ("restored" if shows_picture else "resident"), plan


def test_a_slot_whose_chat_went_on_untokenized_is_saved_before_a_request_that_shares_its_keys(placement):
    """The chat in slot 0 continued there without being tokenized (its keys are an older turn's). A request
    that shares those keys but does not continue the chat by its messages is a branch or another chat: the
    slot is written back first. Its own next turn needs no tokens (`continuing`)."""
    keys = keys_of(640, 1)
    slot = placement.slots[0]
    placement.slots.ran(slot, RequestView(keys=keys, n_tokens=640), resident=False, chat=None, reply=None)
    placement.slots.ran(slot, RequestView(keys=None, n_tokens=0), resident=True, chat=None, reply=None)
    plan = decide(placement.slots.slots, RequestView(keys=keys, n_tokens=640), placement.store, placement.rules)
    assert plan is not None and plan.slot is slot and plan.outcome != "resident" and plan.write_back, plan
