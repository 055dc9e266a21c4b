"""The control protocol's decoder under hypothesis: whatever bytes arrive, it returns a
request or raises ControlProtocolError (VersionMismatch included), nothing else, so that
one request can only ever end its own connection (docs/security.md)."""

from __future__ import annotations

import json
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug.core.control.protocol import MAX_HEADER_BYTES, ControlRequest, decode_request, encode_request
from kvplug.errors import ControlProtocolError

_LEN = struct.Struct("<I")

#: JSON values with odd types and sizes: huge and negative numbers, floats, deep lists and objects.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=30,
)
fields = st.dictionaries(
    st.sampled_from(["cache_salt", "lora_id", "extra_keys", "tier", "all", "salt", "tokens", "x"]), json_values
)


def decoded(body: bytes) -> ControlRequest | None:
    try:
        return decode_request(body)
    except ControlProtocolError:
        return None


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=300))
def test_any_bytes_are_a_request_or_a_protocol_error(body: bytes) -> None:
    decoded(body)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    op=st.sampled_from(["info", "stats", "tiers", "lookup", "explain", "pin", "unpin", "clear", "drop"]),
    header=fields,
    tokens=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=20),
    version=st.sampled_from([None, 0, 2, "1"]),
)
def test_headers_of_odd_fields_are_a_request_or_a_protocol_error(
    op: str, header: dict[str, object], tokens: list[int], version: int | None
) -> None:
    decoded(encode_request(op, header, tokens, version=version) if len(json.dumps(header)) < 60_000 else b"")


@settings(max_examples=30, deadline=None)
@given(depth=st.integers(min_value=1, max_value=MAX_HEADER_BYTES // 2 - 40), opener=st.sampled_from(["[", '{"a":']))
def test_deep_nesting_within_the_size_limit_is_a_protocol_error(depth: int, opener: str) -> None:
    text = ('{"v": 1, "op": "lookup", "cache_salt": ' + opener * depth)[: MAX_HEADER_BYTES - 8]
    header = text.encode()
    assert decoded(_LEN.pack(len(header)) + header) is None


@settings(max_examples=50, deadline=None)
@given(digits=st.integers(min_value=1, max_value=40_000))
def test_huge_numbers_are_a_protocol_error_or_a_field_error(digits: int) -> None:
    header = ('{"v": 1, "op": "lookup", "lora_id": ' + "9" * digits + "}").encode()[:MAX_HEADER_BYTES]
    decoded(_LEN.pack(len(header)) + header)
