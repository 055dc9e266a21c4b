"""A separate process reading one record of an s3 tier, measuring with tracemalloc the most
memory Python held during the read (run by test_s3_objects.py; the S3 server runs in the
test's process, so its own copies of the object are not counted here).

``python s3_reader_memory.py '<config json>' KEY MAX_RECORD_BYTES``: prints ``<peak bytes> <value bytes>``.
"""

from __future__ import annotations

import json
import sys
import tracemalloc

from kvplug.testing import key_for, tier_context
from kvplug_s3 import S3Tier


def main() -> None:
    options, key, bound = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    tier = S3Tier(S3Tier.Config(**options), tier_context(read_only=True, max_record_bytes=bound))
    tier.get([key_for("warm-up: connections and clients made before measuring")])
    tracemalloc.start()
    (value,) = tier.get([key])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert value is not None, "the record was not read"
    print(peak, memoryview(value).nbytes, flush=True)
    tier.close()


if __name__ == "__main__":
    main()
