"""Config of tier ``valkey``: URL forms, clear errors naming the field and what is allowed,
and a password that never shows."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvplug.errors import TierError
from kvplug.testing import tier_context
from kvplug_valkey import ValkeyTier, ValkeyTierConfig


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6380/2", "redis://127.0.0.1:6380/2"),
        ("redis://127.0.0.1", "redis://127.0.0.1:6379/0"),
        ("valkey://127.0.0.1:7000", "redis://127.0.0.1:7000/0"),
        ("rediss://127.0.0.1:6380/1", "rediss://127.0.0.1:6380/1"),
        ("valkeys://127.0.0.1:6380", "rediss://127.0.0.1:6380/0"),
        ("redis://127.0.0.1:6379?db=3", "redis://127.0.0.1:6379/3"),
        ("unix:///run/valkey.sock?db=4", "unix:///run/valkey.sock?db=4"),
    ],
)
def test_url_forms(url: str, shown: str) -> None:
    assert ValkeyTierConfig(url=url).address.display() == shown


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": "http://127.0.0.1:6379"}, "url scheme 'http' is not supported; use redis://"),
        ({"url": "127.0.0.1:6379"}, "has no scheme"),
        ({"url": "redis://:secret@127.0.0.1:6379"}, "must not carry credentials"),
        ({"url": "redis://127.0.0.1:6379/x"}, "database 'x' must be a number"),
        ({"url": "redis://127.0.0.1:99999"}, "invalid port"),
        ({"url": "redis://127.0.0.1?timeout=3"}, "only ?db=N"),
        ({"url": "unix://relative.sock"}, "absolute socket path"),
        ({"url": "redis://127.0.0.1/1", "cluster": True}, "a cluster has only database 0"),
        ({"url": "redis://127.0.0.1", "key_prefix": "a b"}, "key_prefix must be"),
        ({"url": "redis://127.0.0.1", "key_prefix": "kv*"}, "SCAN pattern characters"),
        ({"url": "redis://127.0.0.1", "key_prefix": ""}, "key_prefix must not be empty"),
        (
            {"url": "redis://127.0.0.1", "max_connections": 4},
            "max_connections (4) must be more than max_concurrency (32)",
        ),
        ({"url": "redis://127.0.0.1", "max_connections": 8, "max_concurrency": 8}, "raise max_connections or lower"),
        ({"url": "redis://127.0.0.1", "tls_ca_file": "/ca.pem"}, "rediss://"),
        ({"url": "redis://127.0.0.1", "ttl_s": 0}, "greater than 0"),
        ({"url": "redis://127.0.0.1", "bogus": 1}, "Extra inputs are not permitted"),
    ],
)
def test_bad_options_are_clear_errors(options: dict, message: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ValkeyTierConfig(**options)
    assert message in str(caught.value)


def test_password_never_shows() -> None:
    config = ValkeyTierConfig(url="redis://127.0.0.1:6379", password="hunter2-secret")
    assert "hunter2-secret" not in repr(config) and "hunter2-secret" not in str(config)
    assert "hunter2-secret" not in config.model_dump_json()
    assert config.password is not None and config.password.get_secret_value() == "hunter2-secret"


def test_unbounded_by_default_with_short_deadlines() -> None:
    config = ValkeyTierConfig(url="redis://127.0.0.1")
    assert config.max_bytes is None and config.queue.mode == "async"
    assert config.request_timeout_s <= 0.5 and config.cluster is None


def test_a_ca_file_that_cannot_be_read_is_named_when_the_tier_opens(tmp_path) -> None:
    missing = tmp_path / "no-such-ca.pem"
    config = ValkeyTierConfig(url="rediss://127.0.0.1:6390", tls_ca_file=str(missing))
    with pytest.raises(TierError) as caught:
        ValkeyTier(config, tier_context())
    assert f"tls_ca_file {missing} cannot be read: No such file or directory" in str(caught.value)
