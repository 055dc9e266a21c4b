"""``kvplug ctl clear`` of a HiCache backend whose disk tier another server shares: it
removes the pages its own writes put there, never the other server's.

Two real ``KVPlugStorage`` backends (built by SGLang's StorageBackendFactory, each with its
control server) share a real disk folder; the clear is a real control request on A's socket.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sglang_hicache import PAGE, make_backend, make_host, page_keys, random_pages

from kvplug.core.control.client import ask


def test_clear_all_leaves_the_pages_another_server_wrote_to_a_shared_disk_tier(
    tmp_path: Path, socket_dir: Path
) -> None:
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    kvplug = {"tiers": [{"type": "disk", "path": str(tmp_path / "disk")}]}  # written through its queue
    host = make_host("layer_first")
    keys = page_keys(list(range(200, 200 + 3 * PAGE)))
    a, b = make_backend(host, kvplug), make_backend(host, kvplug)
    try:
        assert a.control is not None
        src = random_pages(host, 3, seed=4)
        assert b.batch_set_v1(keys[:2], src[: 2 * PAGE]) == [True, True]
        b.flush()
        # A backs up all three pages (SGLang computed them too); the disk tier already holds
        # B's two and writes only the third.
        assert a.batch_set_v1(keys, src) == [True, True, True]
        a.flush()
        cleared = ask(a.control.path, "clear", {"all_salts": True}, timeout_s=60)
        assert cleared["removed"] == {"0:disk": 1} and cleared["known_chunks"] == 3
        reader = make_backend(host, kvplug)
        try:
            assert reader.batch_exists(keys) == 2  # B's pages stay, and read back verified
            dst = host.alloc(2 * PAGE)
            assert reader.batch_get_v1(keys[:2], dst) == [True, True]
        finally:
            reader.close()
    finally:
        a.close()
        b.close()
