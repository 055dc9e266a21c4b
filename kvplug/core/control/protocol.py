"""The control protocol between ``kvplug ctl`` and a running engine's workers.

One request, one reply, on a private unix socket (:mod:`kvplug.core.control_socket`).
Every message is ``<u32 length>`` + body, and no body is larger than
:data:`MAX_CONTROL_MESSAGE` (a prompt of :data:`MAX_PROMPT_TOKENS` tokens and its header).

A request body is ``<u32 header length>`` + a JSON object + the prompt's token ids as
little-endian int64 (none for ops without a prompt). The header holds ``"v"`` (the
protocol version, :data:`CONTROL_PROTOCOL_VERSION`), ``"op"`` (one of :data:`CONTROL_OPS`)
and the op's fields; a request's ``cache_salt``, ``lora_id`` and ``extra_keys`` are
checked for type and size before use. A reply body is one JSON object: the op's result,
or ``{"error": "...", "kind": "..."}``. No pickle; sizes are checked before anything is
allocated for them.

A server closes the connection of a malformed request (not this framing, not JSON,
an unknown op, a bad field): the client sees the connection closed, the engine nothing.
A well-formed request of another version gets an error reply of kind ``version`` naming
the versions the engine speaks, so the client can say so.
"""

from __future__ import annotations

import json
import socket
import struct
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplug.core.keys import ExtraKey, RequestInfo
from kvplug.errors import ControlError, ControlProtocolError

#: The version of the protocol this kvplug speaks; a server answers only its own.
CONTROL_PROTOCOL_VERSION = 1
#: What a control request may ask.
CONTROL_OPS = frozenset({"info", "stats", "tiers", "lookup", "explain", "pin", "unpin", "clear", "reset"})
#: Most prompt tokens one request may carry (a scheduler's lookup of a long prompt too).
MAX_PROMPT_TOKENS = 2 * 1024 * 1024
#: Largest JSON header of a request (a multimodal prompt's extra keys fill it most).
MAX_HEADER_BYTES = 256 * 1024
#: Largest request or reply body either side accepts (a reply is JSON: an explain of a
#: long prompt lists every chunk).
MAX_CONTROL_MESSAGE = 4 + MAX_HEADER_BYTES + 8 * MAX_PROMPT_TOKENS
MAX_EXTRA_KEYS = 4096
MAX_TEXT = 1024

_LEN = struct.Struct("<I")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_LITTLE = struct.pack("=q", 1) == struct.pack("<q", 1)


@dataclass(frozen=True)
class ControlRequest:
    """One decoded control request."""

    op: str
    fields: Mapping[str, Any]
    tokens: list[int]

    def request_info(self) -> RequestInfo:
        """The request identity the prompt is keyed under (salt, LoRA, extra keys)."""
        return RequestInfo(
            cache_salt=text_field(self.fields, "cache_salt"),
            lora_id=text_field(self.fields, "lora_id"),
            extra_keys=_extra_keys(self.fields.get("extra_keys", [])),
        )


def encode_request(
    op: str, fields: Mapping[str, Any] | None = None, tokens: Sequence[int] = (), *, version: int | None = None
) -> bytes:
    """A request body (without its length prefix)."""
    if len(tokens) > MAX_PROMPT_TOKENS:
        raise ControlProtocolError(f"a prompt of {len(tokens)} tokens: at most {MAX_PROMPT_TOKENS} per request")
    header = json.dumps(
        {**(fields or {}), "v": CONTROL_PROTOCOL_VERSION if version is None else version, "op": op}
    ).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise ControlProtocolError(f"a request header of {len(header)} bytes: at most {MAX_HEADER_BYTES}")
    packed = array("q", tokens)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return _LEN.pack(len(header)) + header + packed.tobytes()


def request_fields(request: RequestInfo | None) -> dict[str, Any]:
    """The header fields that carry ``request``'s identity."""
    if request is None:
        return {}
    return {
        "cache_salt": request.cache_salt,
        "lora_id": request.lora_id,
        "extra_keys": [[k.start, k.end, k.value] for k in request.extra_keys],
    }


class VersionMismatch(ControlProtocolError):
    """A well-formed request of a protocol version this side does not speak."""


def decode_request(body: bytes) -> ControlRequest:
    """Parse a request body; :class:`ControlProtocolError` names what is wrong with it
    (:class:`VersionMismatch` for another protocol version)."""
    if len(body) < _LEN.size:
        raise ControlProtocolError("a message shorter than its header length")
    (header_len,) = _LEN.unpack_from(body)
    if header_len > MAX_HEADER_BYTES or header_len > len(body) - _LEN.size:
        raise ControlProtocolError(
            f"a header of {header_len} bytes: over {MAX_HEADER_BYTES} or longer than the message"
        )
    try:
        header = json.loads(body[_LEN.size : _LEN.size + header_len])
    except (ValueError, UnicodeDecodeError):
        raise ControlProtocolError("the header is not JSON") from None
    except RecursionError:  # e.g. 60,000 '[': within the size limit, past the parser's depth
        raise ControlProtocolError("the header nests too deeply") from None
    if not isinstance(header, dict):
        raise ControlProtocolError("the header is not a JSON object")
    version = header.get("v")
    if version != CONTROL_PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version {str(version)[:20]!r}; this engine speaks version {CONTROL_PROTOCOL_VERSION}"
        )
    op = header.get("op")
    if op not in CONTROL_OPS:
        raise ControlProtocolError(f"unknown op {str(op)[:40]!r}; ops: {', '.join(sorted(CONTROL_OPS))}")
    raw = memoryview(body)[_LEN.size + header_len :]
    if len(raw) % 8 or len(raw) // 8 > MAX_PROMPT_TOKENS:
        raise ControlProtocolError(f"the prompt must be whole int64s, at most {MAX_PROMPT_TOKENS} of them")
    tokens = array("q")
    tokens.frombytes(raw)
    if not _LITTLE:  # pragma: no cover
        tokens.byteswap()
    request = ControlRequest(op, header, tokens.tolist())
    request.request_info()  # the identity fields are checked now: a bad one is a malformed request
    return request


def text_field(fields: Mapping[str, Any], name: str) -> str | None:
    """An optional short string field; :class:`ControlProtocolError` when it is not one."""
    value = fields.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ControlProtocolError(f"{name} must be a string of at most {MAX_TEXT} characters")
    return value


def _extra_keys(raw: Any) -> tuple[ExtraKey, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_EXTRA_KEYS:
        raise ControlProtocolError(f"extra_keys must be a list of at most {MAX_EXTRA_KEYS} [start, end, value]")
    keys = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry[:2])):
            raise ControlProtocolError("an extra key is [start, end, value] with integer start and end")
        if not all(_INT64_MIN <= x <= _INT64_MAX for x in entry[:2]):  # chunk keys hash them as int64
            raise ControlProtocolError(f"an extra key's start and end must be int64; got {entry[0]}, {entry[1]}"[:200])
        value = entry[2]
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise ControlProtocolError(f"an extra key's value must be a string of at most {MAX_TEXT} characters")
        keys.append(ExtraKey(entry[0], entry[1], value))
    return tuple(keys)


def encode_reply(reply: Mapping[str, Any], prompt_tokens: int = 0) -> bytes:
    """A reply body; one too large for a client becomes an error reply saying so, and, for a
    request with a prompt of ``prompt_tokens`` tokens, about how many tokens would fit."""
    body = json.dumps(reply, separators=(",", ":")).encode()
    if len(body) > MAX_CONTROL_MESSAGE:
        message = f"the reply of {len(body)} bytes is over the protocol's limit of {MAX_CONTROL_MESSAGE}"
        # The reply lists every chunk: its size grows with the prompt's, so scale down, with a
        # tenth to spare for what does not grow evenly (digits, fixed fields). 0: no prompt.
        fits = prompt_tokens * MAX_CONTROL_MESSAGE // len(body) * 9 // 10
        if fits:
            message += (
                f": it lists every chunk of the prompt's {prompt_tokens} tokens; send a shorter prompt, at most "
                f"about {fits} tokens (its first {fits}: chunk keys chain from the start, so theirs are this prompt's)"
            )
        return error_reply(message, "too_large")
    return body


def error_reply(message: str, kind: str) -> bytes:
    return json.dumps({"error": message[:4000], "kind": kind}).encode()


# --- the client side of one exchange --------------------------------------------------------


def exchange(sock: socket.socket, request: bytes) -> dict[str, Any]:
    """Send one request body and read its reply; :class:`ControlError` when the server
    closed the connection or sent something that is not a bounded JSON object."""
    try:
        sock.sendall(_LEN.pack(len(request)) + request)
        (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
        if length > MAX_CONTROL_MESSAGE:
            raise ControlError(f"a reply of {length} bytes is over the {MAX_CONTROL_MESSAGE} limit")
        body = _recv_exact(sock, length)
    except OSError as exc:
        raise ControlError(f"the engine's socket failed: {exc}") from exc
    try:
        reply = json.loads(body)
    except ValueError:
        raise ControlError("the engine's reply is not JSON") from None
    if not isinstance(reply, dict):
        raise ControlError("the engine's reply is not a JSON object")
    return reply


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = sock.recv(min(size - len(data), 1 << 20))
        if not part:
            raise ConnectionError("the engine closed the connection (it refused the request)")
        data += part
    return bytes(data)
