"""Tenant quotas and pins of folder tiers (``disk``, ``shm``) shared by real processes.

Each process is :mod:`tenant_worker`: a tier of the same folder with ``quotas: {tenant-a: QUOTA}``
and a budget far above what the tests store, so only quotas evict.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tenant_worker import VALUE

from kvplug import key_digest
from kvplug.core.tenants import DIGEST_LABEL, FOLDER_TENANT_BYTES, TENANT_BYTES
from kvplug.testing.pins_contract import key_of
from kvplug_disk.folder_scan import RECORD_SUFFIX

WORKER = str(Path(__file__).with_name("tenant_worker.py"))
FILE = VALUE + 64  # a record file: its value and header; quotas count file bytes
QUOTA = 4 * FILE


class Worker:
    """One :mod:`tenant_worker` process; each command waits for its answer (no timing)."""

    def __init__(self, kind: str, folder: Path, name: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, WORKER, kind, str(folder), name, str(QUOTA)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.expect("ready")

    def ask(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.answer()

    def answer(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line:  # not an AssertionError: the xfail below must not hide a worker that died
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


@pytest.fixture
def workers(kind: str, folder: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    try:
        started.extend(Worker(kind, folder, name) for name in ("w0", "w1"))
        yield started
    finally:
        for worker in started:
            worker.close()


def record_bytes(folder: Path, keys: list[str] | None = None) -> int:
    """File bytes of the folder's records (of ``keys`` only, if given)."""
    names = None if keys is None else {key_digest(key).hex() + RECORD_SUFFIX for key in keys}
    return sum(
        path.stat().st_size for path in folder.glob(f"*/*{RECORD_SUFFIX}") if names is None or path.name in names
    )


def tenant_keys(name: str, tenant: str | None, count: int) -> list[str]:
    return [key_of(tenant, f"{name}-{i}") for i in range(count)]


def test_a_tenants_quota_holds_for_the_folder_not_each_process(workers: list[Worker], folder: Path) -> None:
    """Two engines store tenant-a's chunks in one folder: tenant-a holds at most its quota there
    (0ad3378: each process kept its own quota's worth, 8512 bytes of a 4256-byte quota)."""
    for worker in workers:
        assert worker.ask("put tenant-a 8") == "done"
    held = record_bytes(folder, tenant_keys("w0", "tenant-a", 8) + tenant_keys("w1", "tenant-a", 8))
    assert held <= QUOTA, f"tenant-a holds {held} bytes in the folder, its quota is {QUOTA}"
    assert held == QUOTA  # the quota is not spent on nothing: the tenant keeps its quota's worth
    # Each process reports the tenant's bytes in the whole folder beside those it knows of.
    assert [worker.tenant_a_bytes(FOLDER_TENANT_BYTES) for worker in workers] == [held, held]
    assert sum(worker.tenant_a_bytes() for worker in workers) == held


def test_a_pinned_chunk_is_not_evicted_for_another_processes_quota(workers: list[Worker], folder: Path) -> None:
    """Process w0 pins a chunk of tenant-a and one of tenant-b, and stores unsalted chunks;
    process w1 then stores far over tenant-a's quota: w1's quota evictions take only its own
    unpinned tenant-a chunks, never w0's pinned ones, nor another tenant's. w0's pinned tenant-a
    chunk, which w1 does not know as pinned, counts against tenant-a's quota in the folder."""
    first, second = workers
    assert first.ask("pin tenant-a system") == "pinned"
    assert first.ask("pin tenant-b system") == "pinned"
    assert first.ask("put none 3") == "done"
    assert second.ask("put tenant-a 12") == "done"
    pinned = [key_of("tenant-a", "system"), key_of("tenant-b", "system")]
    assert record_bytes(folder, pinned) == 2 * FILE, "a pinned chunk left the folder"
    assert record_bytes(folder, tenant_keys("w0", None, 3)) == 3 * FILE, "unsalted chunks were evicted"
    assert record_bytes(folder, tenant_keys("w1", "tenant-a", 12)) == QUOTA - FILE
    assert int(str(second.stats()["quota_evictions"])) >= 8
    # What a process reports is its own view: w1 counts only the tenant-a bytes it wrote.
    assert second.tenant_a_bytes() <= QUOTA
    assert int(str(first.stats()["pinned_bytes"])) == 2 * FILE
