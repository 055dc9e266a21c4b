"""A value a load found unusable is removed from a shared Mooncake store only while the store
still holds it: another engine's good record stored since the load survives.

Mooncake removes by name only (no compare-and-delete, no version to remove by), so the tier
reads the record again and removes it by name only if it still holds the value the load
read; what is left is the window of one round trip between that read and the remove."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplug.core.records.frame import set_integrity_key
from kvplug.testing import key_for, value_for
from kvplug.testing.corrupt_races import check_remove_if_same_keeps_a_newer_value

SECRET = b"an integrity key of the engines that sign records"


def test_remove_if_same_keeps_a_record_another_engine_stored_since_the_load(make_mooncake_tier) -> None:
    tier, other = make_mooncake_tier(), make_mooncake_tier()
    check_remove_if_same_keeps_a_newer_value(tier, other)


@pytest.fixture
def no_integrity_key() -> Iterator[None]:
    set_integrity_key(None)
    yield
    set_integrity_key(...)  # what the environment says again, for the tests after


def test_remove_if_same_keeps_a_record_of_that_value_this_process_cannot_read(
    make_mooncake_tier, no_integrity_key: None
) -> None:
    """A record this process reads as no record of the key is not the one its load read, whatever
    value it holds: a record signed with an integrity key this process lacks (stored by an engine
    that has it, over the one the load read) is kept for the engines that can read it, as this
    process's reads keep it (MissingIntegrityKeyError: a miss, never removed). Before, the value
    alone was compared and such a record was removed by name."""
    tier, keyed = make_mooncake_tier(), make_mooncake_tier()
    key, value = key_for("unusable here"), value_for("unusable here", 3000)
    tier.put([(key, value)])
    tier.flush()
    (read,) = tier.get([key])
    assert read is not None and bytes(read) == value
    set_integrity_key(SECRET)
    keyed.put([(key, value)])  # the same bytes, signed: a record of another format
    keyed.flush()
    set_integrity_key(None)
    assert tier.get([key]) == [None]  # unreadable here: a miss, kept
    tier.remove_if_same([(key, bytes(read))])
    set_integrity_key(SECRET)
    assert [bytes(v) for v in keyed.get([key]) if v is not None] == [value], "the signed record was removed"
    set_integrity_key(None)
    # the record the load read, unsigned, is removed as before
    tier.put([(key, value)])
    tier.flush()
    tier.remove_if_same([(key, bytes(read))])
    assert tier.get([key]) == [None] and keyed.get([key]) == [None]
