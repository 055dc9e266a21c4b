"""A soak of one real vLLM engine with kvplug, in the engine's process (``engine_driver.py``'s
``soak`` step), for test_soak.py.

Rounds of tiny requests of mixed shapes go through ``LLMEngine`` step by step: a prefix
shared by every round (kvplug hits), a repeat of the last round's prompts (whole-prompt
hits), fresh prompts (misses), per-request kvplug settings (valid and invalid), aborts
(waiting, in their first steps, decoding). Between rounds vLLM's prefix cache and kvplug's
memory tier are reset, so some hits load from disk, in the background, and after every other
round the disk records are corrupted for real, so some of those loads fail. A small KV cache
preempts requests.

After each round (every request ended, its stores landed, and one more tiny request so that
the workers hear of the last ones' end), :func:`kvplug_sizes` reads every structure kvplug
keeps per request on the scheduler and worker sides, and the process's threads and file
descriptors. The
engine runs in this process (``uni`` executor, no engine core process): both connector
roles are objects here.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any


def kvplug_sizes(llm: Any) -> dict[str, int]:
    """How many entries each per-request structure of kvplug's two connector roles holds."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    side = scheduler.connector._scheduler_side()
    worker = get_kv_transfer_group()._worker_side()
    pool = side.lookups.pool
    results = worker.results
    sizes = {
        "scheduler._states": len(side._states),
        "scheduler.lookups.pool._entries": len(pool) if pool is not None else 0,
        "scheduler.lookups.pool.in_flight": pool.in_flight if pool is not None else 0,
        "scheduler.events._events": len(side.events._events.get_all_events()) if side.events._events else 0,
        "scheduler._stats samples": _samples(side._stats),
        "scheduler.totals samples": _samples(side.totals),
        "worker.background._pending": worker.background.pending(),
        "worker.results._poisoned": len(results._poisoned),
        "worker.results._failed_requests": len(results._failed_requests),
        "worker.results._block_errors": len(results._block_errors),
        "worker.results.failed_this_step": len(results.failed_this_step),
        "worker._layers.loads": len(worker._layers.loads),
        "worker._layers.stores": len(worker._layers.stores),
        "worker._stats samples": _samples(worker._stats),
        "worker.index._events": len(worker.index._events) if worker.index is not None else 0,
        # the KV-events index names vLLM blocks of the chunks the tiers hold: not of every chunk ever stored
        "worker.index.chunks of chunks no tier holds": _unheld(worker),
        # vLLM's own books: kvplug's reports of finished loads must let it free every request
        "vllm.scheduler.requests": len(scheduler.requests),
        "vllm.scheduler.finished_recving_kv_req_ids": len(scheduler.finished_recving_kv_req_ids),
        "vllm.scheduler.failed_recving_kv_req_ids": len(scheduler.failed_recving_kv_req_ids),
    }
    return sizes


def _unheld(worker: Any) -> int:
    """Chunks the worker's KV-events index remembers as held that no tier holds."""
    if worker.index is None:
        return 0
    keys = worker.index.chunks.held_keys()
    held = [False] * len(keys)
    for tier in worker.engine.chain.tiers:
        held = [a or b for a, b in zip(held, tier.contains(keys))]
    return held.count(False)


def _samples(stats: Any) -> int:
    return sum(len(value) for value in stats.data.values() if isinstance(value, list))


def process_level(pooled_port: int | None = None) -> dict[str, Any]:
    """The process's Python threads (by name, a pool's numbers left out), all its threads
    (OpenMP's too) and open file descriptors; ``pooled_port``: those connected to that port
    (a client's connection pool, which opens connections as calls need them) counted apart."""
    names = sorted(thread.name.rstrip("0123456789_") for thread in threading.enumerate())
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used
            continue
    pooled = _sockets_to(pooled_port) if pooled_port is not None else set()
    connected = sum(1 for target in targets if target in pooled)
    return {
        "python_threads": {name: names.count(name) for name in names},
        "tasks": len(os.listdir("/proc/self/task")),
        "fds": len(targets) - connected,
        "pooled_connections": connected,
    }


def _sockets_to(port: int) -> set[str]:
    """``socket:[inode]`` of this process's TCP sockets connected to ``port`` on 127.0.0.1."""
    found = set()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port:
            found.add(f"socket:[{fields[9]}]")
    return found


def soak(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec["rounds"]`` rounds; returns each round's :func:`kvplug_sizes` and
    :func:`process_level`, and counts of what happened (preemptions, aborts, hits)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import RequestStatus

    rng = random.Random(spec.get("seed", 0))
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    disk = Path(spec["disk"]) if spec.get("disk") else None
    shared = [rng.randrange(3, 1000) for _ in range(128)]
    counts = {"requests": 0, "aborted": 0, "preempted_seen": 0, "hit_tokens": 0, "finished": 0, "pooled_seen": 0}
    pool = scheduler.connector._scheduler_side().lookups.pool
    rounds: list[dict[str, Any]] = []
    previous: list[list[int]] = []
    serial = 0

    def fresh(length: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(length)]

    for index in range(spec["rounds"]):
        # block-crossing lengths (32-token blocks): decodes need new blocks, which preempts
        prompts = [shared + fresh(rng.choice((29, 61, 93))) for _ in range(6)]
        prompts += previous[:4]  # whole-prompt hits
        prompts += [fresh(rng.choice((30, 94, 158))) for _ in range(6)]
        previous = prompts[:4]
        settings = [{}, {"kvplug.skip_save": True}, {"kvplug.save_unfull_chunk": True}, {"kvplug.no_such": 1}]
        ids: list[str] = []
        for position, prompt in enumerate(prompts):
            serial += 1
            request_id = f"soak-{serial}"
            params = SamplingParams(
                temperature=0.0,
                max_tokens=rng.choice((1, 4, 8)),
                ignore_eos=True,
                detokenize=False,
                extra_args={"kv_transfer_params": {"kvplug.report": True, **settings[position % len(settings)]}},
            )
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            ids.append(request_id)
        counts["requests"] += len(ids)
        # some aborted before any step (waiting), some after one (loading, prefilling), some later
        abort_at = {0: ids[3:4], 1: ids[5::7], 3: ids[8::9]}
        steps = 0
        while engine.has_unfinished_requests():
            for request_id in abort_at.get(steps, ()):
                engine.abort_request([request_id])
                counts["aborted"] += 1
            for out in engine.step():
                if out.finished:
                    counts["finished"] += 1
                    kv = out.kv_transfer_params or {}
                    counts["hit_tokens"] += int(kv.get("kvplug", {}).get("hit_tokens", 0))
            counts["preempted_seen"] += sum(1 for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED)
            counts["pooled_seen"] += len(pool) if pool is not None else 0  # requests whose lookup runs there
            steps += 1
        # Every store landed in (or was refused by) every tier; then one more request, whose step
        # tells the workers of the last round's ends and hands the writes' KV events to vLLM.
        get_kv_transfer_group()._worker_side().engine.flush()
        llm.generate(
            [{"prompt_token_ids": fresh(5)}],
            SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        )
        rounds.append({"sizes": kvplug_sizes(llm), "level": process_level(spec.get("pooled_port"))})
        llm.reset_prefix_cache(reset_connector=True)  # kvplug's memory tier too: hits load from disk
        if disk is not None and index % 2 == 1:
            _corrupt(disk)
    return {"rounds": rounds, "counts": counts}


def _corrupt(folder: Path) -> None:
    """Overwrite the middle of every chunk record: their loads fail their checksum (which
    records a round's async writes left is timing; that some load fails must not be)."""
    from record_files import chunk_records

    for path in chunk_records(folder):
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(64)
        path.write_bytes(bytes(data))
