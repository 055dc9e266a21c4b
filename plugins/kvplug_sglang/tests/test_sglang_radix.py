"""Radix-cache backend ``kvplug`` built by SGLang's registry, driven like the scheduler."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.registry import get_radix_cache_factory
from sglang_flow import build_stack, published_server_args, serve_request
from sglang_pools import snapshot, write_model_dir

from kvplug_cpu import CPUTier
from kvplug_sglang.hicache import KVPlugStorage
from kvplug_sglang.radix_cache import KVPlugRadixCache

HERE = Path(__file__).parent

pytestmark = pytest.mark.usefixtures("registered")


def test_unknown_backend_is_refused_and_ours_is_known(model_config) -> None:
    assert get_radix_cache_factory("kvplug") is not None
    with (
        published_server_args(radix_cache_backend="kvplug-typo") as args,
        pytest.raises(ValueError, match="is not registered"),
    ):
        build_stack(args, model_config)


@pytest.mark.parametrize(
    ("kind", "named"),
    [("is_hybrid_ssm", "hybrid SSM (mamba) models"), ("is_hybrid_swa", "hybrid SWA models"), ("is_dsa", "DSA models")],
)
def test_hybrid_and_dsa_pools_are_refused_naming_the_kind(model_config, kvplug_env, kind: str, named: str) -> None:
    with (
        published_server_args(radix_cache_backend="kvplug") as args,
        pytest.raises(ValueError, match=rf"--radix-cache-backend kvplug does not support {re.escape(named)}"),
    ):
        build_stack(args, model_config, **{kind: True})


def test_pipeline_stages_are_refused_naming_the_backend_that_serves_them(model_config, kvplug_env) -> None:
    # (why: test_sglang_pipeline.py; the same refusal on a real server)
    with (
        published_server_args(radix_cache_backend="kvplug", pp_size=2) as args,
        pytest.raises(
            ValueError, match=r"does not support pipeline parallelism .*kvplug_sglang\.hicache\.KVPlugStorage"
        ) as refused,
    ):
        build_stack(args, model_config)
    # The flags it names start the backend that serves stages: SGLang's dynamic backend loads that class.
    extra = json.loads(re.search(r"--hicache-storage-backend-extra-config '([^']+)'", str(refused.value))[1])
    assert "--enable-hierarchical-cache --hicache-storage-backend dynamic" in str(refused.value)
    loaded = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    assert (loaded, extra["backend_name"], extra["interface_v1"]) == (KVPlugStorage, "kvplug", 1)


@pytest.mark.parametrize("page_size", [1, 4])
def test_evicted_prefix_comes_back_from_kvplug(model_config, kvplug_env, page_size: int) -> None:
    with published_server_args(radix_cache_backend="kvplug") as args:
        stack = build_stack(args, model_config, page_size=page_size)
        assert isinstance(stack.tree, KVPlugRadixCache)
        start = stack.allocator.available_size()
        tokens = list(range(100, 149))  # 49 tokens: 3 chunks fit under the 48-token match limit
        first = serve_request(stack, "a", tokens, seed=1)
        assert (first.device_hit, first.promised) == (0, 0)
        assert stack.tree.evict(EvictParams(num_tokens=10_000)).num_tokens_evicted > 0
        assert stack.allocator.available_size() == start, "eviction must return every slot"
        second = serve_request(stack, "b", tokens, seed=2)
        assert (second.device_hit, second.promised, second.loaded) == (0, 48, 48)
        for (k1, v1), (k2, v2) in zip(first.kv, second.kv):
            assert torch.equal(k1[:48], k2[:48]) and torch.equal(v1[:48], v2[:48]), "loaded KV must be bit-exact"
        # a third request now hits on device: nothing more to load
        third = serve_request(stack, "c", tokens, seed=3)
        assert (third.device_hit, third.promised) == (48, 0)
        stack.tree.evict(EvictParams(num_tokens=10_000))
        assert stack.allocator.available_size() == start, "no slot leaked or freed twice"
        stack.tree.shutdown()


def test_corrupt_chunk_between_match_and_load_loads_nothing(
    model_config, kvplug_env, monkeypatch: pytest.MonkeyPatch
) -> None:

    # The cpu tier's own frames are not re-verified (trusted_reads: this process's bytes);
    # as an in-memory tier another process could write, its frames are.
    monkeypatch.setattr(CPUTier, "trusted_reads", False)
    with published_server_args(radix_cache_backend="kvplug") as args:
        stack = build_stack(args, model_config)
        start = stack.allocator.available_size()
        tokens = list(range(7, 56))
        serve_request(stack, "a", tokens, seed=4)
        stack.tree.evict(EvictParams(num_tokens=10_000))
        engine = stack.tree.engine
        victim = engine.chunk_keys(tokens)[1].key

        def corrupt() -> None:
            tier = engine.chain.tiers[0]
            frame = bytearray(tier.get([victim])[0])
            frame[200] ^= 0x10
            tier.put([(victim, bytes(frame))])

        served = serve_request(stack, "b", tokens, seed=5, before_load=corrupt)
        assert served.promised == 48 and served.loaded == 0, "all or nothing: the scheduler recomputes"
        assert stack.tree.load_failures == 1
        stack.tree.evict(EvictParams(num_tokens=10_000))
        assert stack.allocator.available_size() == start
        stack.tree.shutdown()


def test_a_load_that_must_evict_for_room_never_evicts_the_prefix_it_extends(model_config, kvplug_env) -> None:
    """The scheduler locks a request's prefix only after init_load_back: the room the load
    evicts for must not come from that prefix, whose slots would be handed out again and
    written over by the load (a hit of wrong KV, slots in the tree twice)."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    tokens = list(range(100, 149))
    with published_server_args(radix_cache_backend="kvplug") as args:
        stack = build_stack(args, model_config, size=64)
        stored = serve_request(stack, "a", tokens, seed=1)
        stack.tree.evict(EvictParams(num_tokens=10_000))
        serve_request(stack, "b", tokens[:17], seed=2)  # 16 tokens loaded from kvplug, 1 computed
        held = stack.allocator.alloc(stack.allocator.available_size() - 20)  # running requests' slots
        req = Req("c", "", array("q", tokens), SamplingParams(max_new_tokens=1))
        req.output_ids = array("q")
        req.init_next_round_input(stack.tree)
        assert (req.prefix_len, req.host_hit_length) == (17, 31)  # 31 slots needed, 20 free
        _, node = stack.tree.init_load_back(
            InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req)
        )
        path = stack.tree.path_device_indices(node)
        assert len(set(path.tolist())) == len(path), "the tree holds a slot twice"
        for (k, v), (k0, v0) in zip(snapshot(stack.pool, path[:16]), stored.kv):
            assert torch.equal(k, k0[:16]) and torch.equal(v, v0[:16]), "the prefix's KV was overwritten"
        stack.allocator.free(held)
        stack.tree.shutdown()


def test_decode_context_parallelism_is_refused(kvplug_env, tmp_path: Path) -> None:
    """Under --dcp-size each rank's pool holds only every dcp_size-th token of a page, at physical
    slots the tree's (widened) indices do not name: a chunk stored from it would not be the KV.
    A model of one KV head (replicated on every rank, so the pool's heads agree with the model's)."""
    from sglang.srt.configs.model_config import ModelConfig

    mqa = ModelConfig(str(write_model_dir(tmp_path / "mqa", num_kv_heads=1)))
    with (
        published_server_args(radix_cache_backend="kvplug", tp_size=2, dcp_size=2) as args,
        pytest.raises(ValueError, match=r"does not support decode context parallelism \(--dcp-size > 1"),
    ):
        build_stack(args, mqa, tp_size=2, heads=1).tree.shutdown()


@pytest.mark.parametrize(
    "parallel",
    [{"enable_dp_attention": True, "dp_size": 2}, {"attn_cp_size": 2}],
    ids=["dp_attention", "attention_cp"],
)
def test_a_pool_of_attention_tp_heads_starts_and_hits(model_config, kvplug_env, parallel: dict) -> None:
    """With attention DP or CP, a rank's pool holds the heads of its attention-TP rank
    (here all of them: attention TP 1 of TP 2), not of its TP rank: the backend keys and
    checks the pool by those."""
    with published_server_args(radix_cache_backend="kvplug", tp_size=2, **parallel) as args:
        stack = build_stack(args, model_config, tp_size=2)
        tokens = list(range(600, 649))
        serve_request(stack, "a", tokens, seed=1)
        stack.tree.evict(EvictParams(num_tokens=10_000))
        assert serve_request(stack, "b", tokens, seed=2).loaded == 48
        assert (stack.tree.engine.fingerprint.tp_rank, stack.tree.engine.fingerprint.tp_size) == (0, 1)
        stack.tree.shutdown()


def test_attention_dp_ranks_tell_ctl_their_place_in_their_group(
    model_config, kvplug_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With attention DP, SGLang numbers the TP ranks across the engine (0 and 1 of 2) and gives
    each group a dp_rank of its own (0 and 1): a rank says it is rank 0 of the 1 in its group,
    else ``kvplug ctl`` would expect TP ranks 0 and 1 in each dp rank and name two that do not
    exist as missing (a lookup then 0, pin and clear exit 2, on a whole engine)."""
    from kvplug.core.control.client import RankEndpoint, ask, missing_ranks

    folder = Path(tempfile.mkdtemp(prefix="kvdp-"))  # short: a socket path is ~100 bytes at most
    monkeypatch.setenv("KVPLUG_LOOKUP_DIR", str(folder))
    ranks = []
    try:
        for rank in (0, 1):
            parallel = {"tp_size": 2, "enable_dp_attention": True, "dp_size": 2}
            with published_server_args(world_rank=rank, dp_rank=rank, radix_cache_backend="kvplug", **parallel) as args:
                stack = build_stack(args, model_config, tp_size=2, tp_rank=rank)
                try:
                    path = stack.tree.control.path
                    ranks.append(RankEndpoint(path, ask(path, "info")))
                finally:
                    stack.tree.shutdown()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert [(r.name, r.info["tp_size"]) for r in ranks] == [("dp0/tp0", 1), ("dp1/tp0", 1)]
    assert missing_ranks(ranks) == []


def test_salt_isolates_requests(model_config, kvplug_env) -> None:
    with published_server_args(radix_cache_backend="kvplug") as args:
        stack = build_stack(args, model_config)
        tokens = list(range(300, 349))
        serve_request(stack, "a", tokens, seed=6)
        stack.tree.evict(EvictParams(num_tokens=10_000))
        lookup = stack.tree.engine.lookup
        from kvplug import RequestInfo

        assert lookup(tokens) == 48
        assert lookup(tokens, request=RequestInfo(cache_salt="other-tenant")) == 0
        stack.tree.shutdown()


def _lora_worker(*refs: Any) -> Any:
    """A scheduler's tp_worker as far as the tree reads it: its LoRA manager's ``lora_refs``
    (``lora_id -> LoRARef``, as ``LoRAManager.load_lora_adapter`` fills it)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        model_runner=SimpleNamespace(lora_manager=SimpleNamespace(lora_refs={r.lora_id: r for r in refs}))
    )


def test_a_lora_adapter_hits_by_its_source_across_loads_and_never_for_other_weights(
    model_config, kvplug_env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang gives an adapter loaded at runtime a fresh lora_id per load (per server): kvplug
    keys it by name and source path, so another load of the same path (a restart, another
    server) hits, and the name loaded from other weights, or from tensors, never does."""
    from sglang.srt.lora.lora_registry import LoRARef

    monkeypatch.setenv("KVPLUG_TIERS", json.dumps([{"type": "disk", "path": str(tmp_path / "kv")}]))
    tokens = list(range(400, 449))

    def serve(ref: Any, seed: int, **fields: Any) -> Any:
        with published_server_args(radix_cache_backend="kvplug") as args:
            stack = build_stack(args, model_config, tp_worker=_lora_worker(ref))
            served = serve_request(stack, ref.lora_id, tokens, seed=seed, lora_id=ref.lora_id, **fields)
            stack.tree.evict(EvictParams(num_tokens=10_000))
            stack.tree.shutdown()
            return served

    first = serve(LoRARef(lora_name="sql", lora_path="/adapters/sql-v1"), seed=1)
    assert first.promised == 0
    again = serve(LoRARef(lora_name="sql", lora_path="/adapters/sql-v1"), seed=2)  # a new load: a new lora_id
    assert (again.promised, again.loaded) == (48, 48), "the same adapter path missed under a new lora_id"
    assert all(
        torch.equal(a[0][:48], b[0][:48]) and torch.equal(a[1][:48], b[1][:48]) for a, b in zip(first.kv, again.kv)
    )
    assert serve(LoRARef(lora_name="sql", lora_path="/adapters/sql-v2"), seed=3).promised == 0, "other weights hit"
    assert serve(LoRARef(lora_name="sql", lora_path="/adapters/sql-v1"), seed=4, extra_key="t2").promised == 0
    tensors = LoRARef(lora_name="sql", lora_path="__tensor__")
    assert serve(tensors, seed=5).promised == 0
    assert serve(LoRARef(lora_name="sql", lora_path="__tensor__"), seed=6).promised == 0, "tensor adapters shared"
    assert serve(tensors, seed=7).promised == 48, "a per-load key still hits for its own load"

    # A client sets extra_key: one that spells a loaded adapter's namespace, on a request
    # without that adapter, is not keyed as the adapter (nor its evicted nodes).
    ref = LoRARef(lora_name="sql", lora_path="/adapters/sql-v1")
    with published_server_args(radix_cache_backend="kvplug") as args:
        stack = build_stack(args, model_config, tp_worker=_lora_worker(ref))
        serve_request(stack, "lora", tokens, seed=8, lora_id=ref.lora_id)
        stack.tree.evict(EvictParams(num_tokens=10_000))
        assert serve_request(stack, "spelled", tokens, seed=9, extra_key=ref.lora_id).promised == 0
        stack.tree.shutdown()


def test_new_process_gets_the_hit_from_disk(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    env = {
        **os.environ,
        "KVPLUG_CHUNK_SIZE": "16",
        "KVPLUG_TIERS": json.dumps([{"type": "cpu"}, {"type": "disk", "path": str(tmp_path / "kv")}]),
    }
    script = str(HERE / "sglang_radix_process.py")
    stored = _run(script, "store", model_dir, env)
    assert stored["promised"] == 0
    loaded = _run(script, "load", model_dir, env)
    assert (loaded["device_hit"], loaded["promised"], loaded["loaded"]) == (0, 48, 48)
    assert loaded["kv_sha256"] == stored["kv_sha256"], "KV loaded in the new process differs"
    assert loaded["available_after"] == loaded["available_before"]


def test_a_sigterm_to_the_process_group_removes_the_control_socket(model_dir: Path, socket_dir: Path) -> None:
    """A SIGTERM to a server's whole process group (systemd's default KillMode, a terminal)
    reaches its schedulers, which SGLang leaves to the default action (no exit hook runs):
    kvplug removes its control socket file first, and the process still ends by that SIGTERM."""
    env = {**os.environ, "KVPLUG_CHUNK_SIZE": "16", "KVPLUG_TIERS": json.dumps([{"type": "cpu"}])}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "sglang_radix_process.py"), "serve", str(model_dir)],
        env=env,
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        socket = Path(json.loads(proc.stdout.readline())["socket"])
        assert socket.parent == socket_dir and socket.exists()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == -signal.SIGTERM, "the process no longer ends by the SIGTERM"
        assert not socket.exists(), "the control socket file was left behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _run(script: str, mode: str, model_dir: Path, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, script, mode, str(model_dir)], env=env, cwd=HERE, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kv_digest(kv: list[tuple[torch.Tensor, torch.Tensor]], num_tokens: int) -> str:
    digest = hashlib.sha256()
    for k, v in kv:
        digest.update(k[:num_tokens].contiguous().view(torch.int16).numpy().tobytes())
        digest.update(v[:num_tokens].contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
