"""The tier chain's one write queue per async tier, on real cpu and disk tiers.

What the disk tier's own writer thread used to give only that tier, every async tier now
gets from the chain: values readable while queued, repeated writes coalesced, queued
writes cancelled by a removal (and a write in progress not overtaking the removal),
drain or drop on close, bounds in batches and bytes that block or drop (counted).

The tier under test is held in its ``put`` by a gate the test opens: a slow tier,
with the real tier behind it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplug import Buffer, StorageTier, TierChain
from kvplug.core.metrics import EngineMetrics
from kvplug.testing import key_for, tier_context, value_for
from kvplug_cpu import CPUTier
from kvplug_disk import DiskTier

SIZE = 4096


class Held:
    """Makes a real tier's ``put`` wait for ``gate`` and records what it was asked to write."""

    def __init__(self, tier: StorageTier) -> None:
        self.tier = tier
        self.gate = threading.Event()
        self.entered = threading.Event()  # a put is waiting at the gate
        self.written: list[tuple[str, bytes]] = []
        real_put = tier.put

        def put(items: Any) -> None:
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
            self.written += [(key, bytes(value)) for key, value in items]
            real_put(items)

        tier.put = put  # type: ignore[method-assign]

    def open_later(self, seconds: float = 0.2) -> threading.Timer:
        timer = threading.Timer(seconds, self.gate.set)
        timer.start()
        return timer


MakeTier = Callable[..., StorageTier]


@pytest.fixture(params=["cpu", "disk"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeTier]:
    """An async tier of each kind, its queue settings from the test."""

    def make(**queue: object) -> StorageTier:
        settings = {"mode": "async", **queue}
        if request.param == "cpu":
            return CPUTier(CPUTier.Config(queue=settings), tier_context())
        return DiskTier(DiskTier.Config(path=tmp_path / "disk", fsync=False, queue=settings), tier_context())

    yield make


def chain_of(tier: StorageTier) -> tuple[TierChain, Held, EngineMetrics]:
    held = Held(tier)
    metrics = EngineMetrics()
    return TierChain([tier], metrics), held, metrics


def item(name: str, version: int = 0) -> tuple[str, bytes]:
    return key_for(name), value_for(f"{name}/{version}", SIZE)


def values_of(chain: TierChain, keys: list[str]) -> list[bytes | None]:
    got: list[Buffer | None] = [hit.value for hit in chain.fetch_prefix(keys)]
    got += [None] * (len(keys) - len(got))
    return [None if value is None else bytes(value) for value in got]


def test_queued_values_are_readable_at_once(make_tier: MakeTier) -> None:
    chain, held, _ = chain_of(make_tier())
    a, b = item("a"), item("b")
    chain.put([a, b])
    assert held.entered.wait(10)
    assert held.tier.contains([a[0], b[0]]) == [False, False]  # not in the tier yet
    assert chain.contains_any([a[0], b[0]]) == [True, True]
    assert values_of(chain, [a[0], b[0]]) == [a[1], b[1]]
    held.gate.set()
    chain.flush()  # every accepted write visible in its tier
    assert held.tier.contains([a[0], b[0]]) == [True, True]
    assert [bytes(v) for v in held.tier.get([a[0], b[0]]) if v is not None] == [a[1], b[1]]
    assert dict(chain.stats())[f"0:{held.tier.name}"].extra["writer_pending"] == 0
    chain.close()


def test_a_second_write_of_a_queued_key_replaces_it(make_tier: MakeTier) -> None:
    chain, held, _ = chain_of(make_tier())
    first = item("first")
    chain.put([first])
    assert held.entered.wait(10)  # "first" is being written; what follows waits in the queue
    old, new = item("again", 1), item("again", 2)
    chain.put([old])
    chain.put([new])
    assert values_of(chain, [new[0]]) == [new[1]]
    held.gate.set()
    chain.flush()
    assert held.written == [first, new]  # the replaced value was never written
    assert bytes(held.tier.get([new[0]])[0] or b"") == new[1]
    chain.close()


def test_a_removal_cancels_queued_writes_and_is_not_overtaken_by_one_in_progress(make_tier: MakeTier) -> None:
    chain, held, _ = chain_of(make_tier())
    writing, queued, kept = item("writing"), item("queued"), item("kept")
    chain.put([writing])
    assert held.entered.wait(10)
    chain.put([queued])
    chain.put([kept])
    chain.discard([queued[0]])
    assert chain.contains_any([queued[0]]) == [False]
    timer = held.open_later()
    chain.discard([writing[0]])  # waits for the write in progress, then removes it
    timer.join()
    chain.flush()
    assert [key for key, _ in held.written] == [writing[0], kept[0]]
    assert held.tier.contains([writing[0], queued[0], kept[0]]) == [False, False, True]
    chain.close()


@pytest.mark.parametrize("on_close", ["drain", "drop"])
def test_close_drains_or_drops_what_is_queued(make_tier: MakeTier, on_close: str) -> None:
    chain, held, metrics = chain_of(make_tier(on_close=on_close))
    items = [item(f"c{i}") for i in range(5)]
    chain.put(items[:1])
    assert held.entered.wait(10)
    for one in items[1:]:
        chain.put([one])
    timer = held.open_later()
    chain.close()  # drop: the queued four go at once; the one being written still lands
    timer.join()
    label = f"0:{held.tier.name}"
    if on_close == "drain":
        assert held.written == items
        assert metrics.value("kvplug_store_dropped_total", queue=label) == 0
    else:
        assert held.written == items[:1]
        assert metrics.value("kvplug_store_dropped_total", queue=label) == 4


def test_a_full_queue_drops_and_counts(make_tier: MakeTier) -> None:
    chain, held, metrics = chain_of(make_tier(max_items=1, on_full="drop"))
    a, b, c = item("a"), item("b"), item("c")
    chain.put([a])
    assert held.entered.wait(10)  # a is being written: the queue itself is empty
    chain.put([b])  # fills it
    chain.put([c])  # dropped
    assert chain.contains_any([b[0], c[0]]) == [True, False]  # a dropped write is not readable
    stats = dict(chain.stats())[f"0:{held.tier.name}"]
    assert stats.extra["writer_dropped"] == 1 and stats.extra["writer_pending"] == 2
    assert metrics.value("kvplug_store_dropped_total", queue=f"0:{held.tier.name}") == 1
    held.gate.set()
    chain.flush()
    assert held.written == [a, b]
    chain.close()


def test_a_dropped_write_of_a_queued_key_leaves_the_queued_write_in_place(make_tier: MakeTier) -> None:
    """A refused write replaces nothing: the accepted older write of its key is still
    readable and still written (it used to be skipped as replaced, and the key lost)."""
    chain, held, _ = chain_of(make_tier(max_items=1, on_full="drop"))
    first = item("first")
    chain.put([first])
    assert held.entered.wait(10)  # "first" is being written: the queue itself is empty
    old, new = item("again", 1), item("again", 2)
    chain.put([old])  # fills the queue
    chain.put([new])  # dropped
    assert dict(chain.stats())[f"0:{held.tier.name}"].extra["writer_dropped"] == 1
    assert values_of(chain, [old[0]]) == [old[1]]
    held.gate.set()
    chain.flush()
    assert held.written == [first, old]
    assert values_of(chain, [old[0]]) == [old[1]]
    assert bytes(held.tier.get([old[0]])[0] or b"") == old[1]
    chain.close()


def test_a_write_refused_after_waiting_leaves_the_older_write_of_its_key_to_be_written(make_tier: MakeTier) -> None:
    """The worker takes the older batch while a newer write of the same key waits for
    room, which it never gets (block_timeout_s): the older batch still writes the key."""
    tier = make_tier(max_bytes=int(3.5 * SIZE), on_full="block", block_timeout_s=0.5)
    chain, held, _ = chain_of(tier)
    held.gate.set()  # each put waits for its own turn instead
    turns, entered = [threading.Event() for _ in range(3)], [threading.Event() for _ in range(3)]
    calls = iter(range(3))
    held_put = tier.put

    def put(items: Any) -> None:
        call = next(calls)
        entered[call].set()
        assert turns[call].wait(30), "the test never gave this put its turn"
        held_put(items)

    tier.put = put  # type: ignore[method-assign]
    first, old, other = item("first"), item("again", 1), item("other")
    new, big = item("again", 2), (key_for("big"), value_for("big", 2 * SIZE))
    chain.put([first])
    assert entered[0].wait(10)  # "first" is being written: 1 of 3.5 sizes held
    chain.put([old, other])  # queued: 3 sizes held
    waiting = threading.Thread(target=chain.put, args=([new, big],))  # 3 more: waits for room
    waiting.start()
    for _ in range(1000):  # until the waiting write is pending (readable)
        if chain.contains_any([big[0]]) == [True]:
            break
        threading.Event().wait(0.01)
    turns[0].set()
    assert entered[1].wait(10)  # the worker took [old, other] while [new, big] waits
    waiting.join(10)  # [old, other] hold 2 sizes until written: no room for 3, dropped
    assert dict(chain.stats())[f"0:{tier.name}"].extra["writer_dropped"] == 1
    assert values_of(chain, [old[0], big[0]]) == [old[1], None]
    turns[1].set()
    chain.flush()
    assert held.written == [first, old, other]
    assert bytes(held.tier.get([old[0]])[0] or b"") == old[1]
    chain.close()


def test_a_queue_full_in_bytes_makes_a_blocking_write_wait_for_room(make_tier: MakeTier) -> None:
    chain, held, _ = chain_of(make_tier(max_bytes=SIZE + SIZE // 2, on_full="block"))
    a, b = item("a"), item("b")
    chain.put([a])
    assert held.entered.wait(10)  # a's bytes count until it is written: no room for b's
    timer = held.open_later()
    chain.put([b])  # waits until a is written
    assert held.written[:1] == [a]
    timer.join()
    chain.flush()
    assert held.written == [a, b]
    assert dict(chain.stats())[f"0:{held.tier.name}"].extra["writer_dropped"] == 0
    chain.close()


def test_a_queue_full_in_bytes_drops_without_blocking(make_tier: MakeTier) -> None:
    chain, held, _ = chain_of(make_tier(max_bytes=SIZE + SIZE // 2, on_full="drop"))
    a, b = item("a"), item("b")
    chain.put([a])
    assert held.entered.wait(10)
    chain.put([b])  # no room for its bytes: dropped at once (the gate is still shut)
    assert dict(chain.stats())[f"0:{held.tier.name}"].extra["writer_dropped"] == 1
    held.gate.set()
    chain.flush()
    assert held.written == [a]
    chain.close()


def test_the_chain_settles_a_tier_once_its_queue_runs_empty(make_tier: MakeTier) -> None:
    """``StorageTier.settle``: the disk tier syncs its folders there, once per busy spell, not per put."""
    chain, held, _ = chain_of(make_tier())
    settles: list[int] = []
    real_settle = held.tier.settle
    held.tier.settle = lambda: (settles.append(len(held.written)), real_settle())[1]  # type: ignore[method-assign]
    items = [item(f"s{i}") for i in range(3)]
    chain.put(items[:1])
    assert held.entered.wait(10)
    chain.put(items[1:2])
    chain.put(items[2:])
    held.gate.set()
    chain.flush()
    assert settles == [3]  # after the last of the three, not after each
    chain.close()


def test_a_tier_written_from_the_callers_thread_is_settled_after_each_put() -> None:
    tier = CPUTier(CPUTier.Config(), tier_context())
    settles: list[str] = []
    tier.settle = lambda: settles.append("settled")  # type: ignore[method-assign]
    chain = TierChain([tier])
    chain.put([item("a")])
    chain.put([item("b")])
    assert settles == ["settled", "settled"] and tier.contains([item("a")[0]]) == [True]
    chain.close()


def test_a_load_s_removal_cancels_only_the_queued_value_it_found_unusable(make_tier: MakeTier) -> None:
    """A load removes the bytes it read: a newer value of the key queued by this process's
    own store is still written; the very value read, queued, is not."""
    tier = make_tier()
    removing = threading.Event()  # the removal reached the tier: the queued writes were cancelled before it
    real_remove_if_same = tier.remove_if_same

    def remove_if_same(items: Any) -> None:
        real_remove_if_same(items)
        removing.set()

    tier.remove_if_same = remove_if_same  # type: ignore[method-assign]
    chain, held, _ = chain_of(tier)
    first = item("first")
    chain.put([first])
    assert held.entered.wait(10)  # "first" is being written; what follows waits in the queue
    good, bad = item("stored again", 1), item("read and found unusable", 2)
    chain.put([good, bad])
    chain.discard_later([(good[0], b"bytes a load read from another tier"), bad])
    assert removing.wait(10)  # the removal dropped queued writes (before the gate opens)
    held.gate.set()
    chain.flush()
    assert [key for key, _ in held.written] == [first[0], good[0]]
    assert held.tier.contains([good[0], bad[0]]) == [True, False]
    chain.close()


def test_a_cancelled_queued_write_is_never_reported(make_tier: MakeTier) -> None:
    """A queued write dropped by a removal never landed, so it was never announced ``stored``:
    a ``removed`` for it would tell routers of a chunk that was never there (and of one held
    by another tier or an older write: the tier reports its own removal of that)."""
    tier = make_tier()
    events: list[tuple[str, tuple[str, ...]]] = []
    tier.context.emit = lambda event: events.append((event.kind, event.keys))
    chain, held, _ = chain_of(tier)
    first, queued = item("first"), item("queued")
    chain.put([first])
    assert held.entered.wait(10)  # "first" is being written; "queued" waits in the queue
    chain.put([queued])
    chain.discard([queued[0]])
    held.gate.set()
    chain.flush()
    assert held.tier.contains([first[0], queued[0]]) == [True, False]
    assert events == [("stored", (first[0],))]
    chain.close()
