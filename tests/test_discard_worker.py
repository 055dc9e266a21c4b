"""The chain's removal thread (:mod:`kvplug.core.chain.discards`) against the chain's other ways
of forgetting writes: a removal by name (``kvplug ctl clear``, an engine's cache reset) and a
close that gives up (:meth:`TierChain.discard_queued_writes`).

Real cpu tiers; the one fault a test cannot cause for real, a tier whose compare-and-delete
hangs (a remote store until its deadline), is a gate the test opens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from kvplug import Buffer, TierChain
from kvplug.core.chain.removal import RemoveKeys
from kvplug.testing import key_for, tier_context, value_for

WAIT_S = 30.0


class HungCompare:
    """A real cpu tier whose ``remove_if_same`` waits at ``gate`` (each call notes its keys)."""

    def __init__(self) -> None:
        from kvplug_cpu import CPUTier

        self.gate = threading.Event()
        self.entered = threading.Event()
        self.compared: list[str] = []
        #: While set, a put waits at ``put_gate`` (``putting`` set): a write in progress.
        self.hold_puts = False
        self.put_gate = threading.Event()
        self.putting = threading.Event()
        hung = self

        class Tier(CPUTier):
            def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
                if hung.hold_puts:
                    hung.putting.set()
                    assert hung.put_gate.wait(WAIT_S), "the test never opened the put gate"
                super().put(items)

            def remove_if_same(self, items: Sequence[tuple[str, Buffer]]) -> None:
                hung.entered.set()
                assert hung.gate.wait(WAIT_S), "the test never opened the gate"
                hung.compared.extend(key for key, _ in items)
                super().remove_if_same(items)

        self.tier = Tier(Tier.Config(max_bytes="16MiB"), tier_context())


@pytest.fixture
def hung() -> Iterator[HungCompare]:
    hung = HungCompare()
    yield hung
    hung.gate.set()
    hung.put_gate.set()


def test_a_clear_cancels_a_put_held_back_behind_a_removal(hung: HungCompare) -> None:
    """A put asked for before a clear of its key must not land after the clear."""
    chain = TierChain([hung.tier])
    key, bad, good = key_for("k"), value_for("bad", 2000), value_for("good", 2000)
    try:
        chain.put([(key, bad)])
        chain.discard_later([(key, bad)])  # a load found it unusable
        assert hung.entered.wait(WAIT_S)  # the removal hangs in the tier
        chain.put([(key, good)])  # a store of it again: held back behind the removal
        chain.remove(RemoveKeys([key]))  # kvplug ctl clear: the key is cleared
        hung.gate.set()
        chain.flush()
        assert hung.tier.contains([key]) == [False], "a put asked for before the clear landed after it"
    finally:
        hung.gate.set()
        chain.close()


def test_a_clear_waits_for_a_held_back_put_being_written(hung: HungCompare) -> None:
    """The held-back put is already being written when the clear comes: the clear removes
    the key after that write, not before it (the write would bring the key back)."""
    chain = TierChain([hung.tier])
    key, bad = key_for("k"), value_for("bad", 2000)
    try:
        chain.put([(key, bad)])
        chain.discard_later([(key, bad)])
        assert hung.entered.wait(WAIT_S)
        hung.hold_puts = True
        chain.put([(key, value_for("good", 2000))])  # held back behind the removal
        hung.gate.set()  # the removal lands; the held-back put begins, and waits in the tier
        assert hung.putting.wait(WAIT_S)
        clearing = threading.Thread(target=chain.remove, args=(RemoveKeys([key]),))
        clearing.start()
        clearing.join(0.5)  # (a clear that does not wait for the write is done by now)
        hung.put_gate.set()
        clearing.join(WAIT_S)
        assert not clearing.is_alive()
        chain.flush()
        assert hung.tier.contains([key]) == [False], "the held-back write in progress landed after the clear"
    finally:
        hung.gate.set()
        hung.put_gate.set()
        chain.close()


def test_a_clear_of_one_tier_leaves_a_held_back_put_to_the_others(hung: HungCompare) -> None:
    """``kvplug ctl clear --tier 1`` clears tier 1 alone: the held-back put of a cleared key
    does not land in tier 1 after the clear, and still reaches tier 0, which was not cleared."""
    from kvplug_cpu import CPUTier

    other = CPUTier(CPUTier.Config(max_bytes="16MiB"), tier_context())
    chain = TierChain([hung.tier, other])
    key, bad, good = key_for("k"), value_for("bad", 2000), value_for("good", 2000)
    try:
        chain.put([(key, bad)])
        chain.discard_later([(key, bad)])
        assert hung.entered.wait(WAIT_S)  # the removal hangs in tier 0
        chain.put([(key, good)])  # held back behind the removal
        chain.remove(RemoveKeys([key]), tiers={1})
        hung.gate.set()
        chain.flush()
        assert other.contains([key]) == [False], "a put asked for before the clear landed in the cleared tier"
        assert hung.tier.contains([key]) == [True], "the clear of tier 1 dropped tier 0's held-back put"
        assert bytes(hung.tier.get([key])[0]) == good
    finally:
        hung.gate.set()
        chain.close()


def test_a_clear_leaves_the_held_back_puts_of_other_keys(hung: HungCompare) -> None:
    chain = TierChain([hung.tier])
    key, other, bad = key_for("k"), key_for("other"), value_for("bad", 2000)
    try:
        chain.put([(key, bad)])
        chain.discard_later([(key, bad)])
        assert hung.entered.wait(WAIT_S)
        chain.put([(key, value_for("good", 2000)), (other, value_for("other", 2000))])
        chain.discard_later([(other, value_for("stale", 2000))])  # queued behind: the other key is held back too
        chain.put([(other, value_for("other", 2000))])
        chain.remove(RemoveKeys([key]))
        hung.gate.set()
        chain.flush()
        assert hung.tier.contains([key, other]) == [False, True]
        assert hung.tier.get([other])[0] == value_for("other", 2000)
    finally:
        hung.gate.set()
        chain.close()


def test_a_close_that_gives_up_drops_the_queued_removals_too(hung: HungCompare) -> None:
    """:meth:`TierChain.discard_queued_writes` (SGLang's close past its wait) lets a draining
    close end once the removal in hand returns, not after every queued one."""
    chain = TierChain([hung.tier])
    keys = [key_for(f"k{i}") for i in range(3)]
    for key in keys:
        chain.put([(key, value_for(key, 2000))])
    for key in keys:  # three loads, three removals: the first hangs, two wait behind it
        chain.discard_later([(key, value_for(key, 2000))])
    assert hung.entered.wait(WAIT_S)
    closing = threading.Thread(target=chain.close)
    closing.start()
    try:
        assert chain.discard_queued_writes() == 2
    finally:
        hung.gate.set()
        closing.join(WAIT_S)
    assert not closing.is_alive()
    assert hung.compared == keys[:1], "the close still did the removals queued behind the hung one"
