"""A separate process writing to an s3 tier (run by test_s3_processes.py).

``python s3_writer.py '<config json>' store N``: store N values, print ``stored``.
``python s3_writer.py '<config json>' overwrite``: overwrite 4 keys with ever new
versions until killed, printing one line per put.
"""

from __future__ import annotations

import json
import sys

from kvplug.testing import key_for, tier_context, value_for
from kvplug_s3 import S3Tier

VERSIONS = 4


def version_value(key: str, version: int) -> bytes:
    """Version ``version`` of ``key``'s value: megabytes, so a kill often lands mid-write."""
    version %= VERSIONS
    return value_for(f"{key}-{version}", 2_000_000 + 524_287 * version)


def main() -> None:
    options, mode = json.loads(sys.argv[1]), sys.argv[2]
    tier = S3Tier(S3Tier.Config(**options), tier_context())
    if mode == "store":
        count = int(sys.argv[3])
        tier.put([(key_for(f"p{i}"), value_for(f"p{i}", 3000 + i)) for i in range(count)])
        print("stored", tier.stats().puts, flush=True)
        tier.close()
        return
    keys = [key_for(f"o{i}") for i in range(4)]
    values = {(key, v): version_value(key, v) for key in keys for v in range(VERSIONS)}
    version = 0
    while True:
        key = keys[version % 4]
        tier.put([(key, values[key, version % VERSIONS])])
        print(version, flush=True)
        version += 1


if __name__ == "__main__":
    main()
