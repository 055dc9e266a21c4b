"""KVPlugStorage next to other ranks and servers: DCP and attention-CP shards, and tiers shared with another server."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang_flow import published_server_args
from test_sglang_hicache import PAGE, make_backend, make_host, page_keys, random_pages

from kvplug_sglang.hicache import KVPlugStorage


def make_dcp_mla_host(dcp_rank: int, dcp_size: int = 2) -> Any:
    """An MLA host pool of one decode-context-parallel rank: it holds ``PAGE`` of each
    logical page's ``PAGE * dcp_size`` tokens, addressed by logical indices."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device = MLATokenToKVPool(
        size=64,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE * dcp_size,
        "layer_first",
        pin_memory=False,
        device="cpu",
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        device_capacity_tokens=device.size * dcp_size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        target_layer_num=2,
    )


def test_dcp_shards_are_kept_apart(tmp_path: Path) -> None:
    """Under DCP each shard writer stores its own tokens of a page under SGLang's same key:
    a rank reads back its own shard, never another's, and pages are a logical page apart."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    tiers = [{"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}]
    hosts, backends = [], []
    for rank in range(2):
        host = make_dcp_mla_host(rank)
        config = HiCacheStorageConfig(
            tp_rank=rank,
            tp_size=2,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=True,
            enable_storage_metrics=False,
            is_page_first_layout=False,
            model_name="tiny-mla",
            dcp_size=2,
            dcp_rank=rank,
            logical_page_size=2 * PAGE,
            extra_config={"kvplug": {"tiers": tiers}},
        )
        backend = KVPlugStorage(config)
        backend.register_mem_pool_host(host)
        hosts.append(host)
        backends.append(backend)
    keys = ["page-a", "page-b"]
    written = []
    for rank, (host, backend) in enumerate(zip(hosts, backends)):
        src = host.alloc(2 * host.logical_page_size)
        for page, start in enumerate((0, host.logical_page_size)):
            host.get_data_page(int(src[start]), flat=False).fill_(10 * rank + page + 1)
        written.append([host.get_data_page(int(src[s])).clone() for s in (0, host.logical_page_size)])
        assert backend.batch_set_v1(keys, src) == [True, True]
    for rank, (host, backend) in enumerate(zip(hosts, backends)):
        dst = host.alloc(2 * host.logical_page_size)
        assert backend.batch_get_v1(keys, dst) == [True, True]
        read = [host.get_data_page(int(dst[s])) for s in (0, host.logical_page_size)]
        assert all(torch.equal(a, b) for a, b in zip(written[rank], read)), f"rank {rank} read another shard"
        backend.close()


def attention_dp_cp_backends(host: Any, kvplug: dict[str, Any]) -> list[KVPlugStorage]:
    """The HiCache backends of the four ranks of ``--tp 4 --attention-data-parallel-size 2
    --attention-context-parallel-size 2``, each under the ranks SGLang's launcher gives that
    scheduler (its real runtime context), with the storage config SGLang's cache controller
    builds from them (``HiCacheController._generate_storage_config``; the attention-CP group,
    a torch.distributed group, is the one thing stood in for: its rank and size as published)."""
    from sglang.srt.layers.dp_attention import compute_dp_attention_world_info, initialize_dp_attention_flags
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.runtime_context import get_parallel

    backends = []
    for tp_rank in range(4):
        _, _, attn_dp_rank, _ = compute_dp_attention_world_info(tp_rank, 4, 2, 2)  # the launcher's dp_rank
        with published_server_args(
            world_rank=tp_rank, dp_rank=attn_dp_rank, tp_size=4, attn_dp_size=2, attn_cp_size=2
        ) as args:
            initialize_dp_attention_flags(args)
            cp = (get_parallel().attn_cp_rank, get_parallel().attn_cp_size)
            controller = SimpleNamespace(
                mem_pool_device=None,
                mem_pool_host=host,
                storage_host_pool=host,
                enable_storage_metrics=False,
                page_size=PAGE,
                get_attn_cp_rank_and_size=lambda cp=cp: cp,
            )
            config = HiCacheController._generate_storage_config(
                controller, "tiny-llama", {"backend_name": "kvplug", "kvplug": kvplug}
            )
            backend = KVPlugStorage(config)
            backend.register_mem_pool_host(host)
            backends.append(backend)
    return backends


def test_attention_cp_peers_never_read_each_others_pages(tmp_path: Path) -> None:
    """Under attention DP SGLang hands both attention-CP peers of a group tp_rank 0, and CP
    ranks may hold different slices of a page (NSA context parallel) under SGLang's same page
    key: each peer reads back its own page, never its peer's; the same CP rank of another DP
    group (the same heads and slice) shares it."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    host = make_host("layer_first")
    tiers = [{"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}]
    backends = attention_dp_cp_backends(host, {"tiers": tiers})  # dp0/cp0, dp0/cp1, dp1/cp0, dp1/cp1
    keys = page_keys(list(range(500, 500 + PAGE)))
    try:
        written = []
        for fill, backend in ((1.0, backends[0]), (2.0, backends[1])):
            src = host.alloc(PAGE)
            host.get_data_page(int(src[0]), flat=False).fill_(fill)
            written.append(host.get_data_page(int(src[0])).clone())
            assert backend.batch_set_v1(keys, src) == [True]
        for reader, expected in zip(backends, written + written):
            dst = host.alloc(PAGE)
            assert reader.batch_get_v1(keys, dst) == [True]
            assert torch.equal(host.get_data_page(int(dst[0])), expected), "a CP peer read another slice"
    finally:
        for backend in backends:
            backend.close()


def test_clear_leaves_pages_another_server_wrote(tmp_path: Path) -> None:
    """SGLang's ``clear`` removes the pages this backend wrote; a page a shared tier already
    held when it stored it is the other server's and stays."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    kvplug = {"tiers": [{"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}]}
    host = make_host("layer_first")
    other, backend = make_backend(host, kvplug), make_backend(host, kvplug)
    keys = page_keys(list(range(300, 300 + 3 * PAGE)))
    src = random_pages(host, 3, seed=8)
    assert other.batch_set_v1(keys[:2], src[: 2 * PAGE]) == [True, True]
    assert backend.batch_set_v1(keys, src) == [True, True, True]  # only the third page is its own write
    backend.clear()
    assert other.batch_exists(keys) == 2, "the other server's pages stay"
    assert backend.store is not None and backend.store.contains_prefix([backend.storage_key(keys[2])]) == 0
    other.close()
    backend.close()


def test_kvplug_ctl_lookup_names_the_tier_holding_each_page_of_two_of_one_type(
    tmp_path: Path, socket_dir: Path
) -> None:
    """Of two disk folders, a page only the second holds is located there (``1:disk``), as the
    per-tier metrics name it: not in the first tier of its type."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    from kvplug.core.control.client import ask

    folders = [{"type": "disk", "path": str(tmp_path / name), "queue": {"mode": "sync"}} for name in ("a", "b")]
    host = make_host("layer_first")
    second_only, backend = make_backend(host, {"tiers": folders[1:]}), make_backend(host, {"tiers": folders})
    tokens = list(range(500, 500 + 3 * PAGE))
    keys = page_keys(tokens)
    src = random_pages(host, 3, seed=9)
    try:
        assert backend.batch_set_v1(keys[:1], src[:PAGE]) == [True]  # both folders
        assert second_only.batch_set_v1(keys[1:], src[PAGE:]) == [True, True]
        assert backend.control is not None
        reply = ask(backend.control.path, "lookup", tokens=tokens)
        assert [row[4] for row in reply["locations"]] == [0, 1, 1]
        assert [row[1:3] for row in reply["locations"]] == [["disk", PAGE]] * 3
    finally:
        second_only.close()
        backend.close()


def test_each_data_parallel_replica_answers_kvplug_ctl_on_its_own_socket(socket_dir: Path) -> None:
    """With --dp-size, every replica's schedulers are children of one process (one engine id):
    each replica's rank answers as its own dp rank, on its own socket."""
    from sglang.srt.runtime_context import get_parallel

    from kvplug.core.control.client import ask

    with get_parallel().override(dp_rank=1):
        backend = make_backend(make_host("layer_first"), {"tiers": [{"type": "cpu"}]})
    try:
        assert backend.control is not None
        assert ask(backend.control.path, "info")["dp_rank"] == 1
    finally:
        backend.close()


def test_each_pipeline_stage_answers_kvplug_ctl_on_its_own_socket(socket_dir: Path) -> None:
    """With --pp-size each stage's TP ranks count from 0 again under one engine id: a stage's
    rank answers on a socket of its own (it took stage 0's name before: ``kvplug ctl`` and
    clears reached one stage, the others kept their records)."""
    from sglang.srt.runtime_context import get_parallel

    from kvplug.core.control.client import ask
    from kvplug.core.control.server import control_socket_path

    backend = make_backend(make_host("layer_first"), {"tiers": [{"type": "cpu"}]}, stage=(1, 2))
    try:
        assert backend.control is not None
        info = ask(backend.control.path, "info")
        assert (info["pp_rank"], info["tp_rank"]) == (1, 0)
        assert backend.control.path == control_socket_path(info["engine_id"], 0, worker=2)  # stage 1, TP 2
    finally:
        backend.close()
    from kvplug_sglang.control import pipeline_stage

    with get_parallel().override(pp_rank=1, pp_size=2):  # what the radix-cache backend reads
        assert pipeline_stage() == (1, 2)


def test_servers_of_other_weights_under_one_served_name_never_share_pages(tmp_path: Path) -> None:
    """SGLang names its model by --served-model-name (two checkpoints may share one): kvplug's
    keys name the checkpoint SGLang loaded (its model path), so neither reads the other's KV."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    from sglang.srt.runtime_context import get_context

    kvplug = {"tiers": [{"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}]}
    host = make_host("layer_first")
    keys = page_keys(list(range(400, 400 + 2 * PAGE)))
    backends = []
    for checkpoint in ("/models/llama-v1", "/models/llama-v2"):
        with get_context().override_server_args(model_path=checkpoint, served_model_name="llama"):
            backends.append(make_backend(host, kvplug, model="llama"))
    old, new = backends
    assert old.batch_set_v1(keys, random_pages(host, 2, seed=9)) == [True, True]
    assert old.batch_exists(keys) == 2 and new.batch_exists(keys) == 0
    assert new.target is not None and new.target.describe()["model"] == "/models/llama-v2"
    for backend in backends:
        backend.close()


def test_servers_of_other_fp8_kv_caches_never_share_pages(tmp_path: Path) -> None:
    """SGLang keeps an fp8 KV cache in uint8 pages, e4m3 or e5m2 alike: the pages' dtype does not
    tell them apart, the server's --kv-cache-dtype does, and its --quantization-param-path (the
    KV scales the bytes were scaled by)."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    from sglang.srt.runtime_context import get_context

    kvplug = {"tiers": [{"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}]}
    host = make_host("layer_first", dtype=torch.float8_e4m3fn)
    assert host.dtype == torch.uint8
    keys = page_keys(list(range(650, 650 + 2 * PAGE)))
    backends = []
    for kv_cache_dtype, scales in (
        ("fp8_e4m3", None),
        ("fp8_e5m2", None),
        ("fp8_e4m3", "/models/llama/kv_scales.json"),
    ):
        with get_context().override_server_args(
            model_path="/models/llama", kv_cache_dtype=kv_cache_dtype, quantization_param_path=scales
        ):
            backends.append(make_backend(host, kvplug, model="llama"))
    try:
        writer, *others = backends
        assert writer.batch_set_v1(keys, random_pages(host, 2, seed=11)) == [True, True]
        assert writer.batch_exists(keys) == 2
        assert [other.batch_exists(keys) for other in others] == [0, 0], "a server read another fp8 cache's pages"
    finally:
        for backend in backends:
            backend.close()


def test_a_kv_scales_file_is_named_by_its_content(tmp_path: Path) -> None:
    """SGLang scales an fp8_e4m3 KV cache by what the --quantization-param-path file says when
    it loads: servers whose files at one path differ (another machine, the file rewritten between
    starts) never read each other's pages; one file copied to another path is the same scales."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    from sglang.srt.runtime_context import get_context

    kvplug = {"tiers": [{"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}]}
    host = make_host("layer_first", dtype=torch.float8_e4m3fn)
    keys = page_keys(list(range(670, 670 + 2 * PAGE)))
    scales, copy = tmp_path / "kv_scales.json", tmp_path / "copy" / "kv_scales.json"
    copy.parent.mkdir()

    def backend_with(path: Path, content: str | None) -> KVPlugStorage:
        if content is not None:
            path.write_text(content)
        with get_context().override_server_args(
            model_path="/models/llama", kv_cache_dtype="fp8_e4m3", quantization_param_path=str(path)
        ):
            return make_backend(host, kvplug, model="llama")

    writer = backend_with(scales, '{"kv_cache": {"scaling_factor": {"0": {"0": 0.5}}}}')
    rewritten = backend_with(scales, '{"kv_cache": {"scaling_factor": {"0": {"0": 2.0}}}}')
    copied = backend_with(copy, '{"kv_cache": {"scaling_factor": {"0": {"0": 0.5}}}}')
    # A file gone when the backend reads it: whether SGLang scaled by it or by its defaults is unknown.
    gone = [backend_with(tmp_path / "gone.json", None) for _ in range(2)]
    try:
        assert writer.batch_set_v1(keys, random_pages(host, 2, seed=13)) == [True, True]
        assert rewritten.batch_exists(keys) == 0, "a server read pages scaled by another file at its path"
        assert copied.batch_exists(keys) == 2, "one scales file at another path is the same scales"
        assert gone[0].batch_set_v1(keys, random_pages(host, 2, seed=14)) == [True, True]
        assert gone[1].batch_exists(keys) == 0, "servers whose scales file could not be read shared pages"
    finally:
        for backend in (writer, rewritten, copied, *gone):
            backend.close()


def test_a_stage_never_reads_pages_of_other_layers(tmp_path: Path) -> None:
    """Two servers' second pipeline stages hold as many layers each, but other ones (another
    SGLANG_PP_LAYER_PARTITION: layers 2-5 and 3-6 of a 3-stage split): neither reads the
    other's pages, though SGLang names the pages of one prompt alike."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    kvplug = {"tiers": [{"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}]}
    keys = page_keys(list(range(600, 600 + 2 * PAGE)))
    first_host, other_host = make_host("layer_first", first_layer=2), make_host("layer_first", first_layer=3)
    first, other = make_backend(first_host, kvplug, stage=(1, 3)), make_backend(other_host, kvplug, stage=(1, 3))
    try:
        assert first.batch_set_v1(keys, random_pages(first_host, 2, seed=10)) == [True, True]
        assert first.batch_exists(keys) == 2
        assert other.batch_exists(keys) == 0, "a stage read the pages of other layers"
    finally:
        first.close()
        other.close()


@pytest.mark.parametrize("owner", ["none", "sglang"])
def test_a_normal_exit_writes_the_queued_pages_and_removes_the_control_socket(
    socket_dir: Path, tmp_path: Path, owner: str
) -> None:
    """A storage backend whose owner never closes it (SGLang's decode-side KV offload manager;
    only its HiCache tree closes one at exit): the backend closes itself at a normal exit,
    so the pages queued for an async tier are written and the control socket file goes.
    Under an owner that closes it at exit, the owner's hook runs first."""
    import json
    import os
    import subprocess
    import sys

    l3 = tmp_path / "l3"
    child = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "sglang_hicache_exit.py"), str(l3), owner],
        env={**os.environ, "KVPLUG_LOOKUP_DIR": str(socket_dir)},
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    reported = json.loads(child.stdout.strip().splitlines()[-1])
    assert Path(reported["socket"]).parent == socket_dir
    assert not Path(reported["socket"]).exists(), "the control socket file was left behind"
    if owner == "sglang":
        assert (l3 / "owner-found").read_text() == "open", "kvplug closed the backend before its owner's exit hook"
    backend = make_backend(make_host("layer_first"), {"tiers": [{"type": "disk", "path": str(l3)}]})
    try:
        assert backend.batch_exists(reported["keys"]) == len(reported["keys"]), "queued pages were lost at exit"
    finally:
        backend.close()


def test_servers_of_other_weights_never_share_pages(tmp_path: Path) -> None:
    """One checkpoint run with its weights quantized (--quantization) or its config overridden
    (--json-model-override-args, e.g. rope_theta: other rotated keys) computes other KV: its
    pages are another server's misses; a server run alike reads them."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    from sglang.srt.runtime_context import get_context

    kvplug = {"tiers": [{"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}]}
    host = make_host("layer_first")
    keys = page_keys(list(range(690, 690 + 2 * PAGE)))
    backends = []
    for server_args in (
        {},
        {},
        {"quantization": "fp8"},
        {"json_model_override_args": '{"rope_theta": 1000.0}'},
        {"json_model_override_args": '{"rope_theta": 2000.0}'},
    ):
        with get_context().override_server_args(model_path="/models/llama", **server_args):
            backends.append(make_backend(host, kvplug, model="llama"))
    try:
        writer, alike, *others = backends
        assert writer.batch_set_v1(keys, random_pages(host, 2, seed=17)) == [True, True]
        assert alike.batch_exists(keys) == 2
        assert [other.batch_exists(keys) for other in others] == [0, 0, 0], "a server read another's weights' pages"
        assert others[1].batch_set_v1(keys, random_pages(host, 2, seed=18)) == [True, True]
        assert others[2].batch_exists(keys) == 0, "servers of other config overrides shared pages"
    finally:
        for backend in backends:
            backend.close()
