"""``kvplug ctl`` and HiCache backends: a clear of a backend whose disk tier another server
shares removes the pages its own writes put there, never the other server's; every rank of
an attention-DP and attention-CP server answers on a socket of its own.

Two real ``KVPlugStorage`` backends (built by SGLang's StorageBackendFactory, each with its
control server) share a real disk folder; the clear is a real control request on A's socket.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sglang_hicache import PAGE, make_backend, make_host, page_keys, random_pages
from test_sglang_hicache_shared import attention_dp_cp_backends

from kvplug.core.control.client import RankEndpoint, ask, missing_ranks


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


def test_attention_cp_peers_under_attention_dp_answer_on_sockets_of_their_own(socket_dir: Path) -> None:
    """SGLang hands a HiCache backend the attention-TP rank under attention DP: both
    attention-CP peers of a DP group get tp_rank 0. Each rank says its place in its group
    (``dp0/tp0``, ``dp0/tp1``, ...), so their control sockets differ and ``kvplug ctl`` finds
    every rank, none missing."""
    backends = attention_dp_cp_backends(make_host("layer_first"), {"tiers": [{"type": "cpu"}]})
    try:
        ranks = [RankEndpoint(b.control.path, ask(b.control.path, "info")) for b in backends if b.control is not None]
        # What a rank's socket is named by (each rank is a process of its own, one engine id).
        places = [(r.info["dp_rank"], r.info["pp_rank"], r.info["tp_rank"], r.info["tp_size"]) for r in ranks]
    finally:
        for backend in backends:
            backend.close()
    assert places == [(0, 0, 0, 2), (0, 0, 1, 2), (1, 0, 0, 2), (1, 0, 1, 2)]
    assert missing_ranks(ranks) == []
