"""A folder's pins summed over its engines, seen (``stats().extra["folder_pinned_bytes"]``,
``kvplug store stats``) and bounded as a whole (``folder_pin_max_bytes``, 90% of ``max_bytes`` by
default): each engine writes its pinned bytes into its lock file in ``.kvplug-pins``
(:mod:`kvplug_disk.pin_owners`), and the others sum those of the live ones. The workers and
helpers are in :mod:`pinned_folders`; each worker is a process of its own, killed for real.
"""

from __future__ import annotations

import fcntl
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pinned_folders import FILE, kill, path_of, records, start, tier_of
from tenant_worker import VALUE, Worker
from typer.testing import CliRunner

from kvplug.cli.main import app
from kvplug.testing import value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk import DiskTier, ledger, pin_marks
from kvplug_disk.pin_marks import OWNERS_FOLDER

#: Five records: each engine may pin one (pin_max_bytes 25%: 1250 bytes, a record file is 1064),
#: the folder four together (folder_pin_max_bytes 90%: 4500 bytes).
BUDGET = 5 * VALUE


@pytest.fixture
def engines(started: list[Worker], kind: str, folder: Path) -> Callable[..., Worker]:
    """Starts :mod:`tenant_worker` processes of ``folder`` by name (``started`` closes them)."""
    return lambda name, budget=6 * VALUE: start(started, kind, folder, name, budget)


@pytest.fixture
def tier(kind: str, folder: Path) -> Iterator[DiskTier]:
    """A ``kind`` tier of ``folder`` in this process, holding one pinned record (``FILE`` bytes)."""
    opened = tier_of(kind, folder)
    key = key_of("tenant-b", "system")
    opened.put([(key, value_for(key, VALUE))])
    assert opened.pin([key])[0][0] == "pinned"
    yield opened
    opened.close()


def figures(worker: Worker) -> tuple[object, object, object]:
    stats = worker.stats()
    return (
        stats.get("folder_pinned_bytes"),
        stats.get("folder_pinning_processes"),
        stats.get("folder_pins_unknown_processes"),
    )


def store_stats(folder: Path) -> str:
    """``kvplug store stats FOLDER``'s output, one space between words."""
    result = CliRunner().invoke(app, ["store", "stats", str(folder)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.split())


def test_engines_of_a_folder_pin_no_more_of_it_together_than_folder_pin_max_bytes(
    engines: Callable[..., Worker], folder: Path
) -> None:
    """Five engines each pin a record within their own pin_max_bytes: the fifth pin would take
    the whole folder, so it is refused (as a pin past pin_max_bytes is), and a store still has
    room. 5fdb4ad pinned it (``AssertionError: assert 'pinned' == 'refused'``), and every
    store after was refused (stores_refused_no_room). A pinning engine killed with SIGKILL
    leaves the sum: the refused pin then fits."""
    started_engines = [engines(f"w{i}", budget=BUDGET) for i in range(5)]
    for i, engine in enumerate(started_engines[:4]):
        assert engine.ask(f"pin tenant-b system-{i}") == "pinned"
    last = started_engines[4]
    assert last.ask("pin tenant-b system-4") == "refused"
    assert int(str(last.stats()["pins_refused"])) == 1
    assert last.ask("put none 3") == "done"
    assert int(str(last.stats()["stores_refused_no_room"])) == 0
    assert len(records(folder)) * VALUE <= BUDGET, "the folder went over its budget"
    assert figures(last) == (4 * FILE, 4, 0)

    kill(started_engines[0])
    assert figures(last) == (3 * FILE, 3, 0), "a killed engine's pins still counted"
    assert last.ask("pin tenant-b system-4") == "pinned"
    assert path_of(folder, key_of("tenant-b", "system-4")).exists()


def test_a_record_wanted_pinned_is_stored_unpinned_when_the_folders_pins_are_spent(
    engines: Callable[..., Worker], folder: Path
) -> None:
    """The pin book wants a record (pinned before it is stored): stored when four other engines
    already pin the folder's folder_pin_max_bytes, it is kept as an ordinary record, the pin
    refused and counted, as one past pin_max_bytes. 5fdb4ad pinned it (``assert 1064 == 0``)."""
    started_engines = [engines(f"w{i}", budget=BUDGET) for i in range(5)]
    for i, engine in enumerate(started_engines[:4]):
        assert engine.ask(f"pin tenant-b system-{i}") == "pinned"
    last = started_engines[4]
    assert last.ask("want tenant-b system-4") == "wanted"
    assert last.ask("store tenant-b system-4") == "stored"
    stats = last.stats()
    assert int(str(stats["pinned_bytes"])) == 0
    assert int(str(stats["pins_refused"])) == 1
    assert path_of(folder, key_of("tenant-b", "system-4")).exists()
    assert figures(last) == (4 * FILE, 4, 0)


def test_a_folders_pinned_bytes_are_shown_summed_over_its_live_engines(
    engines: Callable[..., Worker], folder: Path
) -> None:
    """Every engine's stats, and ``kvplug store stats`` of the folder, show the pinned bytes of
    all its live engines and how many pin; an unpin, and a kill -9, take theirs off. 5fdb4ad
    showed none (``AssertionError: assert (None, None, None) == (2128, 2, 0)``)."""
    first, second, third = (engines(name) for name in ("w0", "w1", "w2"))
    assert first.ask("pin tenant-b system") == "pinned"
    assert second.ask("pin tenant-b other") == "pinned"
    assert figures(third) == (2 * FILE, 2, 0)
    assert figures(first) == (2 * FILE, 2, 0)
    shown = store_stats(folder)
    assert f"tier folder_pinned_bytes │ {2 * FILE} │" in shown, shown
    assert "tier folder_pinning_processes │ 2 │" in shown, shown

    assert second.ask("unpin tenant-b other") == "unpinned"
    assert figures(third) == (FILE, 1, 0)
    assert second.ask("pin tenant-b other") == "pinned"
    kill(second)
    assert figures(third) == (FILE, 1, 0), "a killed engine's pins still counted"
    assert f"tier folder_pinned_bytes │ {FILE} │" in store_stats(folder)


def test_a_round_27_engines_lock_file_counts_its_pins_as_unknown(folder: Path, tier: DiskTier) -> None:
    """A round-27 engine holds an empty lock file (it writes no figure): its pins are unknown,
    counted apart and as nothing, and a file an engine writes a figure into is still a live
    owner's to a round-27 engine (it only locks the file). 5fdb4ad: ``assert None == 1``."""
    owners = folder / OWNERS_FOLDER
    old = owners / ("ab" * 16)
    old.touch(mode=0o600)
    with old.open("rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # alive, as a round-27 engine holds its file
        extra = tier.stats().extra
        assert extra.get("folder_pins_unknown_processes") == 1
        assert extra.get("folder_pinned_bytes") == FILE
        assert extra.get("folder_pinning_processes") == 1
    # Once it ends (its lock dropped), it is neither counted nor unknown.
    assert tier.stats().extra.get("folder_pins_unknown_processes") == 0
    # This engine's file has its figure, and is locked as a round-27 engine's liveness check expects.
    (mine,) = (path for path in owners.iterdir() if path != old)
    assert mine.read_bytes().startswith(b"pinned 0000")
    with mine.open("rb") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            raise AssertionError("a live engine's lock file was not locked")


@pytest.mark.parametrize(
    "line",
    [
        b"pinned 00000000000099999999 00000000\n",  # its checksum does not match
        b"pinned 99999999999999999999 %08x\n" % zlib.crc32(b"99999999999999999999"),  # matches, past any folder
    ],
    ids=["torn", "enormous"],
)
def test_a_torn_or_foreign_figure_reads_as_unknown_never_as_bytes(folder: Path, tier: DiskTier, line: bytes) -> None:
    """A figure whose checksum does not match (a rewrite torn, or bytes someone else wrote), or
    one no folder could hold, is unknown, not a number of pinned bytes (the enormous one would
    refuse every engine's pins). 5fdb4ad had no figures (``assert None == 1``); cb74975 counted
    the enormous one as bytes (``assert 0 == 1`` unknown)."""
    foreign = folder / OWNERS_FOLDER / ("cd" * 16)
    foreign.write_bytes(line)
    foreign.chmod(0o600)
    with foreign.open("rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        extra = tier.stats().extra
    assert extra.get("folder_pins_unknown_processes") == 1
    assert extra.get("folder_pinned_bytes") == FILE


def test_engines_pinning_at_once_stay_within_the_folders_pins(
    kind: str, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three owners of a folder whose pins may take two records (90% of three): C pins one;
    then A and B pin one each at once. A holds the folder's lock, its pin decided and its mark
    being set (a gate), while B asks for the lock: B must decide after A's figure is written,
    and be refused. 5fdb4ad decided B's pin before taking the lock, with no folder bound
    (``AssertionError: assert 'pinned' == 'refused'``)."""
    opened = [tier_of(kind, folder, max_bytes=3 * VALUE, pin_max_bytes="50%", lock_wait_s=60) for _ in range(3)]
    first, second, third = opened
    keys = [key_of("tenant-b", f"system-{i}") for i in range(3)]
    try:
        for tier, key in zip(opened, keys):
            tier.put([(key, value_for(key, VALUE))])
        assert third.pin([keys[2]])[0][0] == "pinned"
        first_marks = first._backend._marks  # type: ignore[attr-defined]
        second_ledger = second._backend._ledger  # type: ignore[attr-defined]
        in_gate, asking, release = threading.Event(), threading.Event(), threading.Event()
        mark, locked = pin_marks.PinMarks.mark, ledger.UsageLedger.locked

        def gated_mark(self: pin_marks.PinMarks, digest: str) -> bool:
            if self is first_marks:
                in_gate.set()
                release.wait(60)
            return mark(self, digest)

        def signalled_locked(self: ledger.UsageLedger, **options: Any) -> Any:
            if self is second_ledger:
                asking.set()
            return locked(self, **options)

        monkeypatch.setattr(pin_marks.PinMarks, "mark", gated_mark)
        monkeypatch.setattr(ledger.UsageLedger, "locked", signalled_locked)
        outcomes: dict[str, object] = {}
        pinning = [
            threading.Thread(target=lambda: outcomes.update(first=first.pin([keys[0]])[0][0])),
            threading.Thread(target=lambda: outcomes.update(second=second.pin([keys[1]])[0][0])),
        ]
        pinning[0].start()
        assert in_gate.wait(60)
        pinning[1].start()
        assert asking.wait(60)
        release.set()
        for thread in pinning:
            thread.join(60)
        assert outcomes == {"first": "pinned", "second": "refused"}
    finally:
        for tier in opened:
            tier.close()


@pytest.mark.parametrize("share", [0, "0%"])
def test_a_folder_pin_budget_of_0_or_0_percent_refuses_every_pin(kind: str, folder: Path, share: object) -> None:
    """``folder_pin_max_bytes`` 0 and 0% say the same: no engine pins in the folder. ee9bb23 took 0
    and refused 0% (``ValidationError: folder_pin_max_bytes: '0%' must be a percentage greater
    than 0 and at most 100``)."""
    opened = tier_of(kind, folder, folder_pin_max_bytes=share)
    try:
        key = key_of("tenant-b", "system")
        opened.put([(key, value_for(key, VALUE))])
        assert opened.pin([key])[0][0] == "refused"
    finally:
        opened.close()


@pytest.mark.parametrize("share", ["95%", 950_000])
def test_a_folder_pin_budget_past_90_percent_is_refused_saying_why(kind: str, folder: Path, share: object) -> None:
    """Past 90% of ``max_bytes``, in bytes or as a percentage: refused in the words ``pin_max_bytes``
    is (one check in core, :func:`kvplug.bound_share`), naming the value, the bound and what the rest
    is for."""
    with pytest.raises(ValueError) as caught:
        tier_of(kind, folder, max_bytes=1_000_000, folder_pin_max_bytes=share)
    text = str(caught.value)
    said = "'95%'" if share == "95%" else "950000 bytes of max_bytes 1000000"
    assert f"folder_pin_max_bytes: {said} is too much: at most 90% of max_bytes" in text, text
    assert "the rest is for records that can be evicted" in text, text
