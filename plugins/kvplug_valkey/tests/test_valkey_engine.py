"""A CacheEngine with tiers [cpu, valkey] on a real valkey-server: exact KV round trips
(a second engine hits from valkey and promotes to cpu: kvplug's contract suite), a config from YAML, and a lookup
through a hung valkey tier that returns within the engine's lookup budget."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch  # the engine needs torch; the tier itself does not
from valkey_helpers import FAST_FAILING, fresh_prefix

from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, get_registry, load_config
from kvplug.testing import TierRoundTripContract
from kvplug_valkey.fault_proxy import SilentListener

#: The engine format this test's caches use, as the vLLM/SGLang adapters declare it (same name: same fingerprints).
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))

LAYOUT = KVLayout(VLLM_FLASH, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
NUM_BLOCKS = 24


def caches(seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=generator).to(torch.bfloat16) for _ in range(3)]


def engine_for(valkey: dict[str, Any], **settings: Any) -> CacheEngine:
    extra = {
        "kvplug.chunk_size": 8,
        "kvplug.store.queue.mode": "sync",
        "kvplug.tiers": [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "valkey", **valkey}],
        **{f"kvplug.{name}": value for name, value in settings.items()},
    }
    config = load_config(engine_extra=extra, env={}).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="valkey-test"), registry=get_registry())


class TestValkeyRoundTrip(TierRoundTripContract):
    plugins = "cpu,valkey"

    @pytest.fixture
    def tier_entry(self, valkey_server: Any) -> dict[str, Any]:
        return {"type": "valkey", "url": valkey_server.url, "key_prefix": fresh_prefix(), "request_timeout_s": 5.0}


def test_config_from_yaml(valkey_server, tmp_path: Path) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text(f"chunk_size: 8\ntiers:\n  - {{type: valkey, url: redis://127.0.0.1:{valkey_server.port}}}\n")
    config = load_config(config_file=path, env={}).config
    engine = CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="yaml"), registry=get_registry())
    try:
        tokens = list(range(16))
        kv, slots = caches(4), torch.arange(16)
        assert engine.store(tokens, kv, slots) == 16
        engine.flush()
        assert engine.lookup(tokens) == 16
    finally:
        engine.close()


def test_lookup_through_a_hung_valkey_returns_within_the_budget(valkey_server) -> None:
    """The cpu tier holds nothing; valkey accepts connections and never answers. The
    lookup must end within lookup_budget_s (0.2 s) plus a margin, every time."""
    listener = SilentListener()
    engine = engine_for({"url": listener.url, **FAST_FAILING, "request_timeout_s": 2.0})
    try:
        tokens = list(range(5000, 5040))
        times = []
        for _ in range(5):
            started = time.monotonic()
            assert engine.lookup(tokens) == 0
            times.append(time.monotonic() - started)
        assert max(times) < 0.2 + 1.0, times  # budget + margin for a loaded CI machine (a hang would take 2 s)
    finally:
        engine.close()
        listener.close()
