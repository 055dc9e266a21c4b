"""Store keys as values (:class:`kvplug.core.keys.StoreKey`): a key is parsed and checked once,
its parts read from the value; a malformed string is a :class:`KeyFormatError` naming the part."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvplug import Fingerprint
from kvplug.core.keys import KeyBuilder, KeyPrefix, StoreKey
from kvplug.errors import KeyFormatError

HEX = "0123456789abcdef"
versions = st.integers(min_value=0, max_value=10**6).map(lambda n: f"v{n}")
fingerprints = st.text(HEX, min_size=32, max_size=32)
digests = st.text(HEX, min_size=32, max_size=128)
keys = st.builds(lambda v, f, d: StoreKey(KeyPrefix(v, f), d), versions, fingerprints, digests)


@given(keys)
def test_a_key_parses_back_to_itself(key: StoreKey) -> None:
    text = str(key)
    assert StoreKey.parse(text) == key
    assert str(StoreKey.parse(text)) == text
    assert KeyPrefix.parse(str(key.prefix)) == key.prefix
    assert text.startswith(str(key.prefix)) and text.endswith(key.digest)
    assert StoreKey.fingerprint_of(text) == key.fingerprint


@pytest.mark.parametrize("hash_name", ["sha256", "xxh3_128", "blake3"])
def test_the_engines_keys_are_store_keys(hash_name: str) -> None:
    fingerprint = Fingerprint("m", "layout", "float16", 16)
    for chunk in KeyBuilder(4, hash_name).keys(list(range(10)), fingerprint, include_partial=True):  # type: ignore[arg-type]
        key = StoreKey.parse(chunk.key)
        assert key.fingerprint == fingerprint.hexdigest() and str(key) == chunk.key


@given(keys, st.sampled_from(["", "/extra", "x/"]))
def test_a_key_of_other_parts_names_its_part_count(key: StoreKey, more: str) -> None:
    text = str(key).replace("/", "", 1) if not more else f"{key}{more}"
    with pytest.raises(KeyFormatError, match=r"parts, not 3"):
        StoreKey.parse(text)
    assert StoreKey.fingerprint_of(text) is None


@given(keys, st.text(min_size=1, max_size=8).filter(lambda s: "/" not in s and not s[1:].isdigit()))
def test_a_bad_version_is_named(key: StoreKey, version: str) -> None:
    text = f"{version}/{key.fingerprint}/{key.digest}"
    with pytest.raises(KeyFormatError, match=r"format version .* is not v<number>"):
        StoreKey.parse(text)


@given(keys, st.integers(min_value=0, max_value=80).filter(lambda n: n != 32))
def test_a_fingerprint_of_another_length_is_named(key: StoreKey, length: int) -> None:
    text = f"{key.prefix.version}/{'a' * length}/{key.digest}"
    with pytest.raises(KeyFormatError, match=rf"fingerprint has {length} characters, not 32"):
        StoreKey.parse(text)


@given(keys, st.integers(min_value=0, max_value=31) | st.integers(min_value=129, max_value=300))
def test_a_digest_of_another_length_is_named(key: StoreKey, length: int) -> None:
    with pytest.raises(KeyFormatError, match=rf"digest has {length} characters, not 32 to 128"):
        StoreKey.parse(f"{key.prefix}{'0' * length}")


@given(keys, st.sampled_from(["fingerprint", "digest"]), st.characters().filter(lambda c: c not in HEX + "/"))
def test_a_part_not_lowercase_hex_is_named(key: StoreKey, part: str, bad: str) -> None:
    fingerprint, digest = key.fingerprint, key.digest
    if part == "fingerprint":
        fingerprint = bad + fingerprint[1:]
    else:
        digest = bad + digest[1:]
    with pytest.raises(KeyFormatError, match=rf"its {part} is not lowercase hex"):
        StoreKey.parse(f"{key.prefix.version}/{fingerprint}/{digest}")


def test_a_key_under_another_prefix_keeps_its_digest() -> None:
    key = StoreKey.parse(f"v1/{'a' * 32}/{'b' * 64}")
    other = KeyPrefix("v1", "c" * 32)
    assert str(key.under(other)) == f"v1/{'c' * 32}/{'b' * 64}" and key.short() == "b" * 12
