"""``StorageTierContract``: the tests every storage tier must pass.

Subclass it in your tier's tests and provide one fixture, ``make_tier``: a
callable taking ``max_bytes`` (an int, or ``None`` for the tier's default budget)
and returning a new, empty tier. The contract closes what it makes::

    import pytest
    from kvplug.testing import StorageTierContract, tier_context

    class TestMyTier(StorageTierContract):
        @pytest.fixture
        def make_tier(self, tmp_path):
            def make(max_bytes=None):
                options = {} if max_bytes is None else {"max_bytes": max_bytes}
                return MyTier(MyTier.Config(path=str(tmp_path), **options), tier_context())
            return make

Class attributes tune it: ``large_value_bytes`` (64 MiB), ``lru`` (whether the
tier evicts least recently used first), ``reads_to_keep`` (the reads that keep a key
from the next eviction: 1, or 2 for ``eviction: s3fifo``), ``concurrency_seconds``, and
``stateful_examples`` (how many random operation sequences the stateful test runs
against a model of the tier; each sequence starts by removing its keys, so a tier
whose storage outlives it, such as a folder, starts empty too).

The contract needs ``pytest`` and ``hypothesis`` (``pip install kvplug[test]``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvplug.core.tier import Buffer, StorageTier, TierContext
from kvplug.errors import TierError


def tier_context(**overrides: object) -> TierContext:
    """A :class:`TierContext` for tests; pass ``emit=events.append`` to see events."""
    return TierContext(**overrides)  # type: ignore[arg-type]


def key_for(name: str) -> str:
    """A key shaped like the engine's: ``v1/<fingerprint>/<hash>``."""
    digest = hashlib.sha256(name.encode()).hexdigest()
    return f"v1/{'ab' * 16}/{digest}"


def value_for(name: str, size: int) -> bytes:
    """Deterministic bytes whose content identifies ``name`` at every offset."""
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _as_bytes(value: Buffer | None) -> bytes | None:
    return None if value is None else bytes(value)


class StorageTierContract:
    """Behaviour every :class:`kvplug.StorageTier` must have."""

    large_value_bytes: int = 64 * 1024 * 1024
    lru: bool = True
    #: Reads that keep a key from the next eviction: 1 for LRU, 2 for S3-FIFO (a key read
    #: twice in its small queue moves on to the main one).
    reads_to_keep: int = 1
    concurrency_seconds: float = 1.5
    stateful_examples: int = 25

    @pytest.fixture
    def make_tier(self) -> Callable[..., StorageTier]:
        raise NotImplementedError("subclass StorageTierContract and define a make_tier fixture")

    @pytest.fixture
    def tier_factory(self, make_tier: Callable[..., StorageTier]) -> Iterator[Callable[..., StorageTier]]:
        made: list[StorageTier] = []

        def factory(max_bytes: int | None = None) -> StorageTier:
            tier = make_tier(max_bytes)
            made.append(tier)
            return tier

        yield factory
        for tier in made:
            tier.close()

    @pytest.fixture
    def tier(self, tier_factory: Callable[..., StorageTier]) -> StorageTier:
        return tier_factory(None)

    # --- basics ---------------------------------------------------------------------

    def test_put_then_get_returns_the_same_bytes(self, tier: StorageTier) -> None:
        tier.put([(key_for("a"), value_for("a", 1000))])
        tier.flush()
        assert _as_bytes(tier.get([key_for("a")])[0]) == value_for("a", 1000)

    def test_missing_keys_are_none_and_not_contained(self, tier: StorageTier) -> None:
        assert tier.get([key_for("nope")]) == [None]
        assert tier.contains([key_for("nope")]) == [False]

    def test_batches_keep_order_and_mix_hits_and_misses(self, tier: StorageTier) -> None:
        names = [f"k{i}" for i in range(20)]
        tier.put([(key_for(n), value_for(n, 100 + i)) for i, n in enumerate(names) if i % 2 == 0])
        tier.flush()
        keys = [key_for(n) for n in names]
        assert tier.contains(keys) == [i % 2 == 0 for i in range(20)]
        got = tier.get(keys)
        for i, (name, value) in enumerate(zip(names, got)):
            assert _as_bytes(value) == (value_for(name, 100 + i) if i % 2 == 0 else None)

    def test_empty_batches_are_fine(self, tier: StorageTier) -> None:
        tier.put([])
        assert tier.get([]) == []
        assert tier.contains([]) == []
        tier.remove([])

    def test_overwrite_replaces_the_value(self, tier: StorageTier) -> None:
        key = key_for("over")
        tier.put([(key, value_for("old", 500))])
        tier.flush()
        tier.put([(key, value_for("new", 700))])
        tier.flush()
        assert _as_bytes(tier.get([key])[0]) == value_for("new", 700)
        assert tier.stats().items == 1

    def test_remove_deletes_and_ignores_missing(self, tier: StorageTier) -> None:
        tier.put([(key_for("r1"), b"x" * 10), (key_for("r2"), b"y" * 10)])
        tier.flush()
        tier.remove([key_for("r1"), key_for("never-stored")])
        assert tier.contains([key_for("r1"), key_for("r2")]) == [False, True]
        assert tier.get([key_for("r1")]) == [None]

    def test_remove_if_same_removes_the_value_read(self, tier: StorageTier) -> None:
        """What a load does with a value it found unusable (every tier: by name at least)."""
        tier.put([(key_for("read"), b"r" * 10), (key_for("kept"), b"k" * 10)])
        tier.flush()
        (read,) = tier.get([key_for("read")])
        assert read is not None
        tier.remove_if_same([(key_for("read"), bytes(read)), (key_for("never-stored"), b"n")])
        assert tier.contains([key_for("read"), key_for("kept")]) == [False, True]

    def test_empty_value_round_trips(self, tier: StorageTier) -> None:
        tier.put([(key_for("empty"), b"")])
        tier.flush()
        assert tier.contains([key_for("empty")]) == [True]
        assert _as_bytes(tier.get([key_for("empty")])[0]) == b""

    def test_memoryview_and_bytearray_values(self, tier: StorageTier) -> None:
        tier.put(
            [
                (key_for("mv"), memoryview(value_for("mv", 300)).toreadonly()),
                (key_for("ba"), bytearray(value_for("ba", 300))),
            ]
        )
        tier.flush()
        got = tier.get([key_for("mv"), key_for("ba")])
        assert [_as_bytes(v) for v in got] == [value_for("mv", 300), value_for("ba", 300)]

    def test_large_value_round_trips(self, tier: StorageTier) -> None:
        value = os.urandom(self.large_value_bytes)
        tier.put([(key_for("large"), value)])
        tier.flush()
        got = tier.get([key_for("large")])[0]
        assert got is not None and memoryview(got).nbytes == len(value)
        assert _as_bytes(got) == value

    def test_stats_count_bytes_items_hits_and_misses(self, tier: StorageTier) -> None:
        tier.put([(key_for("s1"), b"a" * 100), (key_for("s2"), b"b" * 50)])
        tier.flush()
        tier.get([key_for("s1"), key_for("missing")])
        stats = tier.stats()
        assert stats.items == 2
        assert stats.bytes_used >= 150
        assert stats.hits >= 1 and stats.misses >= 1

    # --- budget ---------------------------------------------------------------------

    def test_budget_is_respected_by_evicting(self, tier_factory: Callable[..., StorageTier]) -> None:
        tier = tier_factory(10_000)
        for i in range(30):
            tier.put([(key_for(f"b{i}"), value_for(f"b{i}", 1000))])
            tier.flush()
        stats = tier.stats()
        assert stats.bytes_used <= 10_000
        assert stats.evictions >= 20
        assert tier.contains([key_for("b29")]) == [True]
        assert tier.contains([key_for("b0")]) == [False]
        for i, present in enumerate(tier.contains([key_for(f"b{i}") for i in range(30)])):
            if present:
                assert _as_bytes(tier.get([key_for(f"b{i}")])[0]) == value_for(f"b{i}", 1000)

    def test_recently_read_keys_survive_eviction(self, tier_factory: Callable[..., StorageTier]) -> None:
        if not self.lru:
            pytest.skip("this tier does not evict least recently used first")
        tier = tier_factory(5_000)
        for i in range(5):
            tier.put([(key_for(f"l{i}"), value_for(f"l{i}", 1000))])
            tier.flush()
        for _ in range(self.reads_to_keep):
            tier.get([key_for("l0")])
        tier.put([(key_for("l5"), value_for("l5", 1000))])
        tier.flush()
        assert tier.contains([key_for("l0"), key_for("l1")]) == [True, False]

    def test_value_over_the_whole_budget_is_refused_and_loses_nothing(
        self, tier_factory: Callable[..., StorageTier]
    ) -> None:
        tier = tier_factory(4_000)
        tier.put([(key_for("keep"), value_for("keep", 1000))])
        tier.flush()
        with pytest.raises(TierError):
            tier.put([(key_for("huge"), value_for("huge", 5_000))])
            tier.flush()
        assert tier.contains([key_for("huge"), key_for("keep")]) == [False, True]
        assert _as_bytes(tier.get([key_for("keep")])[0]) == value_for("keep", 1000)

    # --- random operation sequences against a model ---------------------------------

    def test_random_operations_match_a_dict(self, make_tier: Callable[..., StorageTier]) -> None:
        """Unbounded: every contains/get/stats answer equals a plain dict's after the same puts and removes."""
        _run_against_model(make_tier, None, self.stateful_examples)

    def test_random_operations_under_a_budget_never_return_a_wrong_value(
        self, make_tier: Callable[..., StorageTier]
    ) -> None:
        """Bounded: a tier may evict anything, but a hit is the last value put, and the budget holds."""
        _run_against_model(make_tier, 6_000, self.stateful_examples)

    # --- concurrency ----------------------------------------------------------------

    def test_concurrent_readers_and_writers_see_whole_values(self, tier: StorageTier) -> None:
        """Writers overwrite keys with values of varying length; every read must be
        exactly one value some writer wrote under that key: never torn, never mixed."""
        keys = [key_for(f"c{i}") for i in range(8)]
        versions = {k: {value_for(f"{k}-{v}", 2000 + 997 * v) for v in range(6)} for k in keys}
        stop = time.monotonic() + self.concurrency_seconds
        failures: list[str] = []

        def writer(seed: int) -> None:
            n = seed
            while time.monotonic() < stop and not failures:
                key = keys[n % len(keys)]
                version = (n * 7 + seed) % 6
                tier.put([(key, value_for(f"{key}-{version}", 2000 + 997 * version))])
                n += 1

        def reader() -> None:
            while time.monotonic() < stop and not failures:
                for key, value in zip(keys, tier.get(keys)):
                    if value is not None and bytes(value) not in versions[key]:
                        failures.append(f"torn or foreign value under {key} ({memoryview(value).nbytes} bytes)")
                        return

        threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
        threads += [threading.Thread(target=reader) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not failures, failures[0]
        tier.flush()
        for key, value in zip(keys, tier.get(keys)):
            assert value is None or bytes(value) in versions[key]

    # --- lifecycle ------------------------------------------------------------------

    def test_close_is_idempotent_and_later_calls_fail(self, tier_factory: Callable[..., StorageTier]) -> None:
        tier = tier_factory(None)
        tier.put([(key_for("c"), b"1")])
        tier.close()
        tier.close()
        with pytest.raises(TierError):
            tier.get([key_for("c")])
        with pytest.raises(TierError):
            tier.put([(key_for("c"), b"2")])


#: The keys the stateful test draws from: few, so sequences revisit them.
_MODEL_KEYS = tuple(key_for(f"model-{i}") for i in range(6))


def _run_against_model(make_tier: Callable[..., StorageTier], budget: int | None, examples: int) -> None:
    """Random put/get/contains/remove sequences on fresh tiers, checked after every step."""

    class TierMatchesModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.tier = make_tier(budget)
            self.tier.remove(list(_MODEL_KEYS))  # a folder or bucket may hold an earlier sequence's keys
            self.tier.flush()
            self.model: dict[str, bytes] = {}

        @rule(
            items=st.lists(
                # few sizes, so an overwrite often keeps the length and only the bytes tell versions apart
                st.tuples(st.sampled_from(_MODEL_KEYS), st.integers(0, 9), st.sampled_from([0, 1, 700, 2_500])),
                max_size=4,
            )
        )
        def put(self, items: list[tuple[str, int, int]]) -> None:
            batch = {key: value_for(f"{key}-{version}", size) for key, version, size in items}  # last one wins
            self.tier.put(list(batch.items()))
            self.tier.flush()
            self.model.update(batch)

        @rule(keys=st.lists(st.sampled_from(_MODEL_KEYS), max_size=6))
        def get(self, keys: list[str]) -> None:
            for key, value in zip(keys, self.tier.get(keys), strict=True):
                if budget is None:
                    assert _as_bytes(value) == self.model.get(key), f"get({key}) after the model's history"
                elif value is not None:
                    assert _as_bytes(value) == self.model.get(key), f"get({key}) returned a value never last put"

        @rule(keys=st.lists(st.sampled_from(_MODEL_KEYS), max_size=6))
        def contains(self, keys: list[str]) -> None:
            answers = self.tier.contains(keys)
            assert len(answers) == len(keys)
            for key, present in zip(keys, answers):
                if budget is None or present:
                    assert present == (key in self.model), f"contains({key})"

        @rule(keys=st.lists(st.sampled_from(_MODEL_KEYS), max_size=3))
        def remove(self, keys: list[str]) -> None:
            self.tier.remove(keys)
            self.tier.flush()
            for key in keys:
                self.model.pop(key, None)
            assert self.tier.contains(keys) == [False] * len(keys)

        @invariant()
        def stats_agree(self) -> None:
            stats = self.tier.stats()
            if budget is None:
                assert stats.items == len(self.model), f"stats.items {stats.items}, model {len(self.model)}"
            else:
                assert stats.bytes_used <= budget and stats.items <= len(self.model)

        def teardown(self) -> None:
            self.tier.close()

    run_state_machine_as_test(
        TierMatchesModel,
        settings=settings(
            max_examples=examples,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,  # sequences depend on the tier under test, not worth replaying across runs
        ),
    )
