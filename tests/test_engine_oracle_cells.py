"""Engines of several TP sizes, layouts, connectors, serializers and tiers under random
stores, loads, pins, restarts and corrupted or cut records: every load is checked against
the KV oracle (tests/kv_oracle.py).

Each cell is a fleet: one engine per TP size listed (one CacheEngine per rank, as each rank
of a served model opens it), each rank with its own small cpu tier (evicting) over shared
folder tiers. Every rank of an engine stores its heads of a prompt (for one of three
tenants, whose KV differs; some tokens already stored: masked), or gives up a layer-wise
store half way; every rank of an engine loads a prompt through a random block table into a
fresh cache that holds the tokens the engine computed itself (masked). Per rank and load:
the tokens marked loaded are the run from the first unmasked one (a packed layout: block);
each holds exactly the KV its tenant computed (lossy serializers: within their bound); no
other element is written; an inline lookup agrees with the lookup (when no store can land
between them); and, while no record was
corrupted and the shared tiers keep everything of the loading tenant, the lookup and the load
are exactly what the stores so far hold for that rank's heads (whole chunks, partial chunks,
block-granular tails, in its own split of the heads or another TP size's). The tiers keep
everything of a tenant while all records stored so far fit in their budget and the tenant's
fit in its quota: a tenant over its quota evicts its own records, never another's (quota cells
also push tenant 1 past its quota between another tenant's store and load). Stores not
waited for are exact too, for the engine that made them, where its store queue is sync: the
tiers' write queues answer for what they have not written yet. A prompt pinned whole in the
one process of a budgeted tier loads whole.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from oracle_fleet import Cell, Fleet

CELLS = [
    # TP sizes 1, 2, 4 (8: replicated heads) reading each other's records, chunks of 6 over blocks of 4
    Cell("vllm_flash", heads=4, tps=(1, 2, 4), chunk=6, block_granular_hits=True, scrambled=True),
    Cell("vllm_flash", heads=4, tps=(1, 2, 4), chunk=6, block_granular_hits=True, scrambled=True, connector="native"),
    Cell("vllm_flash", heads=4, tps=(2, 8), block_granular_hits=True, shared=("shm",)),
    Cell("vllm_flash", heads=4, tps=(2, 4), heads_per_record=1, save_unfull_chunk=True, shared=("shm", "disk")),
    Cell("vllm_flash", heads=4, tps=(1, 2), heads_per_record=2, chunk=10, save_unfull_chunk=True),
    # vLLM's packed CPU layout, SGLang's token pool, MLA's latent record
    Cell("vllm_cpu", heads=4, tps=(1, 2), block_granular_hits=True, save_unfull_chunk=True),
    Cell("vllm_cpu", heads=4, tps=(2, 4, 1), heads_per_record=1, block_granular_hits=True, connector="native"),
    Cell("vllm_cpu", heads=2, tps=(1, 4), chunk=12, queue="async"),
    Cell(
        "sglang_mha", heads=2, tps=(1, 2), serializer="lz4", save_unfull_chunk=True, scrambled=True, connector="native"
    ),
    Cell("sglang_mha", heads=2, tps=(1, 2), serializer="zstd", save_unfull_chunk=True, block_granular_hits=True),
    Cell("vllm_mla", tps=(1, 2), chunk=6, block_granular_hits=True, shared=("shm",), connector="native"),
    # lossy serializers, within their bound
    Cell("vllm_flash", heads=2, tps=(1, 2), serializer="int8", block_granular_hits=True),
    Cell("vllm_cpu", heads=2, tps=(1, 2), serializer="fp8"),
    # shared tiers with small budgets: evictions (no completeness check), and pins in one process
    Cell("vllm_flash", heads=2, tps=(1, 2), shared_max_bytes=16384, block_granular_hits=True),
    Cell("sglang_mha", heads=2, tps=(1,), shared_max_bytes=12288, save_unfull_chunk=True, queue="async"),
    # per-tenant quotas (tenant 1's by name: about a chunk; tenant 2's the default) on budgets most
    # runs stay within: a tenant within its quota keeps every record, whoever else is over theirs
    Cell("sglang_mha", heads=2, tps=(1,), shared_max_bytes=49152, quotas=("3000", "25%"), save_unfull_chunk=True),
    Cell("vllm_flash", heads=2, tps=(1, 2), shared=("shm",), shared_max_bytes=40960, quotas=("3500", "20%")),
    # a cpu tier smaller than a prompt: loads at once after a store read the disk tier's write queue
    Cell("sglang_mha", heads=2, tps=(1, 2), cpu_max_bytes=4096, save_unfull_chunk=True),
    # sync tier write queues; MLA over disk; SGLang at TP 4 (replicated heads), chunks of 5
    Cell("vllm_mla", tps=(1, 2), chunk=6, block_granular_hits=True, tier_queue="sync"),
    Cell("sglang_mha", heads=2, tps=(4, 1), chunk=5, save_unfull_chunk=True, block_granular_hits=True),
]


@pytest.mark.parametrize("cell", CELLS, ids=str)
def test_every_load_is_the_computed_kv(cell: Cell) -> None:
    machine = type(f"Fleet_{cell.format}", (Fleet,), {"CELL": cell})
    run_state_machine_as_test(
        machine,
        settings=settings(
            # quotas: longer runs, for stores past one tenant's quota and within another's
            max_examples=8 if cell.quotas else 6,
            stateful_step_count=30 if cell.quotas else 20,
            deadline=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
