"""What tier ``mooncake``'s backend does with the store, on a real cluster: reads of
records whose size this process does not know, a batch larger than the registered
buffer, a key named twice in a batch, removes, and its own ``stats()`` entries."""

from __future__ import annotations

import uuid

from kvplug.testing import key_for, tier_context, value_for
from kvplug_mooncake import MooncakeTier


def _prefix() -> str:
    return f"x{uuid.uuid4().hex[:12]}/"


def test_records_of_unknown_size_read_whole(make_mooncake_tier):
    prefix = _prefix()
    writer = make_mooncake_tier(key_prefix=prefix)
    small, large = key_for("small"), key_for("large")
    writer.put([(small, value_for(small, 1000)), (large, value_for(large, 3 * 1024 * 1024))])
    # A fresh tier knows neither size: its first read asks the store; then a record
    # larger than the largest it has seen is read whole too.
    reader = make_mooncake_tier(key_prefix=prefix)
    assert bytes(reader.get([small])[0]) == value_for(small, 1000)
    assert bytes(reader.get([large])[0]) == value_for(large, 3 * 1024 * 1024)
    assert reader.stats().items == 2 and reader.stats().hits == 2


def test_a_record_over_the_engines_bound_is_a_miss_read_no_further(make_mooncake_tier, mooncake_cluster):
    """A writer of the store plants a record bigger than any of the engine's: a corrupt
    miss, removed, and it does not become the size every later read of unknown size leases."""
    prefix = _prefix()
    writer = make_mooncake_tier(key_prefix=prefix)  # no bound: it stores what it is given
    victim, others = key_for("planted"), [key_for(f"small-{i}") for i in range(8)]
    writer.put([(victim, value_for(victim, 32 * 1024 * 1024)), *((k, value_for(k, 4096)) for k in others)])
    bound = 64 + 64 * 1024
    config = MooncakeTier.Config(**mooncake_cluster.tier_options, key_prefix=prefix, transfer_buffer_size=1024 * 1024)
    reader = MooncakeTier(config, tier_context(max_record_bytes=bound))
    try:
        assert reader.get([victim]) == [None]
        assert reader.stats().extra["corrupt"] == 1
        # Kept (mooncake cannot remove only what was read), absent to the reader that found it bad.
        assert writer.contains([victim]) == [True] and reader.contains([victim]) == [False]
        # Sizes unknown to this reader: read at the size of the largest record it has seen.
        assert [bytes(v) for v in reader.get(others)] == [value_for(k, 4096) for k in others]
        assert reader.stats().extra["temporary_buffers"] == 0
    finally:
        reader.close()


def test_a_batch_larger_than_the_transfer_buffer(make_mooncake_tier):
    tier = make_mooncake_tier(key_prefix=_prefix(), transfer_buffer_size=1024 * 1024)
    items = [(key_for(f"big{i}"), value_for(f"big{i}", 512 * 1024)) for i in range(4)]
    tier.put(items)
    got = tier.get([key for key, _ in items])
    assert [bytes(value) for value in got] == [value for _, value in items]
    assert tier.stats().extra["temporary_buffers"] >= 2  # the put's and the get's


def test_a_key_named_twice_in_a_batch(make_mooncake_tier):
    tier = make_mooncake_tier(key_prefix=_prefix())
    key, other = key_for("twice"), key_for("once")
    tier.put([(key, value_for(key, 5000)), (other, value_for(other, 7000))])
    assert tier.contains([key, other, key]) == [True, True, True]
    got = tier.get([key, other, key])
    assert [bytes(value) for value in got] == [value_for(key, 5000), value_for(other, 7000), value_for(key, 5000)]
    tier.remove([key, key])
    assert tier.contains([key, other]) == [False, True]
    assert tier.get([key]) == [None]


def test_stats_name_the_master_and_the_stores_own_counters(make_mooncake_tier, mooncake_cluster):
    tier = make_mooncake_tier(key_prefix=_prefix())
    tier.put([(key_for("s"), b"value")])
    extra = tier.stats().extra
    assert extra["master"] == mooncake_cluster.master_address
    assert extra["dropped_no_space"] == 0 and extra["leased_removes"] >= 0
    assert extra["index_max_keys"] == 1_000_000
