"""The scheduler side's lookups: which tiers hold a request's prefix, inline or in the background.

The scheduler asks the worker's cache engine through one channel (:mod:`kvplug_vllm.lookup`).
With ``background_lookups``, a lookup the tiers answering inline (memory, local files) cannot
answer alone runs in a :class:`~kvplug_vllm.lookup_pool.LookupPool`: its answer is ``None``
("ask again next step") until it is done. A failed lookup is a miss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvplug import KVPlugConfig
from kvplug.errors import KVPlugError
from kvplug_vllm.lookup import DirectLookup, SocketLookup, inline_tiers, open_channel
from kvplug_vllm.lookup_pool import LookupPool, Tiers
from kvplug_vllm.request_state import RequestState
from kvplug_vllm.settings import ConnectorSettings

logger = logging.getLogger("kvplug.vllm")


class SchedulerLookups:
    """The lookup channel and the background lookups of one scheduler."""

    def __init__(
        self,
        settings: ConnectorSettings,
        config: KVPlugConfig,
        engine_key: tuple[str, int, int],
        workers: int,
        count_time: Callable[[float], None],
    ) -> None:
        self.settings = settings
        self.engine_key = engine_key
        #: The engine's workers: every tensor-parallel rank of every pipeline stage.
        self.workers = workers
        #: Called with the seconds each lookup took (every ask of a background one).
        self._count_time = count_time
        #: Tier types looked up on the scheduler thread (memory, local files); the others in the background.
        self.inline = inline_tiers(config)
        self._channel: DirectLookup | SocketLookup | None = None
        #: Lookups off the scheduler thread (lookup_pool.py).
        self.pool: LookupPool | None = None
        if settings.background_lookups and any(spec.type not in self.inline for spec in config.tiers):
            self.pool = LookupPool(settings.max_background_lookups, settings.lookup_timeout_s)

    def find(self, state: RequestState, tokens: list[int]) -> Tiers | None:
        """The request's cached prefix by tier, or ``None`` while its background lookup runs."""
        if state.answer is not None:  # not admitted when last answered: the same answer
            return state.answer
        req_id, info = state.req_id, state.info
        started = time.perf_counter()
        try:
            channel = self.channel()
            tiers = channel.locate(tokens, info) if self.pool is None else channel.inline_lookup(tokens, info)
        except KVPlugError as exc:
            logger.warning("request %s: lookup failed, treated as a miss: %s", req_id, exc)
            tiers = []
        if tiers is not None:
            if self.pool is not None:  # answered inline: an earlier ask's lookup is stale
                self.pool.discard(req_id)
            self._count_time(time.perf_counter() - started)
            return tiers
        assert self.pool is not None
        answer = self.pool.ask(req_id, lambda: channel.locate(tokens, info))
        if answer is None:
            return None
        # Time is spent on every ask; what was found is counted once the request is admitted.
        self._count_time(answer.waited_s)
        state.answer = answer.tiers
        return answer.tiers

    def wait_any(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for a background lookup to finish (none running: return)."""
        if self.pool is not None:
            self.pool.wait_any(timeout_s)

    def discard(self, req_id: str) -> None:
        """Drop the request's background lookup, if any (it finished, or was answered inline)."""
        if self.pool is not None:
            self.pool.discard(req_id)

    def channel(self) -> DirectLookup | SocketLookup:
        """The channel to the worker's cache engine, opened on first use."""
        if self._channel is None:
            self._channel = open_channel(
                self.engine_key, self.workers, self.settings.lookup_channel, self.settings.lookup_timeout_s
            )
        return self._channel

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
