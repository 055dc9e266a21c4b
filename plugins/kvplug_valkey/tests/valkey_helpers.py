"""Helpers of the valkey tier tests (a module of its own: ``conftest`` names clash across test folders)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from kvplug.testing import tier_context
from kvplug_valkey import ValkeyTier


def fresh_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}:"


#: Settings that make faults show within a fraction of a second.
FAST_FAILING: dict[str, Any] = {
    "connect_timeout_s": 0.2,
    "request_timeout_s": 0.3,
    "retries": 1,
    "backoff_base_s": 0.01,
    "backoff_max_s": 0.02,
    "breaker_failures": 3,
    "breaker_cooldown_s": 2.0,  # long enough that a stalled CI machine does not half-open it mid-assertion
}
#: FAST_FAILING's breaker and retries (one that counted a redirection or a refused connection
#: wrongly would open within a test), with deadlines a loaded 2-core machine meets: for tests
#: where no node is slow or hung, in which a timeout would be a miss (or a dropped put) the
#: test takes for a record lost.
QUICK_BREAKER: dict[str, Any] = {**FAST_FAILING, "connect_timeout_s": 5.0, "request_timeout_s": 5.0}


def make_valkey_tier(url: str, **options: Any) -> ValkeyTier:
    options.setdefault("key_prefix", fresh_prefix())
    # Tests not about faults must not turn a busy 2-core CI machine into a timeout: fault
    # tests pass FAST_FAILING, which sets its own deadlines.
    options.setdefault("request_timeout_s", 5.0)
    return ValkeyTier(ValkeyTier.Config(url=url, **options), tier_context())


def sockets_to(port: int) -> int:
    """This process's open TCP sockets whose peer is 127.0.0.1:``port`` (Linux /proc)."""
    ours = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue  # closed since listed
        if link.startswith("socket:["):
            ours.add(link[len("socket:[") : -1])
    count = 0
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port and fields[9] in ours:
            count += 1
    return count


def read_hits(tier: Any, keys: list[str], values: dict[str, bytes]) -> list[bool]:
    """Read ``keys``: each the stored value or a miss (an error would raise here); which hit."""
    got = tier.get(keys)
    for key, value in zip(keys, got):
        assert value is None or bytes(value) == values[key], key
    return [value is not None for value in got]
