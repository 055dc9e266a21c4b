"""Pins of folder tiers (``disk``, ``shm``) hold for every process sharing the folder.

Each process is :mod:`tenant_worker`: a tier of the same folder with ``quotas: {tenant-a: QUOTA}``.
Process w0 pins a record; process w1, opened after it, lists the folder when it opens (so w0's
record is in w1's eviction order, the oldest of all) and then stores until the folder's budget,
or tenant-a's quota there, evicts. A record one engine pinned must stay (its pin mark,
:mod:`kvplug_disk.pin_marks`), until that engine unpins it or ends.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from pinned_folders import (
    BUDGET,
    FILE,
    PINNED,
    kill,
    marks_on,
    path_of,
    records,
    start,
)
from tenant_worker import VALUE, Worker

from kvplug.testing.pins_contract import key_of
from kvplug_disk.pin_marks import OWNERS_FOLDER


@pytest.fixture
def workers(started: list[Worker], kind: str, folder: Path) -> Callable[..., Worker]:
    """Starts :mod:`tenant_worker` processes of ``folder`` by name (``started`` closes them)."""

    def start_worker(name: str, budget: int = BUDGET) -> Worker:
        return start(started, kind, folder, name, budget)

    return start_worker


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
