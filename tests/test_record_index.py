"""kvplug.core.records.index.RecordIndex, the record tier's bounded LRU of record sizes: an entry recorded
again while a store call was answering is kept, and the round of checks goes over every
entry without changing which one ``max_bytes`` evicts first. (Its behaviour against a real
evicting server is checked by the valkey tier's tests, plugins/kvplug_valkey/tests.)"""

from __future__ import annotations

from kvplug.core.records.index import CHECKS_PER_ROUND, RecordIndex


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


def _digest(name: str) -> str:
    return name.encode().hex().ljust(64, "0")


def _hot_left_after_a_scan(eviction: str) -> int:
    """Hot records read twice, then one-off records four times the budget, each batch of
    writes followed by the tier's evict_over: how many hot records are still indexed."""
    budget = 100 * 10
    index = RecordIndex(max_keys=10_000, evicts_when_full=True, eviction=eviction)  # type: ignore[arg-type]
    hot = [_digest(f"hot{i}") for i in range(30)]
    for digest in hot:
        index.record(digest, 10, None)
    for _ in range(2):  # read back twice: RecordTier.get records each hit
        for digest in hot:
            index.record(digest, 10, None)
    for i in range(400):
        index.record(_digest(f"scan{i}"), 10, None)
        index.evict_over(budget)
        assert index.bytes_used <= budget
    return sum(entry is not None for entry in index.snapshot(hot))


def test_s3fifo_keeps_records_read_twice_through_a_scan_that_lru_flushes() -> None:
    assert _hot_left_after_a_scan("s3fifo") == 30
    assert _hot_left_after_a_scan("lru") == 0


def test_with_s3fifo_listed_records_go_first_and_gone_records_leave_the_policy() -> None:
    from kvplug import StoredRecord

    index = RecordIndex(max_keys=4, evicts_when_full=True, eviction="s3fifo")
    index.begin_scan()
    index.record(_digest("written"), 10, "k")
    index.finish_scan([StoredRecord(_digest("old"), 10, 1.0), StoredRecord(_digest("new"), 10, 2.0)], 0)
    assert index.eviction == "s3fifo" and index.items == 3
    assert [digest for digest, _ in index.evict_over(10)] == [_digest("old"), _digest("new")]
    (seen,) = index.snapshot([_digest("written")])
    index.forget_gone(_digest("written"), seen)
    assert index.items == 0 and index.bytes_used == 0 and index.evict_over(0) == []
    for i in range(6):  # the size bound pushes out in the policy's order, one per record past it
        pushed = index.record(_digest(f"r{i}"), 1, None)
        assert [digest for digest, _ in pushed] == ([_digest(f"r{i - 4}")] if i >= 4 else [])
