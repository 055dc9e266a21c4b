"""No wait for a folder's lock is unbounded (tiers disk and shm): another process paused while
it holds the lock (SIGSTOP, a debugger, a frozen container) makes an open fail with an error
naming the folder and that process, and a write a dropped put, counted; nothing stored is lost."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from disk_worker import holding_the_folder_lock

from kvplug.errors import TierUnavailableError
from kvplug.testing import key_for, tier_context, value_for
from kvplug_disk import DiskTier, ShmTier, verify
from kvplug_disk.ledger import FolderLockTimeoutError, lock_holder

T = TypeVar("T")
STORED = [(key_for(f"stored-{i}"), value_for(f"stored-{i}", 3000 + i)) for i in range(3)]
#: Generous: a call that returns at all returns within its wait (here 1 s) and a little.
RETURNS_WITHIN_S = 60


def tier_class(kind: str) -> type[DiskTier]:
    return ShmTier if kind == "shm" else DiskTier


def open_tier(kind: str, folder: Path, **options: object) -> DiskTier:
    cls = tier_class(kind)
    return cls(cls.Config(path=folder, queue={"mode": "sync"}, **options), tier_context())


def in_a_thread(call: Callable[[], T]) -> T | BaseException:
    """What ``call`` returned or raised; fails the test when it has not returned in ``RETURNS_WITHIN_S``
    (it is left running, a daemon thread, until the lock's holder is killed)."""
    answers: list[T | BaseException] = []

    def run() -> None:
        try:
            answers.append(call())
        except BaseException as exc:  # handed to the test
            answers.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(RETURNS_WITHIN_S)
    assert answers, f"still waiting after {RETURNS_WITHIN_S} s for a paused process's lock on the folder"
    return answers[0]


def assert_intact(kind: str, folder: Path) -> None:
    tier = open_tier(kind, folder)
    try:
        assert [bytes(value) if value is not None else None for value in tier.get([k for k, _ in STORED])] == [
            v for _, v in STORED
        ]
        assert tier.stats().extra["folder_bytes"] == sum(len(v) for _, v in STORED)
    finally:
        tier.close()


def test_opening_a_folder_whose_lock_a_paused_process_holds_fails_naming_the_folder_and_the_process(
    kind: str, folder: Path
) -> None:
    writer = open_tier(kind, folder)
    writer.put(STORED)
    writer.close()
    holder = holding_the_folder_lock(folder)
    try:
        opened = in_a_thread(lambda: open_tier(kind, folder, open_lock_wait_s=1))
        if isinstance(opened, DiskTier):
            opened.close()
        assert isinstance(opened, FolderLockTimeoutError) and isinstance(opened, TierUnavailableError), opened
        message = str(opened)
        assert str(folder) in message and ".kvplug-usage" in message and "does not open" in message
        # Named where Linux's /proc/locks names it (an overlay file system may not).
        assert opened.holder == holder.pid or (opened.holder is None and "another process" in message), message
    finally:
        holder.kill()
        holder.wait(30)
    assert_intact(kind, folder)


def test_a_write_while_a_paused_process_holds_the_folder_lock_is_dropped_and_counted(kind: str, folder: Path) -> None:
    tier = open_tier(kind, folder, lock_wait_s=1)
    holder = None
    try:
        tier.put(STORED)
        holder = holding_the_folder_lock(folder)
        late = [(key_for(f"late-{i}"), value_for(f"late-{i}", 2000)) for i in range(3)]
        assert in_a_thread(lambda: tier.put(late)) is None
        stats = tier.stats()
        assert stats.extra["dropped_puts"] == 3 and stats.puts == 3
        assert stats.extra["lock_timeouts"] == 1  # one wait for the whole put, not one per record
        assert tier.contains([k for k, _ in late]) == [False] * 3
        assert not list(folder.glob("*/*.tmp*")), "a dropped write left its temp file"
        removal = in_a_thread(lambda: tier.remove([STORED[0][0]]))
        assert isinstance(removal, TierUnavailableError), removal
        holder.kill()
        holder.wait(30)
        holder = None
        tier.put(late[:1])  # the lock is free again: writes land
        assert tier.contains([late[0][0]]) == [True]
        tier.remove([late[0][0]])
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(30)
        tier.close()
    assert_intact(kind, folder)


def test_a_write_waits_for_a_lock_held_briefly(kind: str, folder: Path) -> None:
    """A lock held for less than ``lock_wait_s`` (another rank's rename, a listing) is waited for."""
    tier = open_tier(kind, folder, lock_wait_s=120)
    try:
        holder = holding_the_folder_lock(folder, hold_s=1)
        try:
            assert in_a_thread(lambda: tier.put(STORED)) is None
        finally:
            holder.wait(60)
        assert tier.stats().puts == 3 and tier.stats().extra["lock_timeouts"] == 0
    finally:
        tier.close()
    assert_intact(kind, folder)


def test_lock_holder_reads_the_flock_holder_of_that_file_from_the_locks_linux_lists(tmp_path: Path) -> None:
    usage = tmp_path / "usage"
    usage.write_bytes(b"")
    fd = os.open(usage, os.O_RDONLY)
    try:
        info = os.fstat(fd)
        inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
        locks = tmp_path / "locks"
        locks.write_text(
            f"1: POSIX  ADVISORY  WRITE 7 {inode} 0 EOF\n"  # a record lock, not the folder's flock
            f"2: FLOCK  ADVISORY  WRITE 8 {inode}1 0 EOF\n"  # another file
            f"3: -> FLOCK  ADVISORY  WRITE 99 {inode} 0 EOF\n"  # a waiter, not the holder
            f"3: FLOCK  ADVISORY  WRITE 4242 {inode} 0 EOF\n"
        )
        assert lock_holder(fd, str(locks)) == 4242
        assert lock_holder(fd, str(tmp_path / "missing")) is None
    finally:
        os.close(fd)


def test_closing_a_tier_whose_write_waits_for_the_lock_ends_the_wait(
    kind: str, folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A write waiting for a paused process's hold gives up when its tier closes: the put is a
    dropped write, never a call that failed on a file descriptor closed under it."""
    tier = open_tier(kind, folder, lock_wait_s=600)
    holder = holding_the_folder_lock(folder)
    try:
        writing = threading.Thread(target=lambda: tier.put(STORED[:1]), daemon=True)
        writing.start()
        deadline = time.monotonic() + RETURNS_WITHIN_S
        while "_flock" not in _stack_of(writing) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert in_a_thread(tier.close) is None
        writing.join(RETURNS_WITHIN_S)
        assert not writing.is_alive()
        assert not [r.getMessage() for r in caplog.records if "a call on" in r.getMessage()]
        assert tier.stats().extra["lock_timeouts"] == 1
    finally:
        holder.kill()
        holder.wait(30)
        tier.close()


def _stack_of(thread: threading.Thread) -> str:
    """The function names on ``thread``'s stack now."""
    frame = sys._current_frames().get(thread.ident or 0)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return " ".join(names)


def test_verify_folder_removing_a_corrupt_record_gives_up_on_a_paused_holder(
    kind: str, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verify, "VERIFY_LOCK_WAIT_S", 1.0)  # 30 s by default
    writer = open_tier(kind, folder)
    writer.put(STORED)
    writer.close()
    damaged = sorted(folder.glob("*/*.kvr"))[0]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    holder = holding_the_folder_lock(folder)
    try:
        answer = in_a_thread(lambda: verify.verify_folder(folder, remove_corrupt=True))
        assert isinstance(answer, FolderLockTimeoutError), answer
        assert str(folder) in str(answer) and damaged.exists()
    finally:
        holder.kill()
        holder.wait(30)
    assert verify.verify_folder(folder, remove_corrupt=True).removed == 1
