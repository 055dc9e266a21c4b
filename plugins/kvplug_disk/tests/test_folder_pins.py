"""Pins of folder tiers (``disk``, ``shm``) hold for every process sharing the folder.

Each process is :mod:`tenant_worker`: a tier of the same folder with ``quotas: {tenant-a: QUOTA}``.
Process w0 pins a record; process w1, opened after it, lists the folder when it opens (so w0's
record is in w1's eviction order, the oldest of all) and then stores until the folder's budget,
or tenant-a's quota there, evicts. A record one engine pinned must stay (its pin mark,
:mod:`kvplug_disk.pin_marks`), until that engine unpins it or ends.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tenant_worker import VALUE, Worker

from kvplug import TierContext, key_digest
from kvplug.testing import pins_context, value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk import DiskTier, ShmTier, pin_marks
from kvplug_disk.folder_scan import RECORD_SUFFIX
from kvplug_disk.pin_marks import MARK_PREFIX, OWNERS_FOLDER

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


@pytest.fixture
def workers(started: list[Worker], kind: str, folder: Path) -> Callable[..., Worker]:
    """Starts :mod:`tenant_worker` processes of ``folder`` by name (``started`` closes them)."""

    def start_worker(name: str, budget: int = BUDGET) -> Worker:
        return start(started, kind, folder, name, budget)

    return start_worker


@pytest.fixture
def tiers(kind: str, folder: Path) -> Iterator[Callable[..., DiskTier]]:
    """Opens ``kind`` tiers of ``folder`` in this process (:func:`tier_of`), closed after the test."""
    opened: list[DiskTier] = []

    def open_tier(context: TierContext | None = None, **options: object) -> DiskTier:
        opened.append(tier := tier_of(kind, folder, context, **options))
        return tier

    yield open_tier
    for tier in opened:
        tier.close()


def test_a_record_one_engine_pinned_stays_when_another_fills_the_folder(
    workers: Callable[..., Worker], folder: Path
) -> None:
    """a49b889: w1 evicted w0's pinned record (``AssertionError: another engine evicted the
    record w0 pinned``): w1's order knew it from its listing, not as pinned."""
    owner = workers("w0")
    assert owner.ask("pin tenant-b system") == "pinned"
    other = workers("w1")
    assert other.ask("put none 12") == "done"
    assert path_of(folder, PINNED).exists(), "another engine evicted the record w0 pinned"
    assert len(records(folder)) * VALUE <= BUDGET, "the folder went over its budget"
    assert int(str(other.stats()["kept_pinned_elsewhere"])) >= 1
    assert int(str(owner.stats()["pinned_bytes"])) == FILE
    # Private like the rest of the folder: the owners' lock files tell others nothing either.
    assert (folder / OWNERS_FOLDER).stat().st_mode & 0o777 == 0o700
    assert [path.stat().st_mode & 0o777 for path in (folder / OWNERS_FOLDER).iterdir()] == [0o600]


def test_a_record_one_engine_pinned_stays_when_another_stores_it_again(
    workers: Callable[..., Worker], folder: Path
) -> None:
    """Another engine stores the pinned chunk again (a new file renamed over the marked one):
    the mark goes over with it. a49b889: ``another engine evicted the record w0 pinned``."""
    owner = workers("w0")
    assert owner.ask("pin tenant-b system") == "pinned"
    other = workers("w1")
    assert other.ask("store tenant-b system") == "stored"
    assert other.ask("put none 12") == "done"
    assert path_of(folder, PINNED).exists(), "another engine evicted the record w0 pinned"
    assert len(marks_on(path_of(folder, PINNED))) == 1


@pytest.mark.parametrize(
    ("first", "answer"),
    [("pin", "pinned"), ("want", "wanted")],
    ids=["pinned-then-stored-again", "wanted-then-stored"],
)
def test_a_record_its_own_engine_stores_is_marked(
    workers: Callable[..., Worker], folder: Path, first: str, answer: str
) -> None:
    """w0 stores a record it pinned (a new file renamed over the marked one: d346f21 left the new
    file without w0's mark), or one it pinned before any tier held it (its pin book remembers it:
    the store marks it; a49b889 never did): either way another engine leaves it, with w0's mark.
    Both fail with ``another engine evicted the record w0 pinned``."""
    owner = workers("w0")
    assert owner.ask(f"{first} tenant-b system") == answer
    assert owner.ask("store tenant-b system") == "stored"
    other = workers("w1")
    assert other.ask("put none 12") == "done"
    assert path_of(folder, PINNED).exists(), "another engine evicted the record w0 pinned"
    assert len(marks_on(path_of(folder, PINNED))) == 1


def test_a_record_one_engine_pinned_stays_when_another_keeps_its_quota(
    workers: Callable[..., Worker], folder: Path
) -> None:
    """w1 stores far over tenant-a's quota after a listing found w0's pinned tenant-a record:
    its quota evictions take its own records, not w0's pinned one (a49b889: ``another engine
    evicted the record w0 pinned``, docs/operations.md said so as a known limit)."""
    owner = workers("w0", budget=1 << 30)
    assert owner.ask("pin tenant-a system") == "pinned"
    other = workers("w1", budget=1 << 30)
    assert other.ask("put tenant-a 12") == "done"
    assert path_of(folder, key_of("tenant-a", "system")).exists(), "another engine evicted the record w0 pinned"
    assert int(str(other.stats()["quota_evictions"])) >= 8


def test_a_folder_full_of_other_engines_pins_refuses_a_store(workers: Callable[..., Worker], folder: Path) -> None:
    """w0 (a large budget of its own, so a large pin budget) pins six records; w1, whose budget
    they fill, cannot store beside them: its store is refused, counted, and the pins stay
    (a49b889: w1 evicted them, ``another engine evicted the records w0 pinned``)."""
    owner = workers("w0", budget=1 << 30)
    pinned = [key_of("tenant-b", f"system-{i}") for i in range(6)]
    for i in range(6):
        assert owner.ask(f"pin tenant-b system-{i}") == "pinned"
    other = workers("w1")
    assert other.ask("put none 2") == "done"
    assert all(path_of(folder, key).exists() for key in pinned), "another engine evicted the records w0 pinned"
    assert len(records(folder)) == 6
    stats = other.stats()
    assert int(str(stats["stores_refused_no_room"])) == 2
    # w1 listed the folder when it opened it, and not again for each store: what it could not
    # evict is known to it as pinned elsewhere, not as records it has yet to find.
    assert int(str(stats["folder_listings"])) == 1


def test_other_engines_pins_count_against_no_quota_here(workers: Callable[..., Worker], folder: Path) -> None:
    """w0 pins five of tenant-a's records, more than its quota (an operator's pins count against
    no quota). w1, opened after, stores three of tenant-a's: w0's pins stay, and they do not
    count against tenant-a's quota in w1 (as they do not in w0), so w1 keeps its own three."""
    owner = workers("w0", budget=1 << 30)
    pinned = [key_of("tenant-a", f"system-{i}") for i in range(5)]
    for i in range(5):
        assert owner.ask(f"pin tenant-a system-{i}") == "pinned"
    other = workers("w1", budget=1 << 30)
    assert other.ask("put tenant-a 3") == "done"
    assert all(path_of(folder, key).exists() for key in pinned), "another engine evicted the records w0 pinned"
    assert all(path_of(folder, key_of("tenant-a", f"w1-{i}")).exists() for i in range(3))
    assert int(str(other.stats()["folder_listings"])) == 1


@pytest.mark.parametrize("how", ["unpin", "close", "kill"])
def test_a_pin_ends_with_its_engines_unpin_or_the_engine(
    workers: Callable[..., Worker], folder: Path, how: str
) -> None:
    """Once w0 unpins the record, closes its tier or is killed, the mark no longer holds: w1
    evicts the record for its budget (a pin never outlives every engine that wanted it), and
    a dead owner's lock file and mark are removed where seen."""
    owner = workers("w0")
    assert owner.ask("pin tenant-b system") == "pinned"
    assert len(marks_on(path_of(folder, PINNED))) == 1
    if how == "unpin":
        assert owner.ask("unpin tenant-b system") == "unpinned"
        assert marks_on(path_of(folder, PINNED)) == []
    elif how == "close":
        owner.close()
    else:
        kill(owner)
    other = workers("w1")
    assert other.ask("put none 12") == "done"
    assert not path_of(folder, PINNED).exists(), "a pin outlived what wanted it"
    assert len(records(folder)) * VALUE <= BUDGET
    if how != "unpin":
        assert list((folder / OWNERS_FOLDER).iterdir()) == [], "a dead owner's lock file stayed"


def test_an_engine_opening_the_folder_removes_the_lock_files_of_engines_gone(
    workers: Callable[..., Worker], folder: Path
) -> None:
    """w0 pins a record and is killed; the record is then removed (``kvplug store``, a corrupt
    read): no eviction will come across w0's mark. The next engine to open the folder removes
    w0's lock file all the same (d346f21: it stayed, ``assert [...] == []``)."""
    owner = workers("w0")
    assert owner.ask("pin tenant-b system") == "pinned"
    kill(owner)
    path_of(folder, PINNED).unlink()
    assert len(list((folder / OWNERS_FOLDER).iterdir())) == 1
    workers("w1")
    assert list((folder / OWNERS_FOLDER).iterdir()) == []


def test_a_dead_engines_marks_do_not_pile_up(workers: Callable[..., Worker], folder: Path) -> None:
    """Each engine is a new owner: one that pins a record a killed engine had pinned removes
    the dead mark (each file system has room for a few attributes only)."""
    for name in ("w0", "w1", "w2"):
        worker = workers(name)
        assert worker.ask("pin tenant-b system") == "pinned"
        kill(worker)
        assert len(marks_on(path_of(folder, PINNED))) == 1


def test_without_user_attributes_a_pin_holds_in_its_own_process(
    tiers: Callable[..., DiskTier], folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system without user extended attributes (tmpfs before Linux 6.6) refuses every
    mark (a mock: this host's file systems have them). The pin still holds in its own process,
    and the failure is counted."""
    refuse_user_attributes(monkeypatch)
    tier = tiers(max_bytes=BUDGET)
    tier.put([(PINNED, value_for(PINNED, VALUE))])
    assert tier.pin([PINNED])[0][0] == "pinned"
    fill(tier)
    assert path_of(folder, PINNED).exists()
    assert tier.stats().extra["pin_marks_failed"] >= 1


def test_a_linked_owners_folder_never_makes_the_tier_remove_files_outside_its_folder(
    tiers: Callable[..., DiskTier], folder: Path, tmp_path: Path
) -> None:
    """A hostile folder: ``.kvplug-pins`` is a link to another folder, which holds a file named
    like an owner, and a record carries a mark naming that owner. Evicting the record checks the
    owner: the tier must neither follow the link nor remove the file it leads to (4089e48: it
    did, ``AssertionError: the tier removed a file outside its folder``)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    owner = "ab" * 16
    (elsewhere / owner).write_text("not kvplug's")
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / OWNERS_FOLDER).symlink_to(elsewhere)
    tier = tiers(max_bytes=BUDGET)
    tier.put([(PINNED, value_for(PINNED, VALUE))])
    os.setxattr(path_of(folder, PINNED), MARK_PREFIX + owner, b"1")
    fill(tier)
    assert (elsewhere / owner).exists(), "the tier removed a file outside its folder"
    assert (folder / OWNERS_FOLDER).is_symlink()


@pytest.mark.parametrize("entry", ["link", "fifo", "folder", "many", "not-hex"])
def test_hostile_owner_entries_neither_hang_nor_keep_a_record_forever(
    tiers: Callable[..., DiskTier], folder: Path, tmp_path: Path, entry: str
) -> None:
    """A hostile folder: a record carries marks whose owners' lock files are a link (to a file
    outside the store), a FIFO or a folder, hundreds of marks of owners that never were, or a
    mark naming no owner at all. None is a live owner's lock (owners make regular files, locked
    before they get their names): the tier evicts the record for its budget, removes the marks,
    never hangs and never touches what a link leads to. 4089e48: a link kept the record in place
    for good (``AssertionError: a mark no live owner holds kept the record``)."""
    outside = tmp_path / "outside"
    outside.write_text("not kvplug's")
    owners = folder / OWNERS_FOLDER
    owners.mkdir(mode=0o700, parents=True)
    names = ["cd" * 16]
    if entry == "link":
        (owners / names[0]).symlink_to(outside)
    elif entry == "fifo":
        os.mkfifo(owners / names[0], 0o600)
    elif entry == "folder":
        (owners / names[0]).mkdir()
    elif entry == "many":
        names = [f"{i:032x}" for i in range(300)]
    else:
        names = ["../../outside"]
    tier = tiers(max_bytes=BUDGET)
    tier.put([(PINNED, value_for(PINNED, VALUE))])
    for name in names:
        try:
            os.setxattr(path_of(folder, PINNED), MARK_PREFIX + name, b"1")
        except OSError as exc:  # the file system's room for attributes is full: enough
            assert exc.errno in (errno.ENOSPC, errno.E2BIG), exc
            break
    fill(tier)
    assert not path_of(folder, PINNED).exists(), "a mark no live owner holds kept the record"
    assert len(records(folder)) * VALUE <= BUDGET
    assert outside.read_text() == "not kvplug's"


def test_an_unpin_while_another_engine_stores_the_record_again_leaves_no_mark(
    tiers: Callable[..., DiskTier], folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine A pins a record; engine B stores it again, and A unpins it between B copying the old
    file's marks onto its new file and renaming it into place (a gate on B's copy: two tiers in
    one process are two owners, their flocks as apart as two processes'). A's unpin must not
    leave A's mark on the new file, which would keep the record from every other engine for as
    long as A lives (4089e48: A removed its mark from the old file outside the folder's lock,
    ``AssertionError: A's unpin left its mark on the record B stored again``)."""
    first, second = tiers(), tiers()
    armed, unpinned, threads = during_carry_over(monkeypatch, lambda: first.unpin([PINNED]), wait_s=1.0)
    first.put([(PINNED, value_for(PINNED, VALUE))])
    assert first.pin([PINNED])[0][0] == "pinned"
    assert len(marks_on(path_of(folder, PINNED))) == 1
    armed.set()
    second.put([(PINNED, value_for(PINNED, VALUE))])
    for thread in threads:
        thread.join(60)
    assert unpinned == [[VALUE]]
    assert marks_on(path_of(folder, PINNED)) == [], "A's unpin left its mark on the record B stored again"


def test_a_record_a_lookup_finds_pinned_keeps_its_mark_when_another_engine_stores_it_again(
    tiers: Callable[..., DiskTier], folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine A's pin book wants a record that engine B stored; B stores it again, and A's lookup
    first finds the record (pinning it as it enters A's order, and marking it) between B copying
    the old file's marks onto its new file and renaming it into place (a gate on B's copy). The
    new file must carry A's mark, or every other engine may evict what A takes as pinned
    (4089e48: A marked the old file outside the folder's lock, ``AssertionError: the record A
    pinned lost its mark``)."""
    context = pins_context()
    first, second = tiers(context), tiers()
    armed, found, threads = during_carry_over(monkeypatch, lambda: first.contains([PINNED]), wait_s=1.0)
    second.put([(PINNED, value_for(PINNED, VALUE))])
    context.tenancy.pins.add([PINNED])
    armed.set()
    second.put([(PINNED, value_for(PINNED, VALUE))])
    for thread in threads:
        thread.join(60)
    assert found == [[True]]
    assert first.stats().extra["pinned_bytes"] == FILE
    assert len(marks_on(path_of(folder, PINNED))) == 1, "the record A pinned lost its mark"


def test_a_killed_engines_pins_stop_holding_for_an_engine_that_left_them_in_place(
    workers: Callable[..., Worker], folder: Path
) -> None:
    """w1 leaves w0's pinned record in place while w0 lives; then w0 is killed. The record is
    w1's oldest, pinned by no one: w1's next evictions take it first, not its own newer
    records for as long as it runs (4089e48: w1 asked about it again only with nothing else
    to evict, ``AssertionError: a killed engine's pin still held its record``)."""
    owner = workers("w0")
    assert owner.ask("pin tenant-b system") == "pinned"
    other = workers("w1")
    assert other.ask("put none 12") == "done"
    assert path_of(folder, PINNED).exists()
    kill(owner)
    assert other.ask("put none 1") == "done"
    assert not path_of(folder, PINNED).exists(), "a killed engine's pin still held its record"
    assert len(records(folder)) * VALUE <= BUDGET
    assert list((folder / OWNERS_FOLDER).iterdir()) == [], "a dead owner's lock file stayed"


@pytest.mark.parametrize("entry", ["file", "no-attributes"])
def test_a_pin_that_cannot_be_marked_says_why(
    tiers: Callable[..., DiskTier],
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    entry: str,
) -> None:
    """A pin whose mark cannot be set holds in its own process only: the operator is told once,
    with the reason and the place, not just a count (4089e48: nothing was logged,
    ``AssertionError: no warning says why the pin holds in this process only``). ``file``: a
    ``.kvplug-pins`` that is a file; ``no-attributes``: a file system without user extended
    attributes (a mock: this host's file systems have them)."""
    if entry == "file":
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        (folder / OWNERS_FOLDER).write_text("")
    else:
        refuse_user_attributes(monkeypatch)
    tier = tiers()
    with caplog.at_level("WARNING"):
        for name in ("a", "b"):
            key = key_of("tenant-b", name)
            tier.put([(key, value_for(key, VALUE))])
            assert tier.pin([key])[0][0] == "pinned"
    warnings = [r.getMessage() for r in caplog.records if "this process only" in r.getMessage()]
    assert warnings, "no warning says why the pin holds in this process only"
    assert len(warnings) == 1, warnings
    reason = "Not a directory" if entry == "file" else "Operation not supported"
    assert reason in warnings[0] and str(folder) in warnings[0], warnings[0]
