"""Config of tier ``mooncake``: clear errors naming the field, YAML as in the issue, the entry point."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvplug import load_config
from kvplug.core.plugins import PluginRegistry  # internal: needs public API (the s3 tests use it the same way)
from kvplug.errors import ConfigError
from kvplug_mooncake import MooncakeTier, MooncakeTierConfig

GOOD = {"master": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata"}


def error_of(**options: object) -> str:
    with pytest.raises(ValidationError) as caught:
        MooncakeTierConfig(**{**GOOD, **options})
    return str(caught.value)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("master", "127.0.0.1", "master must be host:port"),
        ("master", "127.0.0.1:0", "port in 1..65535"),
        ("metadata_server", "ftp://x/metadata", "metadata_server must be http://host:port/metadata"),
        ("protocol", "udp", "'tcp' or 'rdma'"),
        ("key_prefix", "has space/", "key_prefix may hold"),
        ("local_hostname", "", "local_hostname must be"),
        ("transfer_threads", 0, "greater than or equal to 1"),
        ("retries", 11, "less than or equal to 10"),
    ],
)
def test_bad_values_name_the_field_and_what_is_allowed(field: str, value: object, expected: str) -> None:
    message = error_of(**{field: value})
    assert field in message and expected in message and str(value) in message


def test_metadata_server_forms_mooncake_accepts() -> None:
    for value in ("http://10.0.0.5:8080/metadata", "etcd://10.0.0.5:2379", "10.0.0.5:2379", "P2PHANDSHAKE"):
        assert MooncakeTierConfig(**{**GOOD, "metadata_server": value}).metadata_server == value


def test_yaml_config_of_the_issue_validates(tmp_path) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text(
        "tiers:\n"
        "  - {type: cpu, max_bytes: 1GiB}\n"
        "  - {type: mooncake, master: 127.0.0.1:50051, metadata_server: http://127.0.0.1:8080/metadata}\n"
    )
    config = load_config(config_file=path, env={}, registry=PluginRegistry(plugin_filter="cpu,mooncake")).config
    tier = config.tiers[1]
    assert tier.type == "mooncake"
    options = tier.options
    assert isinstance(options, MooncakeTierConfig)
    assert options.master == "127.0.0.1:50051" and options.global_segment_size == 0 and options.protocol == "tcp"


def test_config_errors_name_the_tier_field_path() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(
            engine_extra={"kvplug.tiers": [{"type": "cpu"}, {"type": "mooncake", **GOOD, "master": "nowhere"}]},
            env={},
            registry=PluginRegistry(plugin_filter="cpu,mooncake"),
        )
    assert "tiers[1].master" in str(caught.value) and "nowhere" in str(caught.value)


def test_the_plugin_loads_through_its_entry_point() -> None:
    registry = PluginRegistry(plugin_filter="mooncake")
    assert registry.storage_tiers()["mooncake"] is MooncakeTier
    assert "kvplug-mooncake" in registry.origin("storage_tier", "mooncake")
