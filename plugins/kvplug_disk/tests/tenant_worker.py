"""A separate process using a folder tier with tenant quotas, for the shared-folder quota and pin
tests, and :class:`Worker`, which runs one for a test.

    python tenant_worker.py KIND PATH NAME QUOTA [BUDGET]

KIND is ``disk`` or ``shm``. The tier has ``quotas: {tenant-a: QUOTA}`` and, unless BUDGET
(its ``max_bytes``) is given, a budget far above every record the tests store, so only quotas
evict. It prints ``ready``, then obeys stdin, one command a line, answering each with one line:

    put TENANT COUNT   store COUNT new records of TENANT (``none``: unsalted), one put each: ``done``
    store TENANT NAME  store the record NAME of TENANT: ``stored``
    pin TENANT NAME    store the record NAME of TENANT and pin it: ``pinned``
    want TENANT NAME   pin the record NAME of TENANT before it is stored: ``wanted``
    unpin TENANT NAME  unpin the record NAME of TENANT: ``unpinned``
    stats              ``stats`` and this tier's stats().extra as JSON
    close              close the tier: ``closed``, and exit

Keys are the pins contract's (:func:`kvplug.testing.pins_contract.key_of`): each tenant's
own fingerprint, noted in the tier's tenancy, so this process knows every record's tenant.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvplug import TierChain
from kvplug.core.pins import pin_keys, unpin_keys
from kvplug.core.tenants import DIGEST_LABEL, TENANT_BYTES
from kvplug.testing import pins_context, value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk import DiskTier, ShmTier

VALUE = 1000
#: Far above what the tests store: only the quota evicts.
BUDGET = 1 << 30


def main(argv: list[str]) -> None:
    kind, path, name, quota = argv[0], argv[1], argv[2], int(argv[3])
    budget = int(argv[4]) if len(argv) > 4 else BUDGET
    tier_type = ShmTier if kind == "shm" else DiskTier
    context = pins_context()
    config = tier_type.Config(  # type: ignore[call-arg]
        path=path, fsync=False, max_bytes=budget, quotas={"tenant-a": quota}, queue={"mode": "sync"}
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
        elif command == "store":
            key = key_of(None if args[0] == "none" else args[0], args[1])
            tier.put([(key, value_for(key, VALUE))])
            print("stored", flush=True)
        elif command == "want":
            key = key_of(None if args[0] == "none" else args[0], args[1])
            print("wanted" if pin_keys(chain, [key]).missing == 1 else "not wanted", flush=True)
        elif command == "unpin":
            key = key_of(None if args[0] == "none" else args[0], args[1])
            print("unpinned" if unpin_keys(chain, [key]).chunks == 1 else "not pinned", flush=True)
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


class Worker:
    """One process running this script (for the tests); each command waits for its answer (no timing)."""

    def __init__(self, kind: str, folder: Path, name: str, quota: int, budget: int = BUDGET) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, kind, str(folder), name, str(quota), str(budget)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.expect("ready")

    def ask(self, command: str) -> str:
        self.send(command)
        return self.answer()

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def answer(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line:  # not an AssertionError: a worker that died is no failed check
            raise RuntimeError(f"worker exited with {self.process.wait(60)} without answering")
        return line

    def expect(self, answer: str) -> None:
        got = self.answer()
        if got != answer:
            raise RuntimeError(f"worker answered {got!r}, not {answer!r}")

    def stats(self) -> dict[str, object]:
        line = self.ask("stats")
        return dict(json.loads(line.removeprefix("stats ")))

    def tenant_a_bytes(self, figure: str = TENANT_BYTES) -> int:
        """The tenant-a bytes this process reports as ``figure`` (labelled by a digest: the only
        salt with a quota)."""
        figures = [value for key, value in self.stats().items() if key.startswith(f"{figure}{DIGEST_LABEL}")]
        return sum(int(str(value)) for value in figures)

    def close(self) -> None:
        if self.process.poll() is None:
            self.ask("close")
        self.process.wait(60)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


if __name__ == "__main__":
    main(sys.argv[1:])
