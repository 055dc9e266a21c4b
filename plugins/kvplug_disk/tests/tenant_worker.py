"""A separate process using a folder tier with tenant quotas, for the shared-folder quota tests.

    python tenant_worker.py KIND PATH NAME QUOTA PIN

KIND is ``disk`` or ``shm``. The tier has ``quotas: {tenant-a: QUOTA}`` and a budget far
above every record the tests store, so only quotas evict. It prints ``ready``, then obeys
stdin, one command a line, answering each with one line:

    put TENANT COUNT   store COUNT new records of TENANT (``none``: unsalted), one put each: ``done``
    pin TENANT NAME    store the record NAME of TENANT and pin it: ``pinned``
    stats              ``stats`` and this tier's stats().extra as JSON
    close              close the tier: ``closed``, and exit

Keys are the pins contract's (:func:`kvplug.testing.pins_contract.key_of`): each tenant's
own fingerprint, noted in the tier's tenancy, so this process knows every record's tenant.
"""

from __future__ import annotations

import json
import sys

from kvplug import TierChain
from kvplug.core.pins import pin_keys
from kvplug.testing import pins_context, value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk import DiskTier, ShmTier

VALUE = 1000
#: Far above what the tests store: only the quota evicts.
BUDGET = 1 << 30


def main(argv: list[str]) -> None:
    kind, path, name, quota = argv[0], argv[1], argv[2], int(argv[3])
    tier_type = ShmTier if kind == "shm" else DiskTier
    context = pins_context()
    config = tier_type.Config(  # type: ignore[call-arg]
        path=path, fsync=False, max_bytes=BUDGET, quotas={"tenant-a": quota}, queue={"mode": "sync"}
    )
    tier = tier_type(config, context)
    chain = TierChain([tier])
    chain.tenancy = context.tenancy
    written = 0
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "put":
            tenant = None if args[0] == "none" else args[0]
            for _ in range(int(args[1])):
                key = key_of(tenant, f"{name}-{written}")
                written += 1
                tier.put([(key, value_for(key, VALUE))])
            print("done", flush=True)
        elif command == "pin":
            key = key_of(args[0], args[1])
            tier.put([(key, value_for(key, VALUE))])
            print("pinned" if pin_keys(chain, [key]).chunks == 1 else "refused", flush=True)
        elif command == "stats":
            print("stats", json.dumps(tier.stats().extra), flush=True)
        elif command == "close":
            tier.close()
            print("closed", flush=True)
            return
        else:
            raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
