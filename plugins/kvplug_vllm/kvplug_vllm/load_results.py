"""What did not load, in the form vLLM takes it back.

A model of one KV cache group reports the promised blocks that did not load
(``get_block_ids_with_load_errors``); vLLM rolls the request back to the first of them
and recomputes from there. A model of several groups reports a failed load by request
(``failed_recving``): vLLM maps block ids to requests for one group only, and
recomputes such a request whole.

A request whose load failed stores nothing in that step: its later blocks were computed
on top of the bad ones. Nor in the steps vLLM scheduled before it saw the failure (vLLM's
``max_concurrent_batches`` steps are in flight: two with async scheduling, ``pp`` with
pipeline parallelism, ``pp + 1`` with both): a request whose synchronous load failed
stores nothing until vLLM has rolled it back (its ``RequestMeta.epoch`` grows) or it
finished. The same holds for every request whose step reads a bad block as context
(``RequestMeta.computes``): vLLM's prefix cache shares a loading request's blocks with a
request admitted in the same step, and vLLM rolls both back. In each later step in flight
such a block stays bad until a request computes it again (vLLM has the first holder
recompute it for all, whether or not it stores anything in that step; or the block went
to a new request that loads or computes it). A block computed on top of a bad one is only
read with it (a prefix), so the bad block names every reader.

Tensor-parallel ranks compute every token together (their attention outputs are summed),
so a synchronous load that failed on one rank spoils what every rank computes on top of it.
Before a step's stores the ranks agree (:meth:`LoadResults.agree`): each learns the other
ranks' failed requests and bad blocks, so no rank stores its head records of KV computed
on top of a block another rank could not load.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from kvplug_vllm.background import GroupsRetrieve
from kvplug_vllm.kv_groups import first_real_token
from kvplug_vllm.metadata import RequestMeta
from kvplug_vllm.plan import promised_blocks
from kvplug_vllm.stats import KVPlugConnectorStats

logger = logging.getLogger("kvplug.vllm")


class LoadResults:
    """The loads that failed, until vLLM takes them (block ids, or requests)."""

    def __init__(self, steps_in_flight: int = 2) -> None:
        self._block_errors: set[int] = set()
        #: Requests of this step whose load failed, or that hold a block that did not load:
        #: they store nothing in it.
        self.failed_this_step: set[str] = set()
        #: Blocks of this step that did not load (reported to vLLM, or still to be).
        self.bad_blocks_this_step: set[int] = set()
        #: Those of the steps before, newest first: the steps vLLM scheduled before it saw them
        #: (``steps_in_flight - 1``: one with async scheduling, ``pp - 1`` or ``pp`` with pipeline
        #: parallelism), and at least one (see the module docstring).
        self._recent_bad_blocks: deque[set[int]] = deque(maxlen=max(1, steps_in_flight - 1))
        self._failed_requests: set[str] = set()
        #: Requests whose synchronous load failed -> their epoch then (see the module docstring).
        self._poisoned: dict[str, int] = {}

    def check_blocks(
        self, request: RequestMeta, loaded: torch.Tensor | None, block_size: int, stats: KVPlugConnectorStats
    ) -> None:
        """Note the promised blocks that did not load (``loaded`` None: none did)."""
        assert request.load is not None
        load = request.load
        if loaded is None:
            loaded = torch.zeros(load.num_hit, dtype=torch.bool)
        end = load.num_computed + load.num_external
        start = max(load.num_computed, first_real_token(request.block_ids, block_size))  # none before the window
        promised = promised_blocks(load.num_computed, load.num_external, start, block_size)
        bad = {request.block_ids[block] for block, lo, hi in promised if not bool(loaded[lo:hi].all())}
        if bad:
            self._block_errors |= bad
            self.bad_blocks_this_step |= bad
            self.failed_this_step.add(request.req_id)
            stats.add(load_error_blocks=len(bad), load_error_requests=1)
            logger.warning(
                "request %s: %d of %d promised tokens did not load; reporting %d blocks for recompute",
                request.req_id, int((~loaded[start:end]).sum()), end - start, len(bad),
            )  # fmt: skip

    def check_groups(self, request: RequestMeta, retriever: GroupsRetrieve | None, stats: KVPlugConnectorStats) -> None:
        """A load of several groups counts whole or not at all: vLLM recomputes a failed one from scratch."""
        assert request.load is not None
        if retriever is not None and retriever.complete(request.load.num_computed + request.load.num_external):
            return
        self._failed_requests.add(request.req_id)
        stats.add(load_error_requests=1)
        logger.warning("request %s: a KV cache group did not load; vLLM recomputes the request", request.req_id)

    def poison(self, request: RequestMeta) -> None:
        """``request``'s synchronous load failed: what vLLM computes of it until it rolls it back
        was computed on top of the blocks that did not load."""
        self._poisoned[request.req_id] = request.epoch

    def begin_step(self) -> None:
        """A new step: the last one's bad blocks are kept while steps scheduled before vLLM saw
        them may still run (see the module docstring)."""
        self.failed_this_step.clear()
        self._recent_bad_blocks.appendleft(self.bad_blocks_this_step)
        self.bad_blocks_this_step = set()

    def agree(self, requests: Sequence[RequestMeta], all_ranks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Take the other tensor-parallel ranks' failed loads of this step as this rank's own.

        ``all_ranks`` sums a tensor over the ranks (a collective: every rank calls this in the
        same step, with the same ``requests``, the step's metadata). One flag per request (its
        load failed), then one per block of the requests that loaded synchronously (it did not
        load): the requests whose load failed on any rank store nothing and are poisoned, and
        the sharers of any rank's bad blocks are refused by :meth:`refuse_sharers` alike."""
        loading = [r for r in requests if r.load is not None and not r.load.background]
        flags = [r.req_id in self.failed_this_step for r in requests]
        flags += [block in self.bad_blocks_this_step for r in loading for block in r.block_ids]
        summed = all_ranks(torch.tensor(flags, dtype=torch.int32)).tolist()
        for request, count in zip(requests, summed):
            if count and request.req_id not in self.failed_this_step:
                self.failed_this_step.add(request.req_id)
                self.poison(request)
        blocks = [block for r in loading for block in r.block_ids]
        self.bad_blocks_this_step |= {block for block, count in zip(blocks, summed[len(requests) :]) if count}

    def refuse_sharers(
        self, requests: Sequence[RequestMeta], block_size: int, computed_elsewhere: Iterable[int] = ()
    ) -> None:
        """Treat the requests whose step read a block that did not load (this step, or the last
        and not computed again in this one) as if their own load failed: vLLM computed them on
        top of it, and rolls them back. ``computed_elsewhere``: the blocks this step's requests
        that are not in ``requests`` compute."""
        if not (self.bad_blocks_this_step or any(self._recent_bad_blocks)):
            return
        computed = {  # blocks this step writes: what its loads promised and what it computes
            block
            for r in requests
            for block in r.block_ids[_first_written(r) // block_size : -(-r.computes[1] // block_size)]
        }
        computed.update(computed_elsewhere)
        for earlier in self._recent_bad_blocks:
            earlier -= computed  # written again: fine from this step on
        bad = self.bad_blocks_this_step.union(*self._recent_bad_blocks)
        for request in requests:
            context = request.block_ids[: -(-request.computes[0] // block_size)]
            if request.req_id not in self.failed_this_step and not bad.isdisjoint(context):
                self.failed_this_step.add(request.req_id)
                self.poison(request)

    def may_store(self, request: RequestMeta) -> bool:
        """Whether ``request``'s KV of this step may be stored (not computed on a failed load)."""
        if request.req_id in self.failed_this_step:
            return False
        failed_at = self._poisoned.get(request.req_id)
        if failed_at is None:
            return True
        if request.epoch > failed_at:  # vLLM rolled it back since: recomputed from before the bad blocks
            del self._poisoned[request.req_id]
            return True
        return False

    def forget(self, req_ids: set[str]) -> None:
        """Drop what is kept of finished requests."""
        for req_id in req_ids:
            self._poisoned.pop(req_id, None)

    def take_block_errors(self) -> set[int]:
        errors, self._block_errors = self._block_errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        failed, self._failed_requests = self._failed_requests, set()
        return failed


def sum_over(group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """:meth:`LoadResults.agree`'s sum over the ranks of ``group``, a ``torch.distributed``
    process group (vLLM's tensor-parallel group's CPU one: small flags, no device copy)."""

    def summed(tensor: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(tensor, group=group)
        return tensor

    return summed


def _first_written(request: RequestMeta) -> int:
    """The first token whose KV ``request``'s step writes: its synchronous load's, or its first computed."""
    load = request.load
    return load.num_computed if load is not None and not load.background else request.computes[0]
