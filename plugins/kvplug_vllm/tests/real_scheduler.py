"""vLLM's own scheduler with KVPlugConnector on its scheduler side, and no model runner.

``Scheduler`` is vLLM's class, built from a real ``VllmConfig`` of the tiny random model
(only its config is read: no weights, no worker process); vLLM makes the connector itself
from ``kv_transfer_config``, by its registered name. Its lookups go to a real
:class:`kvplug.CacheEngine` registered as this process's worker (``lookup_channel:
direct``), so a test drives ``add_request``/``schedule``/``finish_requests`` and reads the
metadata vLLM hands to the workers, as vLLM builds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, load_config, slots_from_block_ids
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.lookup import LocalWorker, register_local, unregister_local

BLOCK_SIZE = 32
CHUNK_SIZE = 64
NUM_BLOCKS = 64
LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
#: The same cache shape, [num_blocks, 2, block_size, 128], read as K and V of one 128-wide head a
#: token, copied token by token: a chunk may end inside a block (VLLM_CPU copies whole blocks only).
TOKEN_LAYOUT = KVLayout(
    PagedFormat("loop_tokens", ("block", "kv", "token", "dim")), 2, BLOCK_SIZE, 1, 128, torch.bfloat16
)


@contextmanager
def real_scheduler(
    model: str,
    engine_id: str,
    *,
    max_num_batched_tokens: int = 1024,
    num_blocks: int = NUM_BLOCKS,
    layout: KVLayout = LAYOUT,
    engine_settings: dict[str, Any] | None = None,
    **settings: Any,
) -> Iterator[tuple[Any, CacheEngine]]:
    """vLLM's ``Scheduler`` with KVPlugConnector, and the cache engine its lookups ask (cpu tier).

    ``layout``: the engine's, of :class:`EngineLoop`'s cache shape (:data:`TOKEN_LAYOUT` copies
    single tokens, where :data:`LAYOUT` copies whole blocks only); ``engine_settings``: more of the
    cache engine's own kvplug config (``settings`` go to the connector)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from kvplug_vllm.registration import register

    register()
    extra = {"kvplug.chunk_size": CHUNK_SIZE, "kvplug.lookup_channel": "direct"}
    extra.update({f"kvplug.{name}": value for name, value in settings.items()})
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model, dtype="bfloat16", seed=0, max_model_len=1024, skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPlugConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            engine_id=engine_id,
            kv_connector_extra_config=extra,
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    init_none_hash(sha256)
    engine_extra = {"kvplug.chunk_size": CHUNK_SIZE, "kvplug.store.queue.mode": "sync"}
    engine_extra.update({f"kvplug.{name}": value for name, value in (engine_settings or {}).items()})
    config = load_config(engine_extra=engine_extra, env={}).config
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="real-scheduler")) as engine:
        register_local((engine_id, 0, 0), LocalWorker(engine, lambda: 0))
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
        )
        try:
            yield scheduler, engine
        finally:
            scheduler.shutdown()
            unregister_local((engine_id, 0, 0))


def new_request(request_id: str, prompt: list[int], max_tokens: int = 4, *, report: bool = False) -> Any:
    """A vLLM ``Request`` as its engine core makes one (block hashes for its prefix cache);
    ``report``: it asks for kvplug's report (:attr:`EngineLoop.reports`)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    extra = {"kv_transfer_params": {"kvplug.report": True}} if report else None
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    return Request(request_id, prompt, params, None, block_hasher=hasher)


def session_turn(
    prompt: list[int], *, resumable: bool = True, mm_features: list[Any] | None = None, max_tokens: int = 3
) -> Any:
    """A turn of streaming-input session ``"s"`` (``resumable``: more turns follow), as
    ``add_request`` gets each: vLLM appends it to the session's prompt."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    params = SamplingParams(max_tokens=max_tokens)
    return Request("s", prompt, params, None, block_hasher=hasher, resumable=resumable, mm_features=mm_features)


def run_turn(loop: EngineLoop) -> None:
    """Step until session ``"s"`` waits for its next turn."""
    from vllm.v1.request import RequestStatus

    for _ in range(50):
        loop.step()
        if loop.scheduler.requests["s"].status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            return
    raise AssertionError("the turn did not end")


def model_kv(tokens: list[int], start: int = 0) -> torch.Tensor:
    """The KV the stand-in model computes for ``tokens`` from position ``start`` (every element of
    a token's slot the same; exact in bf16)."""
    ids, positions = torch.tensor(tokens, dtype=torch.long), torch.arange(start, start + len(tokens))
    return ((ids * 31 + positions * 7) % 251).to(torch.bfloat16)


class EngineLoop:
    """vLLM's scheduler and kvplug's worker side in one loop, a stand-in for the model runner.

    Each step goes as vLLM's model runner drives a connector (bind, ``start_load_kv``, forward,
    ``wait_for_save``, ``get_finished``, load errors) and back into ``update_from_output``. The
    forward writes :func:`model_kv` of each scheduled token into its slot: loads, stores and
    vLLM's prefix cache move real bytes between real caches and tiers, and any slot can be
    checked against what the model computes there.
    """

    def __init__(self, scheduler: Any, engine: CacheEngine, num_blocks: int = NUM_BLOCKS) -> None:
        from types import SimpleNamespace

        from kvplug_vllm.settings import ConnectorSettings
        from kvplug_vllm.worker import WorkerSide

        self.scheduler, self.engine = scheduler, engine
        self.caches = [torch.zeros(num_blocks, 2, BLOCK_SIZE, 128, dtype=torch.bfloat16) for _ in range(2)]
        self.meta: Any = None
        parent = SimpleNamespace(has_connector_metadata=lambda: True, _get_connector_metadata=lambda: self.meta)
        roles = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True))
        self.worker = WorkerSide(parent, roles, ConnectorSettings(load="sync"), {}, ("loop", 0, 0))
        self.worker.engine, self.worker.kv_caches = engine, self.caches
        self.blocks: dict[str, list[int]] = {}
        #: What vLLM returned as each finished request's kv_transfer_params (kvplug's report).
        self.reports: dict[str, Any] = {}
        #: (request, first position) of each forward that read KV other than the model's.
        self.misread: list[tuple[str, int]] = []

    def store(self, prompt: list[int]) -> None:
        """Store ``prompt``'s KV as the model computes it (through blocks freed again after)."""
        blocks = list(range(1, 1 + -(-len(prompt) // BLOCK_SIZE)))
        slots = slots_from_block_ids(blocks, BLOCK_SIZE, len(prompt))
        self._write(slots, model_kv(prompt))
        self.engine.store(prompt, self.caches, slots)
        for cache in self.caches:
            cache.zero_()

    def step(self, after_schedule: Any = None) -> tuple[Any, set[int]]:
        """One engine step; ``after_schedule(output)`` runs between the scheduler and the worker."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        output = self.scheduler.schedule()
        if after_schedule is not None:
            after_schedule(output)
        self.meta = output.kv_connector_metadata
        self.worker.begin_step()
        self.worker.start_load_kv()
        self._track_blocks(output)
        sampled = [self._forward(req_id, count) for req_id, count in output.num_scheduled_tokens.items()]
        self.worker.wait_for_save()
        finished = self.worker.get_finished(output.finished_req_ids)
        errors = self.worker.get_block_ids_with_load_errors()
        ids = list(output.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={req_id: index for index, req_id in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_recving=finished, invalid_block_ids=errors),
        )
        outputs = self.scheduler.update_from_output(output, runner)
        for engine_outputs in outputs.values():
            for done in engine_outputs.outputs:
                if done.kv_transfer_params is not None:
                    self.reports[done.request_id] = done.kv_transfer_params
        return output, errors

    def wrong_positions(self, prompt: list[int]) -> tuple[int, list[int]]:
        """Load ``prompt``'s cached prefix into fresh caches: (tokens hit, positions not as computed)."""
        fresh = [torch.zeros_like(cache) for cache in self.caches]
        slots = slots_from_block_ids(list(range(1, 1 + -(-len(prompt) // BLOCK_SIZE))), BLOCK_SIZE, len(prompt))
        hit = int(self.engine.retrieve(prompt, fresh, slots).sum())
        return hit, self._differ(fresh, slots[:hit], prompt[:hit])

    def _track_blocks(self, output: Any) -> None:
        for new in output.scheduled_new_reqs:
            self.blocks[new.req_id] = list(new.block_ids[0])
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            added = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                self.blocks[req_id] = list(added[0]) if added else []
            elif added:
                self.blocks[req_id] += list(added[0])

    def _forward(self, req_id: str, count: int) -> list[int]:
        request = self.scheduler.requests[req_id]
        start = request.num_computed_tokens - count  # vLLM counted this step's tokens already
        slots = slots_from_block_ids(self.blocks[req_id], BLOCK_SIZE, start + count)
        tokens = request.all_token_ids
        if self.worker.results.bad_blocks_this_step.isdisjoint(self.blocks[req_id]):  # else vLLM rolls it back
            wrong = self._differ(self.caches, slots[:start], tokens[:start])  # what attention reads
            if wrong:
                self.misread.append((req_id, wrong[0]))
        end = min(start + count, len(tokens))
        self._write(slots[start:end], model_kv(tokens[start:end], start))
        return [7] if request.num_computed_tokens >= request.num_tokens else []

    def _write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        for cache in self.caches:
            cache[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE, :] = values[:, None, None]

    def _differ(self, caches: list[torch.Tensor], slots: torch.Tensor, tokens: list[int]) -> list[int]:
        """Positions whose slot in ``caches`` holds other KV than the model's for ``tokens``."""
        expected = model_kv(tokens)[:, None, None]
        bad = torch.zeros(len(tokens), dtype=torch.bool)
        for cache in caches:
            bad |= (cache[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE, :] != expected).flatten(1).any(1)
        return [int(p) for p in bad.nonzero().flatten()]
