"""Which saved states llama-server will reuse on this model, and so what slotkeeper saves and restores.

Why: llama-server reuses a restored state differently by the model's memory (b11434, server-context.cpp):
* full attention: any common prefix (the KV cache is truncated where the request diverges);
* hybrid or recurrent models, and sliding-window models with `--swa-full`: only a request that extends all
  of the state's tokens (a recurrent state cannot roll back; the sliding-window file lacks the positions
  before its window, so a request that diverges inside it would get a wrong answer);
* sliding-window models without `--swa-full`: none (the file holds the last n_swa positions, and the
  server needs one more).
"""

from __future__ import annotations

import enum

from .modelinfo import MemoryKind, ModelMemory


class CachePolicy(enum.Enum):
    PREFIX = "prefix"  # a state is reused up to the longest common prefix
    EXTEND_ONLY = "extend-only"  # a state is reused only by a request that extends all of it
    NONE = "none"  # no restored state is reused: nothing is saved


# --model-memory, and whether --swa-full is set
FORCED_POLICIES = {
    ("full", False): CachePolicy.PREFIX,
    ("full", True): CachePolicy.PREFIX,
    ("recurrent", False): CachePolicy.EXTEND_ONLY,
    ("recurrent", True): CachePolicy.EXTEND_ONLY,
    ("sliding-window", False): CachePolicy.NONE,
    ("sliding-window", True): CachePolicy.EXTEND_ONLY,
}


def cache_policy(memory: ModelMemory | None, swa_full: bool, forced: str = "auto") -> CachePolicy:
    """The policy for this model (`forced`: the --model-memory the user gave, "auto" when none); an unknown
    model gets the one that can never change an answer."""
    if forced != "auto":
        return FORCED_POLICIES[forced, swa_full]
    if memory is None:
        return CachePolicy.EXTEND_ONLY
    if memory.kind is MemoryKind.FULL:
        return CachePolicy.PREFIX
    if memory.kind is MemoryKind.SLIDING_WINDOW and not swa_full:
        return CachePolicy.NONE
    return CachePolicy.EXTEND_ONLY
