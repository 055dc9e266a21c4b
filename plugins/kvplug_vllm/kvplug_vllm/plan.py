"""The scheduler side's chunk arithmetic: what a lookup lets vLLM skip, and what each step stores.

Pure functions of token counts, so that the rules are in one place and tested on their own
(``tests/test_plan.py``):

- a lookup's hit lets vLLM skip the tokens past its own prefix cache, but never the last
  token of the request (vLLM must compute one token to sample from): :func:`tokens_to_load`;
- each step stores the whole chunks its KV completes that are not stored yet (the last,
  partial chunk of the prompt too with ``save_unfull_chunk``, and its tail in whole blocks
  with ``block_granular_hits``; tokens past the prompt only with ``save_decode_cache``):
  :func:`plan_step`;
- a request whose computed count went back (preempted, or rolled back after a failed load)
  stores again from the last whole chunk before it: :func:`rolled_back`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplug import ChunkLocation

#: The medium served at memory speed; a prefix needing a tier of any other medium
#: (``StorageTier.medium``) loads in the background (load: auto).
FAST_MEDIUM = "memory"


def whole_chunks(num_tokens: int, chunk_size: int) -> int:
    """The tokens of the whole chunks among the first ``num_tokens``."""
    return num_tokens // chunk_size * chunk_size


def tokens_to_load(num_hit: int, num_computed: int, num_tokens: int) -> int:
    """Tokens vLLM may take from kvplug: the hit past what it computed already, less the
    request's last token when the hit covers it all (vLLM samples from that token's output)."""
    need = num_hit - num_computed
    if num_hit == num_tokens:
        need -= 1
    return max(need, 0)


def background_hit(
    tiers: Sequence[ChunkLocation], num_computed: int, num_tokens: int, block_size: int
) -> list[ChunkLocation]:
    """The chunks of ``tiers`` a background load can write into the blocks vLLM allocates for it.

    vLLM allocates a background load's blocks for the promised tokens only
    (:func:`tokens_to_load`): a hit of the whole prompt promises all but its last token, and
    when that token begins a block of its own, the block is not there to write the chunk
    holding it into. That chunk is left out of the hit: vLLM computes its tokens.
    """
    hit = sum(location.tokens for location in tiers)
    promised_end = num_computed + tokens_to_load(hit, num_computed, num_tokens)
    if tiers and hit == num_tokens and -(-hit // block_size) > -(-promised_end // block_size):
        return list(tiers[:-1])
    return list(tiers)


def loads_in_background(
    tiers: Sequence[ChunkLocation],
    num_computed: int,
    *,
    load: str,
    num_groups: int,
    pipeline_stages: int = 1,
) -> bool:
    """Whether a load of the chunks past ``num_computed`` goes to the background.

    A model of several KV cache groups always loads in the background (vLLM takes a failed
    load of several groups by request, never by block id), and so does a model split into
    pipeline stages: a synchronous load that failed on one stage spoils what the later
    stages compute on top of it in that step, and the stages run a step at different times,
    so they cannot agree on it before storing (tensor-parallel ranks do: ``LoadResults.agree``);
    vLLM computes a background load's request only once every stage loaded it. Otherwise the
    ``load`` setting decides, and ``auto`` loads in the background when a chunk to load is in
    a tier whose medium is not memory.
    """
    if num_groups > 1 or pipeline_stages > 1:
        return True
    if load != "auto":
        return load == "async"
    end = 0
    for location in tiers:
        end += location.tokens
        if end > num_computed and location.medium != FAST_MEDIUM:
            return True
    return False


@dataclass(frozen=True)
class SaveRules:
    """What a request may store: the engine's settings and the request's own."""

    chunk_size: int
    #: This engine stores at all (vLLM's kv_role is a producer) and the request does not skip it.
    can_save: bool = True
    save_unfull_chunk: bool = False
    #: The prompt's tail past its last whole chunk is stored too, cut at a block end by the
    #: cache engine (``block_granular_hits``).
    save_tail: bool = False
    save_decode_cache: bool = False


def save_end(end: int, prompt_len: int, rules: SaveRules) -> int:
    """How many leading tokens should be stored once the KV of the first ``end`` exists."""
    if not rules.can_save:
        return 0
    if end > prompt_len and not rules.save_decode_cache:
        end = prompt_len  # decode tokens are not stored
    if end == prompt_len and (rules.save_unfull_chunk or rules.save_tail):
        return end
    return whole_chunks(end, rules.chunk_size)


@dataclass(frozen=True)
class StepPlan:
    """What one scheduled step of a request stores."""

    #: Store ``[save_start, save_end)`` (both 0: nothing); ``save_start`` is a chunk start.
    save_start: int
    save_end: int
    #: The handed-over recurrent states to store: (KV cache group, block id, boundary).
    states: tuple[tuple[int, int, int], ...]
    #: The request's stored count after this step.
    num_saved: int

    @property
    def saving(self) -> bool:
        return self.save_end > 0

    @property
    def stored_to(self) -> int:
        """The tokens the worker needs for this step's stores."""
        return max(self.save_end, *(n for _, _, n in self.states), 0)


def plan_step(
    num_saved: int,
    end: int,
    prompt_len: int,
    rules: SaveRules,
    handed: Sequence[tuple[int, int, int]] = (),
) -> StepPlan:
    """The stores of a step after which the KV of the first ``end`` tokens exists, for a
    request of which ``num_saved`` tokens are stored already.

    A partial chunk stored earlier (``save_unfull_chunk``) is stored again whole once it is
    complete, so the store starts at the chunk start before ``num_saved``. vLLM hands over
    a recurrent state in the step that computes its boundary; only those at a chunk end up
    to what is stored are kept (a state is a chunk's record of its state group).
    """
    stop = save_end(end, prompt_len, rules)
    states = tuple((g, b, n) for g, b, n in handed if n % rules.chunk_size == 0 and 0 < n <= stop)
    if stop > num_saved:
        return StepPlan(whole_chunks(num_saved, rules.chunk_size), stop, states, stop)
    return StepPlan(0, 0, states, num_saved)


def rolled_back(num_saved: int, num_computed: int, chunk_size: int) -> int:
    """The stored count of a request whose computed count went back to ``num_computed``:
    its chunks from the first not wholly computed on are stored again."""
    return min(num_saved, whole_chunks(num_computed, chunk_size))


def promised_blocks(
    num_computed: int, num_external: int, first_real: int, block_size: int
) -> list[tuple[int, int, int]]:
    """The blocks a load promised vLLM, as ``(block index, first token, end token)`` each: the
    tokens ``[num_computed, num_computed + num_external)`` from the first whose block is allocated
    (``first_real``: a sliding window's earlier blocks are vLLM's null block) on, cut at block ends."""
    start, end = max(num_computed, first_real), num_computed + num_external
    spans = [
        (block, max(start, block * block_size), min(end, (block + 1) * block_size))
        for block in range(start // block_size, -(-end // block_size))
    ]
    return [(block, lo, hi) for block, lo, hi in spans if lo < hi]


def saved_after_background_load(num_hit: int, promised_end: int, num_computed: int, chunk_size: int) -> int:
    """The stored count of a request whose background load ended with ``num_computed`` tokens
    in vLLM's cache: the whole hit when every promised token (up to ``promised_end``) loaded,
    as after a synchronous load (a full-prompt hit leaves its last token to vLLM, so the last
    chunk is not complete in vLLM's cache but is stored); else the whole chunks before the
    first block that failed."""
    if num_computed >= promised_end:
        return num_hit
    return whole_chunks(min(num_hit, num_computed), chunk_size)
