"""Weights SGLang updates in place (RL, online serving) are never served the old weights' KV."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
from sglang_pools import fill_random, kvplug_extra, write_model_dir
from test_sglang_hicache import PAGE, make_backend, make_host, page_keys, random_pages

from kvplug_sglang import page_identity
from kvplug_sglang.connector import KVPlugConnector, StoreMetadata

HERE = Path(__file__).parent

#: Serves a prompt on a kvplug radix cache (stored), has SGLang's scheduler update the weights
#: in place through its own handler (argv[2]: from disk, or from tensors), then serves the same
#: prompt again; prints what each request was promised from kvplug and the weights generation.
#: The model runner's own update is a stand-in (no model runs in these tests: "prefill" writes
#: random KV, other per seed, as other weights compute other KV); the scheduler's handler, its
#: flush of the tree and kvplug's hooks (applied by SGLang's plugin loading) are SGLang's own.
UPDATE = """
import json, sys, tempfile
from types import SimpleNamespace
import torch.distributed as dist
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager, _WeightUpdateSession
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang_flow import build_stack, published_server_args, serve_request
from kvplug_sglang import page_identity
from kvplug_sglang.connector import KVPlugConnector, StoreMetadata

def flush(empty_cache=False):
    stack.tree.reset()  # what Scheduler.flush_cache does when idle
    return True

runner = SimpleNamespace(weight_updater=SimpleNamespace(
    update_weights_from_disk=lambda *a, **k: (True, "ok"), update_weights_from_tensor=lambda **k: (True, "ok")))
tp_worker = SimpleNamespace(weight_update_runners=lambda: [("target", runner)], deserialize_own_rank=lambda s: [])
# A TP group of one rank: the tensor handler waits on it for its peers.
dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/group", rank=0, world_size=1)
manager = SchedulerWeightUpdaterManager.__new__(SchedulerWeightUpdaterManager)
for name, value in dict(tp_worker=tp_worker, draft_worker=None, memory_saver_adapter=None, flush_cache=flush,
        is_fully_idle=lambda **k: True, scheduler=SimpleNamespace(record_weight_version_change=lambda **k: None),
        metrics_collector=None, offload_tags=set(), stashed_model_static_state=None, _session=None,
        tp_cpu_group=dist.group.WORLD).items():
    setattr(manager, name, value)

with published_server_args(radix_cache_backend="kvplug") as args:
    stack = build_stack(args, ModelConfig(sys.argv[1]))
    tokens = list(range(100, 149))
    serve_request(stack, "old", tokens, seed=1)
    stack.tree.evict(EvictParams(num_tokens=10_000))
    before = serve_request(stack, "again", tokens, seed=2).promised
    stack.tree.evict(EvictParams(num_tokens=10_000))
    if sys.argv[2] == "disk":
        done = manager.update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path=sys.argv[1] + "-step1"))
    else:
        manager._session = _WeightUpdateSession(selector="all")
        done = manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(serialized_named_tensors=[]))
    assert done.success, done.message
    after = serve_request(stack, "new", tokens, seed=3).promised
    stack.tree.evict(EvictParams(num_tokens=10_000))
    again = serve_request(stack, "new-again", tokens, seed=4).promised
    stack.tree.shutdown()
# (0.2.0's first releases had no generation: "", so the hits above tell what failed)
print("SEEN " + json.dumps([before, after, again, getattr(page_identity, "weights_generation", str)()]))
"""


def _run(model: Path, kind: str) -> list:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        "KVPLUG_CHUNK_SIZE": "16",
        "KVPLUG_STORE__QUEUE__MODE": "sync",
        "KVPLUG_TIERS": '[{"type": "cpu"}]',
    }
    done = subprocess.run(
        [sys.executable, "-c", UPDATE, str(model), kind], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("SEEN ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("SEEN ") :])


def test_weights_updated_from_disk_never_load_the_old_weights_kv(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "tiny")
    before, after, again, generation = _run(model, "disk")
    assert before == 48  # the old weights' chunks hit before the update
    assert after == 0, "after update_weights_from_disk the old weights' KV was loaded as a hit"
    assert again == 48  # the new weights' chunks hit under the new weights
    # Another rank (or server) updated from the same path in the same order keys alike.
    assert _run(model, "disk")[3] == generation != ""


def test_weights_updated_from_tensors_never_load_the_old_weights_kv(tmp_path: Path) -> None:
    model = write_model_dir(tmp_path / "tiny")
    before, after, again, generation = _run(model, "tensor")
    assert (before, after, again) == (48, 0, 48), "after update_weights_from_tensor the old weights' KV was a hit"
    assert _run(model, "tensor")[3] != generation, "weights sent as tensors are named by nothing: this process's own"


def test_hicache_pages_of_weights_updated_in_place_are_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    # HiCache names a page by SGLang's hash of its tokens; SGLang's flush after an update
    # leaves the storage backend's pages, so keyed alike they were the new weights' hits.
    monkeypatch.setattr(page_identity, "_weights_generation", "")
    host = make_host("page_first")
    backend = make_backend(host, {"tiers": [{"type": "cpu"}]})
    keys = page_keys(list(range(60, 60 + 2 * PAGE)))
    backend.batch_set_v1(keys, random_pages(host, 2, seed=4))
    assert backend.batch_exists(keys) == 2
    # What SGLang's scheduler calls first on update_weights_from_disk (the hook kvplug registers).
    page_identity.note_weight_update(None, UpdateWeightFromDiskReqInput(model_path="/ckpt/step-1"))
    assert backend.batch_exists(keys) == 0, "HiCache served the old weights' pages after an in-place update"
    backend.batch_set_v1(keys, random_pages(host, 2, seed=5))
    assert backend.batch_exists(keys) == 2
    backend.close()


def test_connector_chunks_of_weights_updated_in_place_are_misses(
    model_config: Any, pool_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(page_identity, "_weights_generation", "")
    pool = pool_factory()
    connector = KVPlugConnector(model_config, 1, 0, pool.k_buffer, pool.v_buffer, engine_extra=kvplug_extra())
    tokens = list(range(300, 364))
    src = torch.arange(1, 65)
    fill_random(pool, src)
    connector.store_kv(StoreMetadata(last_node=None, token_ids=tokens, kv_indices=src, offset=0))
    assert connector.lookup(tokens) == 64
    page_identity.note_weight_update(None, UpdateWeightFromDiskReqInput(model_path="/ckpt/step-1"))
    assert connector.lookup(tokens) == 0, "the connector found the old weights' chunks after an in-place update"
    connector.store_kv(StoreMetadata(last_node=None, token_ids=tokens, kv_indices=src, offset=0))
    assert connector.lookup(tokens) == 64
    connector.close()
