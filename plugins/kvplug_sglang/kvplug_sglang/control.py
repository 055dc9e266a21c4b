"""``kvplug ctl`` for SGLang: each TP rank's scheduler serves a control socket.

With the radix-cache backend the rank's :class:`kvplug.CacheEngine` answers
(:class:`kvplug.EngineControl`). With the HiCache storage backend SGLang names pages
itself (``page_i = sha256(page_{i-1} || tokens_i)``, seeded with the request's
``extra_key``/``cache_salt``), so :class:`HiCacheControl` computes a prompt's page keys
with SGLang's own hash, as its cache controller does, and asks the backend's tiers. The
ranks of one server share its launcher's process id in their engine id.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

import kvplug
from kvplug import (
    ChunkLocation,
    ChunkStore,
    ClearKeys,
    ControlIdentity,
    ControlRequest,
    ControlServer,
    ControlTarget,
    PinReport,
    RequestInfo,
    pin_keys,
    unpin_keys,
)
from kvplug.errors import ControlProtocolError

logger = logging.getLogger("kvplug.sglang")
_started = itertools.count()


def start_control(
    target: kvplug.CacheEngine | ControlTarget,
    *,
    name: str,
    tp_rank: int,
    tp_size: int,
    stage: tuple[int, int] | None = None,
) -> ControlServer | None:
    """This rank's control server, or ``None`` (logged) if it cannot start: SGLang still serves.
    ``stage``: its pipeline stage and the number of stages (default: as SGLang published them)."""
    # The TP ranks' schedulers are children of one launcher process: its pid names the server
    # (and the count of caches this process started, the same on every rank). With --dp-size
    # every replica's schedulers are children of one process too: the replica tells them apart;
    # with --pp-size each stage's TP ranks count from 0 again: the stage does.
    engine_id = f"sglang-{os.getppid()}-{next(_started)}"
    pp_rank, pp_size = pipeline_stage() if stage is None else stage
    identity = ControlIdentity(
        engine_id,
        name,
        "sglang",
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=replica_rank(),
        pp_rank=pp_rank,
        pp_size=pp_size,
    )
    try:
        server = ControlServer(target, identity)
    except Exception as exc:
        logger.warning("kvplug ctl is not available for this rank: %s", exc)
        return None
    logger.info("kvplug ctl: %s rank pp%d/tp%d answers on %s", identity.engine_id, pp_rank, tp_rank, server.path)
    return server


def pipeline_stage() -> tuple[int, int]:
    """This scheduler's pipeline stage and the number of stages ((0, 1) where SGLang published none)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        parallel = get_parallel()
        return int(parallel.pp_rank), int(parallel.pp_size)
    except (RuntimeError, ValueError, TypeError):  # not stated in this process
        return 0, 1


def replica_rank() -> int:
    """Which data-parallel replica this scheduler serves (0 without SGLang's DP controller)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        rank = get_parallel().dp_rank
    except (RuntimeError, ValueError):  # not stated in this process: no DP controller spawned it
        return 0
    return int(rank) if rank is not None else 0


def rank_in_replica(tp_rank: int, tp_size: int) -> tuple[int, int]:
    """This scheduler's TP rank and the TP width of its data-parallel rank, as its control
    socket says them (``kvplug ctl`` counts TP ranks from 0 in each dp rank); ``tp_rank``,
    ``tp_size``: what to say where SGLang published no parallel config (a backend built by hand).

    With attention DP the launcher numbers the TP ranks across the engine and gives each
    attention-DP group its own dp_rank; a group holds ``attn_cp_size * attn_tp_size`` ranks
    (``tp_rank = (attn_dp_rank * attn_cp_size + attn_cp_rank) * attn_tp_size + attn_tp_rank``).
    The attention-TP rank alone (what SGLang hands a HiCache backend) is the same on a group's
    attention-CP peers: their control sockets would have one name, and one replace the other."""
    from sglang.srt.runtime_context import get_parallel

    try:
        parallel = get_parallel()
        rank, size, groups = int(parallel.tp_rank), int(parallel.tp_size), int(parallel.attn_dp_size)
    except (RuntimeError, ValueError, TypeError):  # not stated in this process
        return tp_rank, tp_size
    group = size // groups if groups > 1 and size % groups == 0 else size
    # Only where the launcher gave the group as the dp_rank: else two groups' ranks would say
    # the same place; the engine-wide numbering is unique then.
    if group < size and replica_rank() == rank // group:
        return rank % group, group
    return rank, size


class PageStorage(Protocol):
    """What :class:`HiCacheControl` needs of the HiCache backend (``KVPlugStorage``)."""

    def storage_key(self, key: str) -> str: ...


class HiCacheControl(ControlTarget):
    """The control target of the HiCache backend, ``KVPlugStorage`` (pages, not chunks)."""

    def __init__(self, storage: PageStorage, store: ChunkStore, page_size: int) -> None:
        # The backend hands its tiers' events to the journal (``ChunkStore.open(emit=)``).
        super().__init__(store.chain, store.metrics, hears_tiers=True)
        self.storage = storage
        self.store = store
        self.page_size = page_size
        # Which tiers the backend's own writes put each page in: a page a shared tier already
        # held (another server wrote it) is not written again, and a clear leaves it there.
        self.chain.writes.add(self.journal.on_written)

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.store.fingerprint.model_id,
            "fingerprint": self.store.fingerprint.hexdigest(),
            "chunk_size": self.page_size,
        }

    def page_keys(self, tokens: Sequence[int], request: RequestInfo) -> list[str]:
        """kvplug's keys of the prompt's whole pages, as SGLang's cache controller names them
        (``get_storage_hash_str``: the LoRA id is SGLang's ``extra_key``)."""
        from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

        seed = storage_namespace_seed(request.lora_id, request.cache_salt)
        whole = len(tokens) // self.page_size * self.page_size
        hashes = get_hash_str(list(tokens[:whole]), seed, page_size=self.page_size) if whole else []
        return [self.storage.storage_key(h) for h in hashes]

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> list[tuple[str, int]]:
        return [(location.tier, location.tokens) for location in self.locate(tokens, request)]

    def locate(self, tokens: Sequence[int], request: RequestInfo) -> list[ChunkLocation]:
        return self.locate_keys(self.page_keys(tokens, request), self.page_size)

    def pin(self, tokens: Sequence[int], request: RequestInfo, *, unpin: bool = False) -> PinReport:
        # Page keys carry the salt (SGLang seeds its page hash with it), so a pin is per salt too.
        keys = self.page_keys(tokens, request)
        if unpin:
            return unpin_keys(self.store.chain, keys, tokens_per_key=self.page_size)
        return pin_keys(self.store.chain, keys, tokens_per_key=self.page_size)

    def clear_keys(self, request: ControlRequest) -> ClearKeys:
        if request.fields.get("all_salts") is not True:
            raise ControlProtocolError(
                "SGLang hashes the cache_salt into its page keys: clear --salt cannot tell them apart; use --all"
            )
        # Only the pages this backend wrote, from the tiers it wrote them to: pages it read
        # from a shared tier are other servers'.
        written, _ = self.journal.split()
        return ClearKeys(written, [], "every cache_salt", self.journal.written_to(written))

    def every_page_written(self) -> ClearKeys:
        """The pages this backend wrote, each from the tiers its own writes put it in
        (SGLang's ``clear``): a page a shared tier already held stays the other writer's."""
        written, _ = self.journal.split()
        return ClearKeys(written, [], "every cache_salt", self.journal.written_to(written))

    def close(self) -> None:
        self.chain.writes.remove(self.journal.on_written)
