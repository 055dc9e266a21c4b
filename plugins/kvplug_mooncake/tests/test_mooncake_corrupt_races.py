"""A value a load found unusable is removed from a shared Mooncake store only while the store
still holds it: another engine's good record stored since the load survives.

Mooncake removes by name only (no compare-and-delete, no version to remove by), so the tier
reads the record again and removes it by name only if it still holds the value the load
read; what is left is the window of one round trip between that read and the remove."""

from __future__ import annotations

from kvplug.testing.corrupt_races import check_remove_if_same_keeps_a_newer_value


def test_remove_if_same_keeps_a_record_another_engine_stored_since_the_load(make_mooncake_tier) -> None:
    tier, other = make_mooncake_tier(), make_mooncake_tier()
    check_remove_if_same_keeps_a_newer_value(tier, other)
