"""KVPlugConfig: layers in order, and errors that name the field, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplug import load_config
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError


@pytest.fixture
def load(registry: PluginRegistry):
    def load_(**kwargs):
        kwargs.setdefault("env", {})
        return load_config(registry=registry, **kwargs)

    return load_


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvplug.yaml"
    path.write_text(text)
    return path


def error_of(load, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(**kwargs)
    return info.value


# --- layers ------------------------------------------------------------------------------


def test_defaults(load) -> None:
    config = load().config
    assert (config.chunk_size, config.hash, config.serializer.type, config.connector.type) == (
        256,
        "sha256",
        "raw",
        "auto",
    )
    assert [t.type for t in config.tiers] == ["cpu"]
    assert int(config.tiers[0].options.max_bytes) == 4 * 1024**3


def test_layers_apply_in_order_and_sources_are_recorded(load, tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "chunk_size: 64\nhash: blake3\nstore: {queue: {mode: sync, max_items: 5}}\ntiers: [{type: cpu, max_bytes: 1GiB}]\n",
    )
    loaded = load(
        config_file=path,
        env={"KVPLUG_HASH": "xxh3_128", "KVPLUG_STORE__QUEUE__MAX_ITEMS": "7"},
        engine_extra={"kvplug.store.queue.max_items": 9, "other_connector_key": 1},
        request={"save_unfull_chunk": True},
    )
    config = loaded.config
    assert config.chunk_size == 64 and config.hash == "xxh3_128"
    assert config.store.queue.mode == "sync" and config.store.queue.max_items == 9
    assert config.store.queue.on_full == "block"  # the store queue's default, kept by a partial queue
    assert config.save_unfull_chunk is True
    assert int(config.tiers[0].options.max_bytes) == 1024**3
    assert loaded.sources["chunk_size"] == f"file {path}"
    assert loaded.sources["hash"] == "env"
    assert loaded.sources["store.queue.max_items"] == "engine"
    assert loaded.sources["store.queue.mode"] == f"file {path}"
    assert loaded.sources["save_unfull_chunk"] == "request"


def test_kvplug_config_env_names_the_file(load, tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 32\n")
    assert load(env={"KVPLUG_CONFIG": str(path)}).config.chunk_size == 32


def test_engine_extra_config_nested_mapping_and_config_key(load, tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 32\nhash: blake3\n")
    config = load(engine_extra={"kvplug": {"config": str(path), "chunk_size": 128}}).config
    assert (config.chunk_size, config.hash) == (128, "blake3")


def test_sizes_accept_binary_and_decimal_units(load) -> None:
    for text, expected in (("8GiB", 8 * 1024**3), ("512MB", 512 * 10**6), ("1 KiB", 1024), (4096, 4096)):
        config = load(engine_extra={"kvplug.tiers": [{"type": "cpu", "max_bytes": text}]}).config
        assert int(config.tiers[0].options.max_bytes) == expected


def test_per_request_overrides_keep_resolved_components(load) -> None:
    config = load().config
    changed = config.with_overrides({"skip_save": True})
    assert changed.skip_save and not config.skip_save
    assert changed.tiers[0].options == config.tiers[0].options


# --- errors: every one names the field ---------------------------------------------------


def test_unknown_top_level_key(load) -> None:
    error = error_of(load, engine_extra={"kvplug.chunk_sise": 3})
    assert "chunk_sise: unknown key; did you mean 'chunk_size'? allowed: " in str(error) and "chunk_size" in str(error)


def test_unknown_nested_key(load) -> None:
    error = error_of(load, engine_extra={"kvplug.store.moed": "sync"})
    assert "store.moed: unknown key; allowed: frame_pool_bytes, prefault_frames, queue" in str(error)


def test_bad_literal_lists_the_allowed_values(load) -> None:
    error = error_of(load, engine_extra={"kvplug.hash": "md5"})
    assert "hash:" in str(error) and "'md5'" in str(error) and "sha256" in str(error) and "blake3" in str(error)


def test_bad_number(load) -> None:
    error = error_of(load, engine_extra={"kvplug.chunk_size": 0})
    assert "chunk_size: Input should be greater than 0 (got 0)" in str(error)


def test_unknown_tier_type_lists_installed_types(load) -> None:
    error = error_of(load, engine_extra={"kvplug.tiers": [{"type": "cpu"}, {"type": "floppy"}]})
    assert "tiers[1].type: unknown tier type 'floppy'; installed: cpu (got 'floppy')" in str(error)


def test_known_but_uninstalled_tier_type_says_how_to_get_it(load) -> None:
    error = error_of(load, engine_extra={"kvplug.tiers": [{"type": "s3", "url": "s3://b/p"}]})
    assert "tiers[0].type: tier type 's3' needs the kvplug-s3 package: pip install kvplug-s3" in str(error)


def test_unknown_connector_type(load) -> None:
    error = error_of(load, engine_extra={"kvplug.connector": {"type": "magic"}})
    assert "connector.type: unknown connector type 'magic'; installed: torch, auto" in str(error)


def test_bad_component_option_value(load) -> None:
    error = error_of(load, engine_extra={"kvplug.tiers": [{"type": "cpu", "max_bytes": "lots"}]})
    assert "tiers[0].max_bytes:" in str(error) and "'lots'" in str(error)


def test_unknown_component_option(load) -> None:
    error = error_of(load, engine_extra={"kvplug.tiers": [{"type": "cpu", "max_byte": "1GiB"}]})
    assert "tiers[0].max_byte: unknown key; did you mean 'max_bytes'? allowed: " in str(error) and "max_bytes" in str(
        error
    )


def test_every_problem_is_reported_at_once(load) -> None:
    error = error_of(load, engine_extra={"kvplug.tiers": [{"type": "cpu", "max_bytes": "x"}, {"type": "nope"}]})
    assert [p.path for p in error.problems] == ["tiers[0].max_bytes", "tiers[1].type"]


def test_empty_tier_list(load) -> None:
    assert "tiers:" in str(error_of(load, engine_extra={"kvplug.tiers": []}))


def test_unknown_env_variable(load) -> None:
    error = error_of(load, env={"KVPLUG_CHUNKSIZE": "8"})
    assert "env KVPLUG_CHUNKSIZE: unknown setting; did you mean 'KVPLUG_CHUNK_SIZE'? allowed: " in str(
        error
    ) and "KVPLUG_CHUNK_SIZE" in str(error)


def test_a_renamed_setting_names_its_new_name(load) -> None:
    """A setting renamed before the first release is an error that says what to write instead."""
    error = error_of(load, engine_extra={"kvplug": {"lookup_timeout_ms": 200}})
    assert "lookup_timeout_ms: unknown key; renamed to 'lookup_budget_s' (in seconds" in str(error)
    error = error_of(load, env={"KVPLUG_LOOKUP_TIMEOUT_MS": "200"})
    assert "env KVPLUG_LOOKUP_TIMEOUT_MS: unknown setting; renamed to 'KVPLUG_LOOKUP_BUDGET_S'" in str(error)
    assert load(engine_extra={"kvplug.lookup_budget_s": 0.05}).config.lookup_budget_s == 0.05


def test_the_hint_of_an_unknown_key_is_in_the_plugin_api(load) -> None:
    """An adapter that checks keys of its own (the vLLM connector's settings) gives the hint the
    core's config errors give, from ``kvplug.did_you_mean``, not a difflib call of its own."""
    import kvplug

    allowed = ["chunk_size", "max_bytes", "lookup_budget_s"]
    assert kvplug.did_you_mean("max_byte", allowed) == "did you mean 'max_bytes'? "
    assert kvplug.did_you_mean("Chunk_Sise", allowed) == "did you mean 'chunk_size'? "
    assert kvplug.did_you_mean("zzzz", allowed) == ""
    assert kvplug.did_you_mean("lookup_timeout_ms", allowed).startswith("renamed to 'lookup_budget_s' (in seconds")
    error = error_of(load, engine_extra={"kvplug.tiers": [{"type": "cpu", "max_byte": "1GiB"}]})
    assert f"max_byte: unknown key; {kvplug.did_you_mean('max_byte', ['max_bytes'])}allowed" in str(error)


def test_bad_env_value(load) -> None:
    error = error_of(load, env={"KVPLUG_CHUNK_SIZE": "eight"})
    assert "chunk_size:" in str(error) and "'eight'" in str(error)


def test_a_bad_value_from_the_environment_alone_names_its_variable(load) -> None:
    # No file: the variable was named only beside another layer, so a KVPLUG_* left set in a
    # shell gave "chunk_size: ... (got 'eight')" and no word of where the value came from.
    message = str(error_of(load, env={"kvplug_chunk_size": "eight", "KVPLUG_STORE": '{"queue": {"mode": "x"}}'}))
    assert (
        "chunk_size: Value error, must be a whole number, e.g. 256, not other text; set in env kvplug_chunk_size"
        in message
    )
    assert "store.queue.mode: Input should be 'sync' or 'async'; set in env KVPLUG_STORE (got 'x')" in message


def test_bad_env_json(load) -> None:
    assert "tiers" in str(error_of(load, env={"KVPLUG_TIERS": "[{not json"}))


def test_reserved_env_variables_are_not_settings(load) -> None:
    load(env={"KVPLUG_PLUGINS": "cpu", "KVPLUG_TRACE_PLUGINS": "0", "KVPLUG_TEST_ANYTHING": "1"})


def test_yaml_that_is_not_a_mapping(load, tmp_path: Path) -> None:
    error = error_of(load, config_file=write(tmp_path, "- a\n- b\n"))
    assert "the top level must be a mapping" in str(error) and "kvplug.yaml" in str(error)


def test_invalid_yaml(load, tmp_path: Path) -> None:
    assert "not valid YAML" in str(error_of(load, config_file=write(tmp_path, "chunk_size: [\n")))


def test_invalid_yaml_is_placed_in_the_file_by_name(load, tmp_path: Path) -> None:
    # PyYAML's marks named the text read, '"<unicode string>", line 3, column 5', not the file.
    message = str(error_of(load, config_file=write(tmp_path, "chunk_size: 256\ntiers:\n  - {type: cpu\n")))
    assert f'in "{tmp_path / "kvplug.yaml"}", line 3, column 5' in message
    assert "<unicode string>" not in message


def test_missing_file(load, tmp_path: Path) -> None:
    assert "cannot read config file" in str(error_of(load, config_file=tmp_path / "absent.yaml"))


def test_yaml_errors_name_nested_fields(load, tmp_path: Path) -> None:
    error = error_of(load, config_file=write(tmp_path, "store:\n  queue: {on_full: explode}\n"))
    assert "store.queue.on_full:" in str(error) and "'explode'" in str(error) and "'block'" in str(error)


def test_per_request_override_of_a_shared_setting_is_refused(load) -> None:
    error = error_of(load, request={"chunk_size": 16})
    assert (
        "chunk_size: cannot be set per request; per-request settings: pin_request, save_unfull_chunk, skip_save"
        in str(error)
    )


def test_per_request_bad_value(load) -> None:
    error = error_of(load, request={"skip_save": "perhaps"})
    assert "skip_save:" in str(error) and "'perhaps'" in str(error)


# --- resolution: a new frozen object, bound to its registry --------------------------------


def test_resolve_returns_a_new_config_and_leaves_the_input_alone(registry: PluginRegistry) -> None:
    from kvplug import KVPlugConfig

    raw = KVPlugConfig.model_validate({"tiers": [{"type": "cpu", "max_bytes": "1GiB"}]})
    resolved = raw.resolve(registry)
    assert resolved is not raw and resolved.resolved and not raw.resolved
    assert int(resolved.tiers[0].options.max_bytes) == 1024**3
    with pytest.raises(RuntimeError, match="not resolved"):
        _ = raw.tiers[0].options
    assert resolved.resolve(registry) is resolved  # already resolved against this registry
    assert resolved.registry is registry


def test_a_config_resolved_with_one_registry_is_checked_again_with_another(registry: PluginRegistry) -> None:
    from kvplug import KVPlugConfig

    with_disk = PluginRegistry(plugin_filter="cpu,disk")
    config = KVPlugConfig.model_validate({"tiers": [{"type": "cpu"}, {"type": "disk", "path": "/tmp/kvplug-x"}]})
    resolved = config.resolve(with_disk)
    with pytest.raises(ConfigError) as info:
        resolved.resolve(registry)  # a registry without the disk tier
    assert [p.path for p in info.value.problems] == ["tiers[1].type"]
    assert resolved.registry is with_disk  # nothing changed in it


def test_per_request_copy_stays_resolved_against_the_same_registry(load, registry: PluginRegistry) -> None:
    config = load().config
    changed = config.with_overrides({"skip_save": True})
    assert changed is not config and changed.registry is registry


def test_structural_and_component_errors_are_reported_in_one_pass(load) -> None:
    error = error_of(
        load,
        engine_extra={"kvplug.chunk_size": 0, "kvplug.tiers": [{"type": "cpu", "max_bytes": "lots"}, {"type": "nope"}]},
    )
    paths = {p.path for p in error.problems}
    assert "chunk_size" in paths
    assert any(p.startswith("tiers[0].max_bytes") for p in paths), paths
    assert "tiers[1].type" in paths
