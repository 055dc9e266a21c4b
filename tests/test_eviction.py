"""kvplug's eviction policies (kvplug.core.policies.eviction.LRUPolicy, kvplug.core.policies.eviction.S3FIFOPolicy) under random use by a
byte-bounded owner: the budget always holds, ``lru`` evicts exactly in least-recently-used
order, ``s3fifo`` keeps a working set read at least twice through a scan of one-off keys
several times the budget (which ``lru`` loses), and its queues and ghost stay bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.core.policies.eviction import EvictionPolicy, LRUPolicy, S3FIFOPolicy, make_eviction_policy

BUDGET = 64

# (operation, key number, size): insert, access or remove one of a few keys, so they repeat.
OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "access", "remove"]), st.integers(0, 40), st.integers(1, 16)),
    max_size=300,
)


class Owner:
    """A byte-bounded store of sizes driven like the cpu tier drives its policy."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.sizes: dict[str, int] = {}
        self.evicted: list[str] = []

    def apply(self, op: str, key: str, size: int) -> None:
        if op == "insert":
            self.sizes[key] = size
            self.policy.inserted(key, size)
            while sum(self.sizes.values()) > BUDGET:
                popped = self.policy.pop_victim()
                assert popped is not None
                victim, victim_size = popped
                assert self.sizes.pop(victim) == victim_size
                self.evicted.append(victim)
        elif op == "access":
            if key in self.sizes:
                self.policy.accessed(key)
        elif key in self.sizes:
            del self.sizes[key]
            self.policy.removed(key)


def check_s3fifo(policy: S3FIFOPolicy) -> None:
    state = policy.state()
    assert state["small_items"] + state["main_items"] == state["items"] == len(policy)
    assert state["small_bytes"] + state["main_bytes"] == state["bytes"]
    assert state["ghost_items"] <= max(1, int(S3FIFOPolicy.GHOST_SHARE * state["items"]))
    assert all(0 <= freq <= S3FIFOPolicy.MAX_FREQ for freq in policy._freq.values())
    assert not set(policy._ghost) & set(policy._freq)  # a held key is never a ghost


@settings(max_examples=200, deadline=None)
@given(ops=OPS, name=st.sampled_from(["lru", "s3fifo"]))
def test_the_budget_holds_and_the_policy_holds_exactly_the_owners_keys(ops, name) -> None:
    owner = Owner(make_eviction_policy(name))
    for op, number, size in ops:
        owner.apply(op, f"k{number}", size)
        assert sum(owner.sizes.values()) <= BUDGET
        assert owner.policy.bytes_used == sum(owner.sizes.values())
        assert len(owner.policy) == len(owner.sizes)
        assert all(key in owner.policy for key in owner.sizes)
        if isinstance(owner.policy, S3FIFOPolicy):
            check_s3fifo(owner.policy)
    drained = owner.policy.victims(BUDGET + 1)  # the rest, as victims
    assert sorted(key for key, _ in drained) == sorted(owner.sizes)
    assert len(owner.policy) == 0 and owner.policy.bytes_used == 0 and owner.policy.pop_victim() is None


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_lru_evicts_exactly_in_least_recently_used_order(ops) -> None:
    owner = Owner(LRUPolicy())
    model: list[str] = []  # least recently used first
    model_sizes: dict[str, int] = {}
    model_evicted: list[str] = []
    for op, number, size in ops:
        key = f"k{number}"
        owner.apply(op, key, size)
        if op == "insert":
            if key in model:
                model.remove(key)
            model.append(key)
            model_sizes[key] = size
            while sum(model_sizes.values()) > BUDGET:
                victim = model.pop(0)
                del model_sizes[victim]
                model_evicted.append(victim)
        elif op == "access" and key in model:
            model.remove(key)
            model.append(key)
        elif op == "remove" and key in model:
            model.remove(key)
            del model_sizes[key]
        assert owner.evicted == model_evicted
        assert owner.policy.order() == model  # type: ignore[attr-defined]


def test_cold_inserts_enter_as_the_first_victims() -> None:
    for policy in (LRUPolicy(), S3FIFOPolicy()):
        policy.inserted("stored", 1)
        policy.accessed("stored")
        policy.inserted("listed-newer", 1, cold=True)
        policy.inserted("listed-older", 1, cold=True)
        assert [key for key, _ in policy.victims(2)] == ["listed-older", "listed-newer"], policy.name


def scan_survivors(policy: EvictionPolicy, working: int, scan_factor: int, size: int) -> int:
    """How many keys of a working set read twice after storing are still held after a scan
    of one-off keys ``scan_factor`` times the budget."""
    owner = Owner(policy)
    hot = [f"hot{i}" for i in range(working)]
    for key in hot:
        owner.apply("insert", key, size)
    for _ in range(2):
        for key in hot:
            owner.apply("access", key, size)
    for i in range(scan_factor * BUDGET // size):
        owner.apply("insert", f"scan{i}", size)
        if isinstance(policy, S3FIFOPolicy):
            check_s3fifo(policy)
    return sum(key in owner.sizes for key in hot)


@settings(max_examples=100, deadline=None)
@given(
    working=st.integers(1, 25),
    scan_factor=st.integers(2, 6),
    size=st.sampled_from([1, 2]),
)
def test_s3fifo_keeps_a_working_set_through_a_scan_that_lru_loses(working, scan_factor, size) -> None:
    # A working set of at most 25 keys of 2 bytes (50 of 64): it fits in main's 90% with room to spare.
    assert scan_survivors(S3FIFOPolicy(), working, scan_factor, size) == working
    assert scan_survivors(LRUPolicy(), working, scan_factor, size) == 0


def test_the_ghost_sends_a_key_evicted_from_small_straight_to_main() -> None:
    policy = S3FIFOPolicy()
    owner = Owner(policy)
    for i in range(BUDGET + 1):  # one key too many: k0 leaves the small queue for the ghost
        owner.apply("insert", f"k{i}", 1)
    assert owner.evicted == ["k0"] and policy.state()["ghost_items"] == 1
    owner.apply("insert", "k0", 1)  # stored again while remembered
    assert "k0" in policy._main and "k0" not in policy._ghost


def test_unknown_policy_names_are_refused() -> None:
    try:
        make_eviction_policy("arc")
    except ValueError as exc:
        assert "arc" in str(exc) and "lru" in str(exc)
    else:
        raise AssertionError("no error")
