"""Chunk keys: stable across processes, chained, and isolated by fingerprint."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug import ExtraKey, Fingerprint
from kvplug.core.keys import KeyBuilder

BASE = Fingerprint(
    model_id="meta-llama/Llama-3-8B", kv_layout="vllm_flash:L32:B16:H8:D128:bfloat16", dtype="bfloat16", block_size=16
)
TOKENS = list(range(1000, 1000 + 70))

#: A different value for every fingerprint field.
CHANGES = {
    "model_id": "meta-llama/Llama-3-70B",
    "model_revision": "abc123",
    "engine_variant": "cpu_attn=amx",
    "dtype": "float16",
    "kv_layout": "vllm_flash:L32:B16:H8:D128:float16",
    "block_size": 32,
    "format_version": "v2",
    "serializer": "other",
    "kv_heads": "0-2/4",
    "tp_rank": 1,
    "tp_size": 2,
    "pp_rank": 1,
    "pp_size": 2,
    "lora_id": "adapter-7",
    "cache_salt": "tenant-b",
}


def test_every_fingerprint_field_is_covered() -> None:
    assert set(CHANGES) == {f.name for f in dataclasses.fields(Fingerprint)}


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_changing_any_fingerprint_field_changes_every_key(field: str) -> None:
    builder = KeyBuilder(chunk_size=16)
    base = builder.keys(TOKENS, BASE, include_partial=True)
    same = builder.keys(TOKENS, dataclasses.replace(BASE), include_partial=True)
    changed = builder.keys(TOKENS, dataclasses.replace(BASE, **{field: CHANGES[field]}), include_partial=True)
    assert [k.key for k in same] == [k.key for k in base]  # the paired positive
    assert len(changed) == len(base) == 5
    assert not {k.key for k in changed} & {k.key for k in base}


def test_keys_are_hex_and_versioned() -> None:
    for name, width in (("sha256", 64), ("xxh3_128", 32), ("blake3", 64)):
        for key in KeyBuilder(16, name).keys(TOKENS, BASE):
            assert re.fullmatch(rf"v1/[0-9a-f]{{32}}/[0-9a-f]{{{width}}}", key.key), key.key


def test_hash_functions_give_different_keys() -> None:
    keys = {name: KeyBuilder(16, name).keys(TOKENS, BASE)[0].key for name in ("sha256", "xxh3_128", "blake3")}
    assert len(set(keys.values())) == 3


def test_unknown_hash_is_refused() -> None:
    with pytest.raises(ValueError, match="md5"):
        KeyBuilder(16, "md5")  # type: ignore[arg-type]


_KEYS_SCRIPT = """
import json, torch
from kvplug import Fingerprint, ExtraKey
from kvplug.core.keys import KeyBuilder
fp = Fingerprint(model_id="m", kv_layout="l", dtype="bfloat16", block_size=16, cache_salt="s")
out = {}
for name in ("sha256", "xxh3_128", "blake3"):
    keys = KeyBuilder(16, name).keys(torch.arange(100), fp, extra_keys=(ExtraKey(20, 40, "img"),), include_partial=True)
    out[name] = [k.key for k in keys]
print(json.dumps(out))
"""


def test_keys_are_identical_across_processes_with_different_hash_seeds() -> None:
    results = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(run.stdout))
    assert results[0] == results[1]
    assert all(len(keys) == 7 for keys in results[0].values())


@settings(deadline=None)  # a loaded CI machine can take 200 ms for one example
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=100), st.integers(1, 99))
def test_a_prefix_shares_exactly_its_whole_chunks(tokens: list[int], cut: int) -> None:
    builder = KeyBuilder(chunk_size=8)
    full = builder.keys(tokens, BASE)
    prefix = builder.keys(tokens[:cut], BASE)
    assert [k.key for k in prefix] == [k.key for k in full[: len(prefix)]]
    assert len(prefix) == min(cut, len(tokens)) // 8


def test_a_changed_token_changes_its_chunk_and_every_later_one() -> None:
    builder = KeyBuilder(chunk_size=10)
    other = list(TOKENS)
    other[25] += 1
    a, b = builder.keys(TOKENS, BASE), builder.keys(other, BASE)
    assert [x.key == y.key for x, y in zip(a, b)] == [True, True, False, False, False, False, False]


def test_extra_keys_change_the_chunks_they_overlap_and_all_after() -> None:
    builder = KeyBuilder(chunk_size=10)
    plain = builder.keys(TOKENS, BASE)
    image_a = builder.keys(TOKENS, BASE, extra_keys=(ExtraKey(22, 31, "image-a"),))
    image_b = builder.keys(TOKENS, BASE, extra_keys=(ExtraKey(22, 31, "image-b"),))
    assert [p.key == a.key for p, a in zip(plain, image_a)] == [True, True, False, False, False, False, False]
    assert [a.key == b.key for a, b in zip(image_a, image_b)] == [True, True, False, False, False, False, False]


@given(st.integers(1, 69), st.integers(1, 16))
def test_an_adapter_source_changes_every_chunk_and_its_tails_alike_for_every_prompt_length(
    cut: int, chunk: int
) -> None:
    """It covers the first token only, so a prefix of the prompt keys its chunks (whole and
    partial) exactly as the whole prompt does, and the chain carries it into all of them."""
    builder = KeyBuilder(chunk_size=chunk)
    v1, v2 = (ExtraKey.adapter_source("/adapters/sql-v1"),), (ExtraKey.adapter_source("/adapters/sql-v2"),)
    whole = builder.keys(TOKENS, BASE, extra_keys=v1, include_partial=True)
    prefix = builder.keys(TOKENS[:cut], BASE, extra_keys=v1, include_partial=True)
    assert [k.key for k in prefix if k.num_tokens == chunk] == [k.key for k in whole[: cut // chunk]]
    others = builder.keys(TOKENS[:cut], BASE, extra_keys=v2, include_partial=True)
    plain = builder.keys(TOKENS[:cut], BASE, include_partial=True)
    assert not {k.key for k in prefix} & ({k.key for k in others} | {k.key for k in plain})


def test_partial_chunk_only_when_asked_and_tensors_equal_lists() -> None:
    builder = KeyBuilder(chunk_size=16)
    assert [k.num_tokens for k in builder.keys(TOKENS, BASE)] == [16, 16, 16, 16]
    with_partial = builder.keys(torch.tensor(TOKENS), BASE, include_partial=True)
    assert [k.num_tokens for k in with_partial] == [16, 16, 16, 16, 6]
    assert [k.key for k in with_partial[:4]] == [k.key for k in builder.keys(TOKENS, BASE)]


def test_for_request_sets_salt_and_lora() -> None:
    fp = BASE.for_request(cache_salt="x", lora_id="y")
    assert (fp.cache_salt, fp.lora_id) == ("x", "y") and fp.hexdigest() != BASE.hexdigest()


#: The key of TOKENS[:16]'s chunk under BASE for an adapter loaded from "/adapters/sql-v1", as
#: kvplug stored it before :meth:`ExtraKey.adapter_keys` (chunks stored then must still hit).
ADAPTER_CHUNK = "b26471053e0d4adf3b5869c70d11dbc13038d265f6bc31358ae3b3d645416336"


def test_adapter_keys_are_the_adapter_source_key_or_none_without_a_source() -> None:
    """One helper for every place that keys a LoRA request (the vLLM adapter, ``kvplug ctl``,
    ``kvplug explain``, pins): the chunk keys it gives are those stored before it existed."""
    path = "/adapters/sql-v1"
    assert ExtraKey.adapter_keys(path) == (ExtraKey.adapter_source(path),)
    assert ExtraKey.adapter_keys(None) == ExtraKey.adapter_keys("") == ()
    [key] = KeyBuilder(chunk_size=16).keys(TOKENS[:16], BASE, extra_keys=ExtraKey.adapter_keys(path))
    assert key.key.endswith("/" + ADAPTER_CHUNK)
