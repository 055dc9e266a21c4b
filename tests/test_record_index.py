"""kvplug.RecordIndex, the record tier's bounded LRU of record sizes: an entry recorded
again while a store call was answering is kept, and the round of checks goes over every
entry without changing which one ``max_bytes`` evicts first. (Its behaviour against a real
evicting server is checked by the valkey tier's tests, plugins/kvplug_valkey/tests.)"""

from __future__ import annotations

from kvplug import RecordIndex
from kvplug.core.record_index import CHECKS_PER_ROUND


def test_a_put_between_the_stores_answer_and_the_drop_keeps_its_entry() -> None:
    index = RecordIndex(max_keys=10)
    index.record("a" * 64, 100, None)
    (seen,) = index.snapshot(["a" * 64])
    index.record("a" * 64, 120, None)  # stored again while a read's miss was on its way back
    index.forget_gone("a" * 64, seen)
    assert index.items == 1 and index.bytes_used == 120 and index.found_gone == 0
    (seen,) = index.snapshot(["a" * 64])
    index.forget_gone("a" * 64, seen)
    assert index.items == 0 and index.bytes_used == 0 and index.found_gone == 1


def test_checks_go_round_every_key_without_changing_the_eviction_order() -> None:
    index = RecordIndex(max_keys=1_000)
    digests = [f"{i:064x}" for i in range(100)]
    for digest in digests:
        index.record(digest, 10, None)
    assert list(index.due_checks()) == digests  # 100 new keys: the whole index is due, oldest first
    index.record(digests[0], 10, None)  # read again: most recently used
    checked: list[str] = []
    while len(checked) < 100:  # nothing new: each round of checks takes the next CHECKS_PER_ROUND keys
        batch = index.due_checks()
        assert len(batch) == CHECKS_PER_ROUND
        checked.extend(batch)
    assert sorted(checked[:100]) == digests  # every key once before any key twice
    # Checking reordered nothing: max_bytes still evicts the least recently used first.
    assert [digest for digest, _ in index.evict_over(10 * 97)] == digests[1:4]
