"""The connector's parts that need no running engine and no CacheEngine: registration, settings,
stats, the KV cache groups it refuses and the MLA layout (with vLLM's own classes where they exist)."""

from __future__ import annotations

from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvplug
from kvplug import (
    CacheEngine,
    Fingerprint,
    KVLayout,
    load_config,
    slots_from_block_ids,
)
from kvplug.errors import ConfigError, LayoutError
from kvplug_vllm.layout import VLLM_CPU, VLLM_CPU_MLA, VLLM_MLA, detect_layout
from kvplug_vllm.registration import CONNECTOR_NAME, register
from kvplug_vllm.settings import request_overrides, split_extra_config


def test_vllm_entry_point_registers_the_connector_once() -> None:
    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("kvplug_vllm")]
    assert entry.load() is register
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    register()  # vLLM calls general plugins once per process, more than once in tests
    config = SimpleNamespace(kv_connector=CONNECTOR_NAME, kv_connector_module_path=None)
    from kvplug_vllm.connector import KVPlugConnector

    assert KVConnectorFactory.get_connector_class(config) is KVPlugConnector


def test_kvplug_lists_the_vllm_engine_adapter() -> None:
    adapters = kvplug.get_registry().engine_adapters()
    assert adapters["vllm"].engine_version() == "0.32.0"


def test_the_lookup_folder_variable_is_not_an_unknown_setting() -> None:
    # vLLM's engine processes inherit KVPLUG_LOOKUP_DIR from the adapter; the adapter
    # declares it, so the config loader does not take it for a misspelled setting.
    load_config(env={"KVPLUG_LOOKUP_DIR": "/run/user/0/kvplug"})
    with pytest.raises(ConfigError, match="KVPLUG_LOOKUP_DIRS"):
        load_config(env={"KVPLUG_LOOKUP_DIRS": "/run/user/0/kvplug"})


def test_extra_config_split_between_connector_and_core() -> None:
    settings, rest = split_extra_config(
        {
            "kvplug.layerwise": True,
            "kvplug.chunk_size": 128,
            "kvplug": {"skip_last_n_tokens": 3, "hash": "xxh3_128"},
            "kvplug.config": "kvplug.yaml",
            "other": 1,
        }
    )
    assert settings.layerwise and settings.skip_last_n_tokens == 3
    assert rest == {
        "kvplug.chunk_size": 128,
        "kvplug": {"hash": "xxh3_128"},
        "kvplug.config": "kvplug.yaml",
        "other": 1,
    }
    rest.pop("kvplug.config")
    config = load_config(engine_extra=rest, env={}).config
    assert (config.chunk_size, config.hash) == (128, "xxh3_128")


def test_bad_connector_setting_names_the_key() -> None:
    with pytest.raises(ConfigError, match="kvplug.skip_last_n_tokens"):
        split_extra_config({"kvplug.skip_last_n_tokens": -1})


@pytest.mark.parametrize(
    ("extra", "path", "meant"),
    [
        ({"kvplug.layerwse": True}, "kvplug.layerwse", "layerwise"),
        ({"kvplug": {"lookup_timout_s": 2.0}}, "kvplug.lookup_timout_s", "lookup_timeout_s"),
        ({"kvplug.chunk_sise": 128}, "kvplug.chunk_sise", "chunk_size"),
        ({"kvplug.stroe.queue.mode": "sync"}, "kvplug.stroe.queue.mode", "store"),
    ],
)
def test_a_misspelled_setting_is_named_with_the_connector_and_core_names(
    extra: dict[str, object], path: str, meant: str
) -> None:
    """The core's own error listed only its fields, so a misspelled connector setting got a
    list without the setting meant."""
    with pytest.raises(ConfigError) as info:
        split_extra_config(extra)
    [problem] = info.value.problems
    assert problem.path == path and f"did you mean {meant!r}?" in problem.message, str(info.value)
    assert "layerwise" in problem.message and "chunk_size" in problem.message


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("kvplug.lookup_timeout_s", float("inf"), "less than or equal to 3600"),
        ("kvplug.lookup_timeout_s", float("nan"), "less than or equal to 3600"),
        ("kvplug.load_timeout_s", 1e12, "less than or equal to 3600"),
    ],
)
def test_connector_timeouts_are_finite_and_bounded(key: str, value: float, bound: str) -> None:
    """``lookup_timeout_s: .inf`` was accepted (a lookup that never gives up)."""
    with pytest.raises(ConfigError) as info:
        split_extra_config({key: value})
    [problem] = info.value.problems
    assert problem.path == key and bound in problem.message, str(info.value)


@pytest.mark.parametrize(
    ("old", "value", "new"),
    [
        ("lookup", "direct", "kvplug.lookup_channel"),
        ("lookups", "blocking", "kvplug.background_lookups"),
        ("load_timeout_ms", 500, "kvplug.load_timeout_s"),
    ],
)
def test_a_renamed_connector_setting_names_its_new_name(old: str, value: Any, new: str) -> None:
    for extra in ({f"kvplug.{old}": value}, {"kvplug": {old: value}}):
        with pytest.raises(ConfigError) as info:
            split_extra_config(extra)
        [problem] = info.value.problems
        assert problem.path == f"kvplug.{old}" and problem.message.startswith(f"renamed to {new!r}"), str(info.value)


def test_timeouts_are_seconds() -> None:
    settings, _ = split_extra_config({"kvplug.load_timeout_s": 0.5, "kvplug.lookup_timeout_s": 2})
    assert (settings.load_timeout_s, settings.lookup_timeout_s) == (0.5, 2.0)
    assert load_config(engine_extra={"kvplug.lookup_budget_s": 0.05}, env={}).config.lookup_budget_s == 0.05


def test_per_request_settings_are_checked() -> None:
    config = load_config(env={}).config
    assert request_overrides({"kvplug.skip_save": True, "kvplug.report": True, "other": 1}, config) == {
        "skip_save": True
    }
    with pytest.raises(ConfigError, match="chunk_size: cannot be set per request"):
        request_overrides({"kvplug.chunk_size": 8}, config)


def test_connector_stats_aggregate_and_rebuild() -> None:
    from kvplug_vllm.connector import KVPlugConnector
    from kvplug_vllm.stats import KVPlugConnectorStats

    worker = KVPlugConnectorStats()
    worker.add(loaded_tokens=64, load_error_blocks=2)
    scheduler = KVPlugConnectorStats()
    scheduler.add(lookups=2, lookup_tokens=400, hit_tokens=100)
    assert KVPlugConnectorStats().is_empty() and not worker.is_empty()
    rebuilt = KVPlugConnector.build_kv_connector_stats(worker.aggregate(scheduler).to_dict())
    reduced = rebuilt.reduce()
    assert (reduced["loaded_tokens"], reduced["lookups"], reduced["load_error_blocks"]) == (64, 2, 2)
    assert reduced["hit_rate"] == 0.25
    rebuilt.reset()
    assert rebuilt.is_empty()


# --- KV cache groups kvplug refuses at start-up ------------------------------------------


def kv_cache_config(*specs: object) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_kv_cache_groups_kvplug_cannot_key_are_refused_naming_the_model() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvplug_vllm.kv_groups import check_kv_cache_groups

    model = SimpleNamespace(model_config=SimpleNamespace(model="org/hybrid-ssm"))
    full = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16, sliding_window=16)
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    check_kv_cache_groups(model, kv_cache_config(full))  # one group of attention KV: served
    check_kv_cache_groups(model, kv_cache_config(window))  # every layer sliding: served (test_hybrid.py)
    served = check_kv_cache_groups(model, kv_cache_config(window, full))  # vLLM's hybrid allocator: served
    assert [g.describe(2) for g in served] == ["kv_group=0/2:sliding16", "kv_group=1/2:full"]
    refused = r"'org/hybrid-ssm': KV cache group 1 of 2 \(FullAttentionSpec, MambaSpec\) is a MambaSpec group: it holds"
    with pytest.raises(kvplug.errors.UnsupportedModelError, match=refused):
        check_kv_cache_groups(model, kv_cache_config(full, mamba))
    with pytest.raises(kvplug.errors.UnsupportedModelError, match=r"'org/hybrid-ssm'.*MambaSpec group: it holds"):
        check_kv_cache_groups(model, kv_cache_config(mamba))


# --- MLA on vLLM's CPU backend ------------------------------------------------------------


def mla_config(use_mla: bool) -> SimpleNamespace:
    """The parts of a VllmConfig ``detect_layout`` reads, for a DeepSeek-V2 style model."""
    model = SimpleNamespace(use_mla=use_mla, get_num_kv_heads=lambda _: 1, get_head_size=lambda: 576)
    return SimpleNamespace(model_config=model, parallel_config=SimpleNamespace())


def test_vllm_cpu_mla_cache_is_detected_only_for_an_mla_model() -> None:
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(8, 1, 16, 576, dtype=torch.bfloat16) for i in range(2)}
    layout = detect_layout(caches, mla_config(True))
    assert layout.format == VLLM_CPU_MLA and layout.num_kv == 1
    assert (layout.block_size, layout.num_kv_heads, layout.head_dim) == (16, 1, 576)
    with pytest.raises(LayoutError, match=r"\(8, 1, 16, 576\).*MLA model: False"):
        detect_layout(caches, mla_config(False))
    # another format's chunks of the same sizes are keyed apart: a miss, never misread
    texts = {KVLayout(f, 2, 16, 1, 576, torch.bfloat16).describe() for f in (VLLM_CPU_MLA, VLLM_MLA)}
    texts.add(KVLayout(VLLM_CPU, 2, 16, 1, 288, torch.bfloat16).describe())
    assert len(texts) == 3


@pytest.mark.parametrize("connector", ["torch", "native"])
def test_vllm_cpu_mla_latent_rows_round_trip_bit_exactly(connector: str) -> None:
    layout = KVLayout(VLLM_CPU_MLA, num_layers=2, block_size=16, num_kv_heads=1, head_dim=576, dtype=torch.bfloat16)
    extra = {"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync", "kvplug.connector": {"type": connector}}
    config = load_config(engine_extra=extra, env={}).config
    generator = torch.Generator().manual_seed(3)
    # random bytes (NaN patterns too) in vLLM's shape; the target starts as zeros
    source = [torch.randint(0, 2**16, (12, 1, 16, 576), generator=generator, dtype=torch.int32)
              .to(torch.int16).view(torch.bfloat16) for _ in range(2)]  # fmt: skip
    target = [torch.zeros_like(t) for t in source]
    tokens = list(range(100, 196))  # 96 tokens: one whole chunk and a half
    src_slots = slots_from_block_ids([5, 2, 9, 0, 7, 11], 16, 96)
    dst_slots = slots_from_block_ids([1, 10, 3, 8, 4, 6], 16, 96)
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="unit")) as cache_engine:
        assert type(cache_engine.connector).__name__.lower().startswith(connector)
        assert cache_engine.store(tokens, source, src_slots) == 64
        assert cache_engine.retrieve(tokens[:64], target, dst_slots[:64]).all()
    for src, dst in zip(source, target):
        # vLLM's CPU MLA backends address a token's latent row as cache.view(-1, 576)[slot]
        src_rows, dst_rows = src.view(-1, 576).view(torch.int16), dst.view(-1, 576).view(torch.int16)
        assert torch.equal(dst_rows[dst_slots[:64]], src_rows[src_slots[:64]])
        untouched = torch.ones(dst_rows.shape[0], dtype=torch.bool)
        untouched[dst_slots[:64]] = False
        assert not dst_rows[untouched].any(), "a row outside the loaded slots was written"


def test_a_connector_setting_given_both_ways_takes_the_dotted_key_in_any_order() -> None:
    """The nested mapping's value won when it came after the dotted key: the order of the
    engine's keys chose; as for the core's settings, kvplug.<setting> wins."""
    for extra in (
        {"kvplug.load": "sync", "kvplug": {"load": "async"}},
        {"kvplug": {"load": "async"}, "kvplug.load": "sync"},
    ):
        settings, _ = split_extra_config(extra)
        assert settings.load == "sync", extra


def test_extra_config_keys_that_are_not_text_belong_to_other_connectors() -> None:
    # `key.startswith` on an int key: AttributeError from vLLM's create_engine_config.
    settings, rest = split_extra_config({7: "theirs", "kvplug.load": "sync"})
    assert settings.load == "sync" and rest == {7: "theirs"}


# --- what a checkpoint's keys name --------------------------------------------------------


def checkpoint_fingerprint(model: str, cache_dtype: str = "auto", **fields: Any) -> Fingerprint:
    """The fingerprint of a flash-layout cache of vLLM's real ModelConfig of ``model`` run with ``fields``."""
    from vllm.config import ModelConfig

    from kvplug_vllm.layout import VLLM_FLASH, fingerprint_for

    dtype = torch.uint8 if cache_dtype.startswith("fp8") else torch.bfloat16
    layout = KVLayout(VLLM_FLASH, num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=dtype)
    engine = SimpleNamespace(
        model_config=ModelConfig(model=model, **{"dtype": "bfloat16", **fields}),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )
    return fingerprint_for(layout, engine, tp_rank=0, pp_rank=0)


@pytest.mark.parametrize(
    "changed", [{"quantization": "fp8"}, {"hf_overrides": {"rope_theta": 1000.0}}], ids=["quantized", "overridden"]
)
def test_a_checkpoint_run_quantized_or_overridden_is_keyed_apart(tiny_model: str, changed: dict[str, Any]) -> None:
    # One model id and revision computes other KV with its weights quantized or its config
    # overridden (rope_theta rotates every key otherwise): on a shared tier a server run so
    # must miss the chunks of one run without, not load them as its own.
    def key_prefix(**fields: Any) -> str:
        return checkpoint_fingerprint(tiny_model, **fields).key_prefix()

    plain = key_prefix()
    assert key_prefix(**changed) != plain, f"{changed} keyed like the plain checkpoint"
    assert key_prefix(**changed) == key_prefix(**changed) and key_prefix() == plain  # and stable


def test_an_fp8_cache_of_a_model_of_another_dtype_is_keyed_apart(tiny_model: str) -> None:
    # An fp8 cache holds the KV the model computed in its own dtype, cast: a float16 and a
    # bfloat16 run of one checkpoint write other bytes into caches of one dtype (uint8).
    fp16, bf16 = (checkpoint_fingerprint(tiny_model, "fp8", dtype=d) for d in ("float16", "bfloat16"))
    assert fp16.key_prefix() != bf16.key_prefix(), "fp8 caches of float16 and bfloat16 runs keyed alike"
    # with an "auto" cache the cache's dtype (in the key already) is the model's: keys as before
    assert checkpoint_fingerprint(tiny_model).engine_variant == "kv_cache_dtype=auto"


@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel_size": 2, "decode_context_parallel_size": 2}, {"prefill_context_parallel_size": 2}],
    ids=["dcp", "pcp"],
)
def test_context_parallelism_is_refused_naming_it(parallel: dict[str, int]) -> None:
    # A decode-context-parallel rank's block holds every dcp-th token of a scheduler's block:
    # stored and loaded as whole blocks of its own tokens, it would serve other tokens' KV.
    from vllm.config import ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from kvplug_vllm.kv_groups import check_kv_cache_groups

    full = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    model = SimpleNamespace(model_config=SimpleNamespace(model="org/llm"), parallel_config=ParallelConfig())
    assert len(check_kv_cache_groups(model, kv_cache_config(full))) == 1  # no context parallelism: served
    model.parallel_config = ParallelConfig(**parallel)
    named = next(f"{name}=2" for name in parallel if "context" in name)
    with pytest.raises(kvplug.errors.UnsupportedModelError, match=rf"'org/llm' with {named}: context parallelism"):
        check_kv_cache_groups(model, kv_cache_config(full))
