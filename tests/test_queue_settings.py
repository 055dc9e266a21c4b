"""``QueueSettings``: one vocabulary for the store queue and every tier's write queue.

The queue keys of unreleased development versions (``write_mode``, ``store.mode`` ...)
are unknown keys: a config error naming each.
"""

from __future__ import annotations

import warnings

import pytest

from kvplug import QueueSettings, RemoteTierConfig, TierConfig, load_config
from kvplug.core.config.model import StoreSettings
from kvplug.errors import ConfigError


def load(settings: dict[str, object], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return load_config(engine_extra={"kvplug": settings}, env=env or {}).config


def test_each_owner_has_its_own_defaults_and_a_partial_queue_keeps_them() -> None:
    assert StoreSettings().queue == QueueSettings(mode="async", max_items=64, on_full="block")
    assert TierConfig().queue == QueueSettings()  # cpu and any tier: sync
    assert RemoteTierConfig().queue.mode == "async"
    config = load({"store": {"queue": {"max_items": 8}}, "tiers": [{"type": "cpu", "queue": {"max_items": 9}}]})
    assert (config.store.queue.mode, config.store.queue.max_items, config.store.queue.on_full) == ("async", 8, "block")
    tier = config.tiers[0].options.queue
    assert (tier.mode, tier.max_items, tier.on_close) == ("sync", 9, "drain")


def test_nested_queue_keys_come_from_the_environment_and_dotted_engine_keys() -> None:
    config = load_config(
        engine_extra={"kvplug.store.queue.on_full": "drop"}, env={"KVPLUG_STORE__QUEUE__MODE": "sync"}
    ).config
    assert (config.store.queue.mode, config.store.queue.on_full, config.store.queue.max_items) == ("sync", "drop", 64)


@pytest.mark.parametrize(
    ("settings", "path"),
    [
        ({"tiers": [{"type": "cpu", "write_mode": "async"}]}, "tiers[0].write_mode"),
        ({"tiers": [{"type": "cpu", "write_queue_items": 7}]}, "tiers[0].write_queue_items"),
        ({"tiers": [{"type": "cpu", "write_queue_bytes": "1MiB"}]}, "tiers[0].write_queue_bytes"),
        ({"tiers": [{"type": "cpu", "on_queue_full": "block"}]}, "tiers[0].on_queue_full"),
        ({"store": {"mode": "sync"}}, "store.mode"),
        ({"store": {"queue_max_batches": 5}}, "store.queue_max_batches"),
        ({"store": {"queue_max_bytes": "64MiB"}}, "store.queue_max_bytes"),
        ({"store": {"on_full": "drop"}}, "store.on_full"),
        ({"store": {"block_timeout_s": 2.5}}, "store.block_timeout_s"),
    ],
)
def test_a_queue_key_outside_queue_is_an_unknown_key(settings: dict[str, object], path: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not accepted with a warning
        with pytest.raises(ConfigError) as info:
            load(settings)
    assert f"{path}: unknown key" in " ".join(str(info.value).split())


def test_the_new_keys_alone_warn_of_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        load({"store": {"queue": {"mode": "sync"}}, "tiers": [{"type": "cpu", "queue": {"mode": "async"}}]})
