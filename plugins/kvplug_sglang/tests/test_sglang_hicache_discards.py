"""KVPlugStorage (``ChunkStore`` used directly, on SGLang's scheduler thread): a page that
fails its checks is a miss at once, never waiting for a tier's removal of it, and a page
stored again after that load is kept."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from test_sglang_hicache import make_backend, make_host, page_keys, pages_of, random_pages

from kvplug import Buffer, get_registry, hookimpl

#: How long the test waits for a load; a removal hangs until released (at most HANG_S).
WAIT_S = 30.0
HANG_S = 300.0
_RELEASE, _REMOVING = threading.Event(), threading.Event()


class _Plugin:
    @staticmethod
    @hookimpl
    def kvplug_storage_tiers() -> list[type]:
        from kvplug_cpu import CPUTier

        class SharedPagesTier(CPUTier):
            """A cpu tier without ``trusted_reads``: its pages are verified on load."""

            name = "hicache_shared_pages"
            trusted_reads = False

        class HungRemovalTier(CPUTier):
            """A remote-like tier whose removals hang until the test releases them."""

            name = "hicache_hung_removal"
            trusted_reads = False

            def remove(self, keys: Sequence[str]) -> None:
                _REMOVING.set()
                _RELEASE.wait(HANG_S)
                super().remove(keys)

            def remove_if_same(self, items: Sequence[tuple[str, Buffer]]) -> None:
                self.remove([key for key, _ in items])  # by name, as a tier that cannot compare

        return [SharedPagesTier, HungRemovalTier]


def test_a_corrupt_page_is_a_miss_at_once_while_a_tier_hangs_removing_it() -> None:
    registry = get_registry()
    if not registry.pm.has_plugin("hicache-hung-removal-test"):
        registry.register(_Plugin, "hicache-hung-removal-test")
    _RELEASE.clear()
    _REMOVING.clear()
    host = make_host("layer_first")
    tiers = [{"type": "hicache_shared_pages"}, {"type": "hicache_hung_removal"}]
    backend = make_backend(host, {"tiers": tiers})
    try:
        keys = page_keys(list(range(40, 52)))
        src = random_pages(host, 3, seed=9)
        assert backend.batch_set_v1(keys, src) == [True] * 3
        backend.flush()
        assert backend.store is not None
        shared, hung = backend.store.chain.tiers
        victim = backend.storage_key(keys[1])
        super(type(hung), hung).remove([victim])  # only the shared tier holds it: a load reads it there
        frame = bytearray(shared.get([victim])[0])
        frame[-5] ^= 0x10
        shared.put([(victim, bytes(frame))])

        results: list[list[bool]] = []
        dst = host.alloc(3 * 4)
        loading = threading.Thread(target=lambda: results.append(backend.batch_get_v1(keys, dst)))
        loading.start()
        assert _REMOVING.wait(WAIT_S)  # the removal began, and hangs
        loading.join(WAIT_S)
        hung_load = loading.is_alive()
        if hung_load:
            _RELEASE.set()  # the old way: the load waits for the removal; nothing waits for ever
            loading.join(WAIT_S)
        assert not hung_load, "the load waited for the tier's removal"
        assert results == [[True, False, False]]

        assert backend.batch_set_v1(keys[1:2], src[4:8]) == [True]  # stored again, after the load
        _RELEASE.set()
        backend.flush()
        again = host.alloc(3 * 4)
        assert backend.batch_get_v1(keys, again) == [True] * 3
        assert all(torch.equal(a, b) for a, b in zip(pages_of(host, src), pages_of(host, again)))
    finally:
        _RELEASE.set()
        backend.close()
