"""``QueueSettings``: one vocabulary for the store queue and every tier's write queue,
and kvplug 0.2's keys mapped to it for one release with a warning.

The disk tier's own old keys (``writer``, ``queue_items`` ...) are tested with the tier,
in plugins/kvplug_disk/tests/test_disk_tier.py.
"""

from __future__ import annotations

import warnings

import pytest

from kvplug import QueueSettings, RemoteTierConfig, TierConfig, load_config
from kvplug.core.config import StoreSettings
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
    ("old", "value", "new", "expected"),
    [
        ("write_mode", "async", "mode", "async"),
        ("write_queue_items", 7, "max_items", 7),
        ("write_queue_bytes", "1MiB", "max_bytes", 1024**2),
        ("on_queue_full", "block", "on_full", "block"),
    ],
)
def test_an_old_tier_key_still_works_with_a_warning_naming_its_new_key(
    old: str, value: object, new: str, expected: object
) -> None:
    tiers = [{"type": "cpu"}, {"type": "cpu", old: value}]
    with pytest.warns(FutureWarning) as caught:
        config = load({"tiers": tiers})
    assert [str(w.message) for w in caught] == [
        f"tiers[1].{old} is deprecated and will be removed in a later release: use tiers[1].queue.{new}"
    ]
    assert getattr(config.tiers[1].options.queue, new) == expected
    assert getattr(config.tiers[0].options.queue, new) == getattr(QueueSettings(), new)


@pytest.mark.parametrize(
    ("old", "value", "new", "expected"),
    [
        ("mode", "sync", "mode", "sync"),
        ("queue_max_batches", 5, "max_items", 5),
        ("queue_max_bytes", "64MiB", "max_bytes", 64 * 1024**2),
        ("on_full", "drop", "on_full", "drop"),
        ("block_timeout_s", 2.5, "block_timeout_s", 2.5),
    ],
)
def test_an_old_store_key_still_works_with_a_warning_naming_its_new_key(
    old: str, value: object, new: str, expected: object
) -> None:
    with pytest.warns(FutureWarning) as caught:
        config = load({"store": {old: value}})
    assert [str(w.message) for w in caught] == [
        f"store.{old} is deprecated and will be removed in a later release: use store.queue.{new}"
    ]
    assert getattr(config.store.queue, new) == expected


def test_an_old_key_and_its_new_key_that_disagree_are_a_config_error() -> None:
    with pytest.warns(FutureWarning), pytest.raises(ConfigError) as info:
        load({"tiers": [{"type": "cpu", "write_queue_items": 3, "queue": {"max_items": 4}}]})
    assert "tiers[0].write_queue_items (3) conflicts with tiers[0].queue.max_items (4)" in str(info.value)
    assert "set only tiers[0].queue.max_items" in str(info.value)
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match=r"store\.mode .* store\.queue\.mode"):
        load({"store": {"mode": "sync", "queue": {"mode": "async"}}})
    with warnings.catch_warnings():  # the same value twice is no conflict
        warnings.simplefilter("ignore", FutureWarning)
        assert load({"store": {"mode": "sync", "queue": {"mode": "sync"}}}).store.queue.mode == "sync"


def test_old_keys_are_still_refused_values_they_never_took() -> None:
    with pytest.warns(FutureWarning), pytest.raises(ConfigError) as info:
        load({"store": {"on_full": "explode"}})
    assert "store.queue.on_full" in str(info.value) and "'explode'" in str(info.value)


def test_the_new_keys_alone_warn_of_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        load({"store": {"queue": {"mode": "sync"}}, "tiers": [{"type": "cpu", "queue": {"mode": "async"}}]})
