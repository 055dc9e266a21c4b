"""A CacheEngine over cpu + disk tiers under random stores, retrieves and corrupted files.

As in a real model, the KV of a token here is a function of the token prefix: token
``t`` of a prompt holds KV derived from ``tokens[:t + 1]``. So whatever the engine
loads can be checked exactly, whatever happened before. Every token it marks loaded
must hold its prefix's KV; nothing outside the loaded tokens is written; the loaded
tokens form a prefix. While no file was corrupted, everything stored (the disk tier is
unbounded) must load back, even after the small cpu tier evicted it or the engine restarted.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import torch
from core_helpers import SGLANG_MHA
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config
from kvplug.core.plugins import PluginRegistry

LAYOUT = KVLayout(SGLANG_MHA, num_layers=2, block_size=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
CHUNK = 8
NUM_SLOTS = 48
ROW_BYTES = LAYOUT.num_kv_heads * LAYOUT.head_dim * 4
BASE = list(range(1000, 1040))
#: Prompts that share prefixes of 16, 8 and 24 tokens with the first one.
PROMPTS = [
    BASE,
    BASE[:16] + list(range(2000, 2024)),
    BASE[:8] + list(range(3000, 3032)),
    BASE[:24] + list(range(4000, 4016)),
]
SENTINEL = 0xAB


def prefix_kv(prefix: list[int]) -> torch.Tensor:
    """The KV of the last token of ``prefix``: ``[layers, K|V, row bytes]`` of uint8."""
    seed = hashlib.sha256(",".join(map(str, prefix)).encode()).digest()
    rows = LAYOUT.num_layers * 2 * ROW_BYTES
    stream = b"".join(hashlib.sha256(seed + bytes([i])).digest() for i in range(-(-rows // 32)))
    return torch.frombuffer(bytearray(stream[:rows]), dtype=torch.uint8).view(LAYOUT.num_layers, 2, ROW_BYTES)


def empty_caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    def buffer() -> torch.Tensor:
        raw = torch.full((NUM_SLOTS, LAYOUT.num_kv_heads, LAYOUT.head_dim * 4), SENTINEL, dtype=torch.uint8)
        return raw.view(LAYOUT.dtype)

    return [(buffer(), buffer()) for _ in range(LAYOUT.num_layers)]


def row(caches: list, layer: int, kv: int, slot: int) -> torch.Tensor:
    return caches[layer][kv][slot].view(torch.uint8).reshape(-1)


def write_prompt(tokens: list[int], slots: list[int]) -> list:
    caches = empty_caches()
    for t, slot in enumerate(slots):
        kv = prefix_kv(tokens[: t + 1])
        for layer in range(LAYOUT.num_layers):
            for k in range(2):
                row(caches, layer, k, slot).copy_(kv[layer, k])
    return caches


class EngineLoadsOnlyTheRightKV(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="kvplug-stateful-"))
        self.engine = self._open()
        self.stored: set[tuple[int, ...]] = set()  # token prefixes of every whole chunk stored
        self.corrupted = 0

    def _open(self) -> CacheEngine:
        registry = PluginRegistry(plugin_filter="cpu,disk")
        chunk_bytes = CHUNK * LAYOUT.bytes_per_token() + 4096
        tiers = [{"type": "cpu", "max_bytes": 3 * chunk_bytes}, {"type": "disk", "path": str(self.folder)}]
        extra = {
            "kvplug": {
                "chunk_size": CHUNK,
                "save_unfull_chunk": False,
                "store": {"queue": {"mode": "sync"}},
                "tiers": tiers,
            }
        }
        config = load_config(engine_extra=extra, env={}, registry=registry).config
        return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="prefix-kv"), registry=registry)

    @rule()
    def restart(self) -> None:
        """A new engine process on the same folder: an empty cpu tier, the disk tier's index rebuilt."""
        self.engine.close()
        self.engine = self._open()

    @rule(which=st.integers(0, len(PROMPTS) - 1), length=st.integers(1, 40), order=st.permutations(range(NUM_SLOTS)))
    def store(self, which: int, length: int, order: list[int]) -> None:
        tokens, slots = PROMPTS[which][:length], order[:length]
        self.engine.store(tokens, write_prompt(tokens, slots), torch.tensor(slots))
        self.engine.flush()
        self.stored.update(tuple(tokens[:end]) for end in range(CHUNK, length + 1, CHUNK))

    @rule(which=st.integers(0, len(PROMPTS) - 1), length=st.integers(1, 40), order=st.permutations(range(NUM_SLOTS)))
    def retrieve(self, which: int, length: int, order: list[int]) -> None:
        tokens, slots = PROMPTS[which][:length], order[:length]
        claimed = self.engine.lookup(tokens)
        caches = empty_caches()
        loaded = self.engine.retrieve(tokens, caches, torch.tensor(slots))
        count = int(loaded.sum())
        assert bool(loaded[:count].all()), "loaded tokens are not a prefix"
        assert count <= claimed, f"loaded {count} tokens, lookup said {claimed}"
        for t, slot in enumerate(slots):
            for layer in range(LAYOUT.num_layers):
                for k in range(2):
                    got = row(caches, layer, k, slot)
                    if t < count:
                        assert torch.equal(got, prefix_kv(tokens[: t + 1])[layer, k]), f"wrong KV at token {t}"
                    else:
                        assert bool((got == SENTINEL).all()), f"token {t} was not loaded but written"
        if not self.corrupted:
            expected = 0
            while expected + CHUNK <= length and tuple(tokens[: expected + CHUNK]) in self.stored:
                expected += CHUNK
            assert count == expected, f"loaded {count} of {expected} stored tokens"

    @rule(pick=st.integers(0, 10**6), offset=st.integers(0, 10**6), flip=st.integers(1, 255), in_kv=st.booleans())
    def corrupt_a_file(self, pick: int, offset: int, flip: int, in_kv: bool) -> None:
        """Flip bits of a stored record: anywhere, or in its KV bytes (only checksums can tell)."""
        files = sorted(self.folder.rglob("*.kvr"))
        if not files:
            return
        path = files[pick % len(files)]
        data = bytearray(path.read_bytes())
        kv_bytes = CHUNK * LAYOUT.bytes_per_token()  # the payload is the record's tail
        # A record shorter than one chunk's KV is the fingerprint manifest: any byte of it.
        in_kv = in_kv and len(data) > kv_bytes
        position = len(data) - 1 - offset % kv_bytes if in_kv else offset % len(data)
        data[position] ^= flip
        path.write_bytes(bytes(data))
        self.corrupted += 1

    def teardown(self) -> None:
        self.engine.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def test_random_stores_retrieves_and_corruptions_never_load_wrong_kv() -> None:
    run_state_machine_as_test(
        EngineLoadsOnlyTheRightKV,
        settings=settings(
            max_examples=30,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
