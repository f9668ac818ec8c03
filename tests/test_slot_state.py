"""What the slot table records of a slot after slotkeeper moved it, against a real llama-server in this process.

The table is the one writer of slot state; these check that what it records after a save is what the slot
holds, so that the next decision and the next save start from the truth.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from slotkeeper.chat.boundary import Boundary
from slotkeeper.chat.prefix import exact_key
from slotkeeper.llama.client import LlamaClient
from slotkeeper.llama.policy import CachePolicy
from slotkeeper.placement.decide import Rules
from slotkeeper.placement.hook import Placement
from slotkeeper.proxy.upstream import ChildPool
from slotkeeper.store.conversations import ConversationStore
from slotkeeper.store.layout import prepare_layout
from slotkeeper.testing.harness import PlainServer, clean_env, free_port


@pytest.fixture
async def hybrid(llama_server, family_models, tmp_path) -> AsyncIterator[Placement]:
    """Placement for one slot of a real llama-server on the tiny hybrid (extend-only) model."""
    saves = tmp_path / "saves"
    saves.mkdir()
    port = free_port()
    args = [
        "-m",
        str(family_models["qwen35"]),
        "-np",
        "1",
        "-c",
        "4096",
        "-t",
        "2",
        "--no-warmup",
        "--slot-save-path",
        str(prepare_layout(saves)),
    ]
    server = PlainServer(
        llama_server, args, port, tmp_path / "llama-server.log", clean_env(cache_home=tmp_path / "xdg-cache")
    )
    try:
        await asyncio.to_thread(server.wait_ready)
        pool = ChildPool(port=port)
        client = LlamaClient(pool, None)
        store = ConversationStore(saves, client, {"model": "qwen35"})
        store.open()
        yield Placement(store, client, 1, rules=Rules(policy=CachePolicy.EXTEND_ONLY, min_tokens=64))
        pool.close()
    finally:
        server.stop()


async def test_a_slot_saved_at_its_turn_boundary_is_known_to_be_there(hybrid):
    """After a boundary save the slot sits exactly at that boundary: the table says so, and saving it again
    there brings it nowhere (no second prefill to a place it already is)."""
    tokens = await hybrid.client.tokenize("The boundary of a chat: " + " ".join(f"word{i}" for i in range(120)))
    assert tokens is not None and len(tokens) >= 128
    key = exact_key(tokens)
    slot = hybrid.slots[0]
    hybrid.slots.reserve(slot)
    boundary = Boundary(token_ids=tokens, prompt=tokens)
    reached, result = await hybrid.keeper.reach_and_save(
        slot, boundary, key=key, message_keys=["s", "u"], supersedes=lambda n, o: False, opening=False
    )
    assert reached is not None and reached.seconds > 0, "the first save brings the slot to its boundary"
    assert result is not None and result.entry is not None, result
    assert slot.exact == key, "the table forgot that the slot sits at its boundary"
    again, _ = await hybrid.keeper.reach_and_save(
        slot, boundary, key=key, message_keys=["s", "u"], supersedes=lambda n, o: False, opening=False
    )
    assert again is not None and again.seconds == 0.0, "the slot was brought again to where it already was"
