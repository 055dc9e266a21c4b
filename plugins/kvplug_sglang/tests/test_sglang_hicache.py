"""KVPlugStorage: SGLang's HiCache L3 backend, built by SGLang's StorageBackendFactory."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang_pools import make_pool

from kvplug import ChunkStore, key_digest
from kvplug_sglang.hicache import KVPlugStorage

PAGE = 4
LAYOUTS = ["layer_first", "page_first"]


def make_host(layout: str, first_layer: int = 0, dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost:
    """A host pool of the model's layers ``first_layer`` on (a pipeline stage's slice of them),
    of a device pool of KV ``dtype``."""
    device = make_pool(size=64, page_size=PAGE, dtype=dtype)
    info = device.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=device.start_layer + first_layer,
        end_layer=device.end_layer + first_layer,
    )


def make_backend(
    host: Any,
    kvplug: dict[str, Any],
    *,
    model: str = "tiny-llama",
    tp_rank: int = 0,
    v1: bool = True,
    stage: tuple[int, int] = (0, 1),
    extra: dict[str, Any] | None = None,
) -> KVPlugStorage:
    """A backend as SGLang's StorageBackendFactory builds it; ``extra``: more of the extra config."""
    config = HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=2,
        pp_rank=stage[0],
        pp_size=stage[1],
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=host.layout == "page_first",
        model_name=model,
        extra_config={
            "backend_name": "kvplug",
            "module_path": "kvplug_sglang.hicache",
            "class_name": "KVPlugStorage",
            "interface_v1": int(v1),
            "kvplug": kvplug,
            **(extra or {}),
        },
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)  # what HiCacheController.attach_storage_backend does next
    return backend


def page_keys(tokens: list[int], cache_salt: str | None = None) -> list[str]:
    """SGLang's own page hash chain (what HiCache names pages by)."""
    key = RadixKey(array("q", tokens), cache_salt=cache_salt)
    keys, prior = [], None
    for start in range(0, len(tokens), PAGE):
        prior = get_storage_hash_str(key[start : start + PAGE], prior, PAGE)
        prior = prior[0] if isinstance(prior, list) else prior
        keys.append(prior)
    return keys


def random_pages(host: MHATokenToKVPoolHost, num_pages: int, seed: int) -> torch.Tensor:
    indices = host.alloc(num_pages * PAGE)
    gen = torch.Generator().manual_seed(seed)
    for i in range(num_pages):
        page = host.get_data_page(int(indices[i * PAGE]), flat=False)
        page.copy_(torch.randn(page.shape, generator=gen).to(page.dtype))
    return indices


def pages_of(host: MHATokenToKVPoolHost, indices: torch.Tensor) -> list[torch.Tensor]:
    return [host.get_data_page(int(indices[i]), flat=True).clone() for i in range(0, len(indices), PAGE)]


# --- tiers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("kvplug_s3", reason="kvplug-s3 is not installed")
    import boto3
    from moto.server import ThreadedMotoServer

    # Port 0: the server binds a port the OS picks (one probed free and let go could be taken first).
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test"
    ).create_bucket(Bucket="kvplug-test")
    yield endpoint
    server.stop()


def tiers_for(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    if kind == "cpu":
        return [{"type": "cpu"}]
    if kind == "disk":
        pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
        return [{"type": "disk", "path": str(tmp_path / "disk")}]
    endpoint = request.getfixturevalue("s3_endpoint")
    return [
        {
            "type": "s3",
            "url": f"s3://kvplug-test/{tmp_path.name}",
            "endpoint_url": endpoint,
            "region": "us-east-1",
            "access_key_id": "test",
            "secret_access_key": "test",
        }
    ]


# --- tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["cpu", "disk", "s3"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_bit_exact(layout: str, tier: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    host = make_host(layout)
    kvplug = {"tiers": tiers_for(tier, tmp_path, request)}
    writer = make_backend(host, kvplug)
    keys = page_keys(list(range(100, 100 + 3 * PAGE)))
    src = random_pages(host, 3, seed=1)
    expected = pages_of(host, src)
    assert writer.batch_set_v1(keys, src) == [True, True, True]
    writer.flush()
    # read back through a second backend: for cpu the same one (memory is per process)
    reader = writer if tier == "cpu" else make_backend(host, kvplug)
    assert reader.batch_exists(keys) == 3
    dst = host.alloc(3 * PAGE)
    assert reader.batch_get_v1(keys, dst) == [True, True, True]
    assert all(torch.equal(a, b) for a, b in zip(expected, pages_of(host, dst)))
    # the generic interface: flat pages in the host's own order
    flat = reader.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(a, b) for a, b in zip(expected, flat))
    for backend in {id(writer): writer, id(reader): reader}.values():
        backend.close()


def test_generic_set_and_cross_layout_read(tmp_path: Path) -> None:
    """Pages written by a page_first server are read by a layer_first one (canonical order)."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    kvplug = {"tiers": [{"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "sync"}}]}
    first_host, second_host = make_host("page_first"), make_host("layer_first")
    writer = make_backend(first_host, kvplug, v1=False)
    keys = page_keys(list(range(5, 5 + 2 * PAGE)))
    src = random_pages(first_host, 2, seed=2)
    assert writer.batch_set(keys, [first_host.get_data_page(int(src[i])) for i in (0, PAGE)])
    reader = make_backend(second_host, kvplug, v1=False)
    dst = second_host.alloc(2 * PAGE)
    assert reader.batch_get_v1(keys, dst) == [True, True]
    for i in (0, PAGE):
        a = first_host.get_data_page(int(src[i]), flat=False).permute(0, 2, 1, 3, 4)  # page_first -> [2, L, ps, H, D]
        assert torch.equal(a, second_host.get_data_page(int(dst[i]), flat=False))
    writer.close()
    reader.close()


def test_batch_exists_stops_at_first_missing_page() -> None:
    host = make_host("layer_first")
    backend = make_backend(host, {"tiers": [{"type": "cpu"}]})
    keys = page_keys(list(range(40, 40 + 4 * PAGE)))
    src = random_pages(host, 4, seed=3)
    stored = [0, 2, 3]
    backend.batch_set_v1([keys[i] for i in stored], torch.cat([src[i * PAGE : (i + 1) * PAGE] for i in stored]))
    assert backend.batch_exists(keys) == 1
    assert backend.exists(keys[2]) and not backend.exists(keys[1])
    assert backend.batch_exists(keys[2:]) == 2
    dst = host.alloc(4 * PAGE)
    assert backend.batch_get_v1(keys, dst)[:2] == [True, False]
    backend.close()


def test_salt_or_model_change_never_hits() -> None:
    host = make_host("page_first")
    backend = make_backend(host, {"tiers": [{"type": "cpu"}]})
    tokens = list(range(60, 60 + 2 * PAGE))
    keys = page_keys(tokens)
    backend.batch_set_v1(keys, random_pages(host, 2, seed=4))
    assert backend.batch_exists(keys) == 2
    salted = page_keys(tokens, cache_salt="tenant-b")
    assert salted != keys and backend.batch_exists(salted) == 0
    # another model or TP rank: same SGLang keys, different kvplug keys, no hit
    for other in (
        make_backend(host, {"tiers": [{"type": "cpu"}]}, model="other-model"),
        make_backend(host, {"tiers": [{"type": "cpu"}]}, tp_rank=1),
    ):
        assert other.storage_key(keys[0]) != backend.storage_key(keys[0])
        assert other.store is not None and backend.store is not None
        other.store.close()  # same storage, as a shared disk or bucket would be
        other.store = ChunkStore(other.store.serializer, other.store.fingerprint, backend.store.chain)
        assert other.batch_exists(keys) == 0
    backend.close()


def _damage(tier: Any, key: str) -> None:
    """Flip a payload byte of the page stored under ``key``, in its record file on disk
    (the disk tier's record checksum covers the whole frame: verified_reads)."""
    digest = key_digest(key).hex()
    (record,) = Path(tier.config.path).glob(f"*/{digest}.kvr")
    data = bytearray(record.read_bytes())
    data[-3] ^= 0x04
    record.write_bytes(bytes(data))


def test_corrupt_page_is_a_miss(tmp_path: Path) -> None:
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    host = make_host("layer_first")
    backend = make_backend(host, {"tiers": [{"type": "disk", "path": str(tmp_path / "disk")}]})
    keys = page_keys(list(range(80, 80 + 3 * PAGE)))
    src = random_pages(host, 3, seed=5)
    backend.batch_set_v1(keys, src)
    backend.flush()
    expected = pages_of(host, src)
    assert backend.store is not None
    _damage(backend.store.chain.tiers[0], backend.storage_key(keys[1]))
    dst = host.alloc(3 * PAGE)
    assert backend.batch_get_v1(keys, dst) == [True, False, False]
    assert torch.equal(pages_of(host, dst)[0], expected[0])
    assert backend.batch_exists(keys) == 1, "the corrupt page is removed"
    backend.close()


def test_pages_are_verified_before_they_are_promoted(tmp_path: Path) -> None:
    """The cpu tier serves its bytes without re-checking them (trusted_reads): a page read
    from disk goes up into it only once it passed its checks."""
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    host = make_host("page_first")
    backend = make_backend(host, {"tiers": [{"type": "cpu"}, {"type": "disk", "path": str(tmp_path / "disk")}]})
    keys = page_keys(list(range(90, 90 + 3 * PAGE)))
    src = random_pages(host, 3, seed=7)
    expected = pages_of(host, src)
    backend.batch_set_v1(keys, src)
    backend.flush()
    assert backend.store is not None
    cpu, disk = backend.store.chain.tiers
    stored = [backend.storage_key(k) for k in keys]
    cpu.remove(stored)  # as if evicted from memory: the next load reads the disk
    _damage(disk, stored[1])
    dst = host.alloc(3 * PAGE)
    assert backend.batch_get_v1(keys, dst) == [True, False, False]
    assert torch.equal(pages_of(host, dst)[0], expected[0])
    # Only the page that passed went up; the damaged one is gone from every tier, and the
    # one after it (the prefix ended before it) stays on disk only.
    assert cpu.contains(stored) == [True, False, False]
    assert disk.contains(stored) == [True, False, True]
    backend.close()


def test_keys_are_hex_and_v2_serves_only_the_kv_pool() -> None:
    host = make_host("page_first")
    backend = make_backend(host, {"tiers": [{"type": "cpu"}]})
    odd_key = "../../etc/passwd\x00 ünïcode"
    version, fingerprint, digest = backend.storage_key(odd_key).split("/")
    assert version == "v1" and len(fingerprint) == 32 and len(digest) == 64
    assert all(c in "0123456789abcdef" for c in fingerprint + digest)
    keys = page_keys(list(range(2 * PAGE)))
    src = random_pages(host, 2, seed=6)
    results = backend.batch_set_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=src, keys=keys),
            PoolTransfer(name=PoolName.MAMBA, host_indices=src, keys=keys),
        ]
    )
    assert results == {"kv": [True, True], "mamba": [False, False]}
    exists = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys)])
    assert exists.kv_hit_pages == 2 and exists.extra_pool_hit_pages == {"mamba": 0}
    dst = host.alloc(2 * PAGE)
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=dst, keys=keys)]) == {"kv": [True, True]}
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, src), pages_of(host, dst)))
    backend.clear()
    assert backend.batch_exists(keys) == 0
    backend.close()


def test_errors_name_the_problem() -> None:
    host = make_host("layer_first")
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name=None,
        extra_config={"backend_name": "kvplug", "module_path": "kvplug_sglang.hicache", "class_name": "KVPlugStorage"},
    )
    with pytest.raises(ValueError, match="model_id"):
        StorageBackendFactory.create_backend("dynamic", config, host)
    config.model_name = "m"
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    with pytest.raises(RuntimeError, match="register_mem_pool_host"):
        backend.exists("k")
    config.extra_config = {**config.extra_config, "read_timeout_s": "soon"}
    with pytest.raises(ValueError, match="read_timeout_s must be a number of seconds > 0.*, got 'soon'"):
        StorageBackendFactory.create_backend("dynamic", config, host)
    # Past threading.TIMEOUT_MAX (about 292 years) a wait raises OverflowError: every read would.
    for too_long in (1e10, float("inf")):
        config.extra_config = {**config.extra_config, "read_timeout_s": too_long}
        with pytest.raises(ValueError, match=f"read_timeout_s must be .* at most .*, got {too_long!r}"):
            StorageBackendFactory.create_backend("dynamic", config, host)
    config.extra_config = {**config.extra_config, "read_timeout_s": 5, "kvplug": {"tiers": [{"type": "nope"}]}}
    with pytest.raises(ValueError, match="tiers\\[0\\].type"):
        StorageBackendFactory.create_backend("dynamic", config, host)
