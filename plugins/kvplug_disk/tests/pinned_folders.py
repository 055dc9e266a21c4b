"""What the folder-pin tests (``test_folder_pin*.py``) set up and look at: engines of one folder,
as tiers in this process (two are two owners, their flocks as apart as two processes') or as
:mod:`tenant_worker` processes, their records and pin marks on disk, and the faults they meet."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from tenant_worker import VALUE, Worker

from kvplug import TierContext, key_digest
from kvplug.testing import pins_context, value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk import DiskTier, ShmTier, pin_marks
from kvplug_disk.folder_scan import RECORD_SUFFIX
from kvplug_disk.pin_marks import MARK_PREFIX

FILE = VALUE + 64  # a record file: its value and header
QUOTA = 4 * FILE
#: The folder's budget (value bytes): six records. pin_max_bytes (25%) lets each process pin one.
BUDGET = 6 * VALUE
PINNED = key_of("tenant-b", "system")  # tenant-b has no quota: only the budget evicts it


def path_of(folder: Path, key: str) -> Path:
    digest = key_digest(key).hex()
    return folder / digest[:2] / f"{digest}{RECORD_SUFFIX}"


def records(folder: Path) -> list[Path]:
    return list(folder.glob(f"*/*{RECORD_SUFFIX}"))


def tier_of(kind: str, folder: Path, context: TierContext | None = None, **options: object) -> DiskTier:
    """A ``kind`` tier of ``folder`` in this process (1 GiB unless ``max_bytes`` says otherwise):
    two of them are two owners, their flocks as apart as two processes'."""
    tier_type = ShmTier if kind == "shm" else DiskTier
    settings = {"max_bytes": 1 << 30, **options}
    config = tier_type.Config(path=folder, fsync=False, queue={"mode": "sync"}, **settings)  # type: ignore[arg-type]
    return tier_type(config, context or pins_context())


def during_carry_over(
    monkeypatch: pytest.MonkeyPatch, call: Callable[[], object], *, wait_s: float
) -> tuple[threading.Event, list[object], list[threading.Thread]]:
    """Gate the next store once the returned event is set: between copying the old file's marks
    onto its new file and renaming it into place, with the folder's lock held, ``call`` runs on a
    thread of its own, waited for at most ``wait_s`` (a correct call that needs the lock waits for
    it). Returns the event, ``call``'s results and its threads (to join)."""
    armed = threading.Event()
    results: list[object] = []
    threads: list[threading.Thread] = []
    original = pin_marks.PinMarks.carry_over

    def gated(self: pin_marks.PinMarks, digest: str, temp_name: str, temp_dir_fd: int) -> None:
        original(self, digest, temp_name, temp_dir_fd)
        if armed.is_set():
            armed.clear()
            threads.append(thread := threading.Thread(target=lambda: results.append(call())))
            thread.start()
            thread.join(wait_s)

    monkeypatch.setattr(pin_marks.PinMarks, "carry_over", gated)
    return armed, results, threads


def marks_on(path: Path) -> list[str]:
    return [name for name in os.listxattr(path) if name.startswith(MARK_PREFIX)]


def start(started: list[Worker], kind: str, folder: Path, name: str, budget: int = BUDGET) -> Worker:
    worker = Worker(kind, folder, name, QUOTA, budget)
    started.append(worker)
    return worker


def kill(worker: Worker) -> None:
    """End ``worker``'s process for real (SIGKILL): no close, its flocks dropped by the kernel."""
    worker.process.kill()
    worker.process.wait(60)


def fill(tier: DiskTier) -> None:
    """Store twice the folder's budget of records no one pins (tenant none), then flush."""
    for i in range(12):
        key = key_of(None, f"fill-{i}")
        tier.put([(key, value_for(key, VALUE))])
    tier.flush()


def refuse_user_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without user extended attributes (tmpfs before Linux 6.6): a mock, as this
    host's file systems have them."""

    def refuse(*args: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(pin_marks.os, "setxattr", refuse)
