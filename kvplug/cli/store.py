"""``kvplug store stats|ls|verify|gc LOCATION``: look into a persistent store.

LOCATION is whatever an installed tier says it opens (``StorageTier.location_config``):
a folder (tier ``disk``), ``s3://bucket/prefix`` and other fsspec URLs (tier ``s3``),
``redis://host:port`` (tier ``valkey``), and only if it is a store of that tier (a folder
no disk tier wrote is refused before anything in it is touched). ``stats``, ``ls`` and
``verify`` open it read-only (``TierContext.read_only``): they create, change and delete
nothing. ``gc`` opens it as an engine does, with an unbounded budget (nothing is
evicted), and removes only records that fail verification or are of an older format version
(one a newer kvplug wrote, in a store shared during a rolling upgrade, is ``newer``: kept).

Records are read as an engine reads them: at most ``--max-record-bytes`` of each (by
default the engine's bound, from the config's ``max_chunk_bytes``), so a record planted
larger than any record can be is reported ``oversized`` unread, never held in memory.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kvplug.cli.console import console, err_console, format_size, print_table, run_or_exit
from kvplug.cli.record_bound import UNBOUNDED, RecordBound, record_bound
from kvplug.errors import ConfigError, ConfigProblem, CorruptChunkError, RecordUnreadableError

# The core is imported where a command uses it: every ``kvplug`` command imports this module.
if TYPE_CHECKING:
    from kvplug.core.records.store import RecordCheck, StoredRecord
    from kvplug.core.tier import Buffer, StorageTier

store_app = typer.Typer(
    help="Inspect, verify and clean a persistent store: a disk folder, an S3/fsspec URL, a valkey URL.",
    no_args_is_help=True,
    add_completion=False,
)

LocationArg = typer.Argument(..., help="A folder (disk tier) or a URL such as s3://bucket/prefix or redis://host:port.")
#: What a tier needs besides the location: each tier's ``location_config`` says which keys it takes.
OptionsOpt = typer.Option(
    [],
    "--option",
    "-o",
    help="KEY=VALUE for the tier that opens the location (repeatable); a tier names the keys it takes.",
)
MaxRecordOpt = typer.Option(
    None,
    "--max-record-bytes",
    help="Read no record larger than this (bytes, or a size such as 64MiB); a larger one is reported "
    "oversized, unread. Default: the engine's bound, from the config's max_chunk_bytes ($KVPLUG_CONFIG).",
    show_default=False,
)

#: Every verdict, in the order of the report; those that fail ``verify``; those not listed one by one
#: (``unverified`` is summed up on stderr, ``gone`` was removed by someone else while checked).
_VERDICTS = ("ok", "corrupt", "oversized", "unreadable", "incompatible", "newer", "unverified", "gone", "foreign")
_FAILS_VERIFY = ("corrupt", "oversized", "unreadable", "foreign")
_UNREMARKABLE = ("ok", "unverified", "gone")


@contextmanager
def open_store(
    location: str, options: list[str] | None = None, *, read_only: bool = True, max_record_bytes: int | None = None
) -> Iterator[StorageTier]:
    """Open ``location`` with the first installed tier that says it opens it
    (:meth:`kvplug.StorageTier.location_config`), for inspection: nothing evicted, and
    with ``read_only`` nothing created, changed or removed. ``options``: ``KEY=VALUE`` items
    for that tier's :meth:`~kvplug.StorageTier.location_config`; ``max_record_bytes``: the
    tier reads no more of a record (:attr:`kvplug.TierContext.max_record_bytes`)."""
    from kvplug.core.concerns import LOCATION_TIERS, install_command, location_package
    from kvplug.core.plugins import get_registry
    from kvplug.core.records.integrity import integrity_key
    from kvplug.core.records.store import RecordStore
    from kvplug.core.tier import TierContext

    # Records are checked with this process's integrity key: an unusable key setting (a
    # set-but-empty variable) is an error here, never a verify that quietly passes unsigned records.
    integrity_key()
    settings = _options(options or [])
    tiers = get_registry().storage_tiers()
    for kind, cls in tiers.items():
        # Opening locations is an optional capability: a tier without it opens none.
        locate = getattr(cls, "location_config", None)
        if not callable(locate):
            continue
        try:
            config = locate(location, settings)
        except ValueError as exc:
            raise ConfigError([ConfigProblem("location", location, f"tier {kind!r}: {exc}")]) from None
        if config is not None:
            break
    else:
        package = location_package(location)
        needs = f"no installed tier opens this location; {package} does: {install_command(package)}"
        scheme = location.split("://", 1)[0].lower() if "://" in location else ""
        if LOCATION_TIERS.get(scheme, "s3") in tiers:  # installed, and it refused: installing it is no help
            needs = (
                f"no installed tier opens {scheme + '://' if scheme else 'this'} locations ({package}, installed, "
                "does not know this scheme, or reads it only: kvplug store opens stores an engine can write)"
            )
        raise ConfigError([ConfigProblem("location", location, needs)])
    tier = cls(config, TierContext(read_only=read_only, max_record_bytes=max_record_bytes))
    if not isinstance(tier, RecordStore):
        tier.close()
        raise ConfigError([ConfigProblem("location", location, f"tier {kind!r} cannot list its records")])
    try:
        yield tier
    finally:
        tier.close()


@store_app.command("stats")
def stats(location: str = LocationArg, options: list[str] = OptionsOpt) -> None:
    """How many records and bytes a store holds, and its tier's counters."""

    def action() -> None:
        with open_store(location, options) as tier:
            records = list(tier.records())  # type: ignore[attr-defined]
            table = Table(title=f"kvplug store {location}")
            table.add_column("what")
            table.add_column("value", justify="right")
            table.add_row("records", str(len(records)))
            table.add_row("bytes", format_size(sum(r.size for r in records)))
            times = [r.modified for r in records if r.modified is not None]
            if times:
                table.add_row("oldest", _when(min(times)))
                table.add_row("newest", _when(max(times)))
            for name, value in tier.stats().extra.items():
                table.add_row(f"tier {name}", _budget(value) if name == "max_bytes" else str(value))
            print_table(table)

    run_or_exit(action)


@store_app.command("ls")
def ls(
    location: str = LocationArg,
    options: list[str] = OptionsOpt,
    limit: int = typer.Option(50, min=0, help="Show at most this many records, newest first (0: all)."),
    max_record_bytes: str | None = MaxRecordOpt,
) -> None:
    """List records: key digest, size, when written (or last used, where reads move a record's time), and the KV chunk each holds."""

    def action() -> None:
        bound = record_bound(max_record_bytes)
        with open_store(location, options, max_record_bytes=bound.read) as tier:
            records = sorted(tier.records(), key=lambda r: r.modified or 0, reverse=True)  # type: ignore[attr-defined]
            shown = records if limit == 0 else records[:limit]
            table = Table(
                title=f"{len(records)} records in {location}"
                + ("" if len(shown) == len(records) else f" (newest {len(shown)})")
            )
            # a record's listed time: when written, or (disk, shm) when last written or read
            for column in ("key digest", "size", getattr(tier, "listed_time", "written"), "chunk"):
                table.add_column(column)
            for record in shown:
                check, _ = _read_and_check(tier, record, bound)
                table.add_row(record.digest, format_size(record.size), _when(record.modified), _describe(check))
            print_table(table)

    run_or_exit(action)


RequireSignedOpt = typer.Option(
    False,
    "--require-signed",
    help="Every record must be signed and its signature checked: refused unless this process has the integrity "
    "key (KVPLUG_INTEGRITY_KEY or KVPLUG_INTEGRITY_KEY_FILE), with which an unsigned record is corrupt. For a "
    "check that must fail, not pass unchecked, where the key is missing.",
)


@store_app.command("verify")
def verify(
    location: str = LocationArg,
    options: list[str] = OptionsOpt,
    max_record_bytes: str | None = MaxRecordOpt,
    require_signed: bool = RequireSignedOpt,
) -> None:
    """Read every record and check its checksums; exit 1 when any fails.

    A failure: a record corrupt, oversized (over --max-record-bytes: not read) or that cannot be
    read, or an entry named like a record (or a shard folder) that is not one the store can read
    (foreign: a link, a folder). Records signed with an integrity key this process lacks are
    "unverified": said on stderr, not a failure unless --require-signed (which needs the key)."""

    def action() -> None:
        from kvplug.core.records.integrity import integrity_key

        if require_signed and integrity_key() is None:
            raise typer.BadParameter(
                "needs this process's integrity key, to check signatures: set KVPLUG_INTEGRITY_KEY or "
                "KVPLUG_INTEGRITY_KEY_FILE as the engines have it",
                param_hint="--require-signed",
            )
        bound = record_bound(max_record_bytes)
        unsigned: list[str] = []
        with open_store(location, options, max_record_bytes=bound.read) as tier:
            verdicts = _check_all(tier, bound, remove=False, unsigned=unsigned)
        _report(verdicts, removed=0)
        if require_signed and unsigned:  # of another record version: kept, but not checked
            err_console.print(
                f"[red]error:[/red] --require-signed: {len(unsigned)} records' signatures could not be checked "
                f"(another record version): {', '.join(unsigned[:20])}{', ...' if len(unsigned) > 20 else ''}",
                highlight=False,
            )
            raise typer.Exit(1)
        if verdicts["unverified"]:
            # Exit 0 means every record was checked: say loudly which were not.
            err_console.print(
                f"[yellow]warning:[/yellow] {verdicts['unverified']} records are signed with an integrity key and "
                "this process has none: their bytes were not checked (set KVPLUG_INTEGRITY_KEY or "
                "KVPLUG_INTEGRITY_KEY_FILE; --require-signed makes a missing key an error)",
                highlight=False,
            )
        if any(verdicts[status] for status in _FAILS_VERIFY):
            raise typer.Exit(1)

    run_or_exit(action)


@store_app.command("gc")
def gc(
    location: str = LocationArg, options: list[str] = OptionsOpt, max_record_bytes: str | None = MaxRecordOpt
) -> None:
    """Verify every record and remove the corrupt and incompatible ones.

    Incompatible: of an older format version (a newer kvplug's are kept). Records over the
    engine's bound are removed too, not those over a tighter --max-record-bytes alone (they are
    kept, unread). Exit 1 when it leaves any that verify fails on (unreadable, foreign,
    oversized kept)."""

    def action() -> None:
        bound = record_bound(max_record_bytes)
        with open_store(location, options, read_only=False, max_record_bytes=bound.read) as tier:
            verdicts = _check_all(tier, bound, remove=True)
        _report(verdicts, removed=verdicts.pop("removed", 0))
        left = verdicts["unreadable"] + verdicts["foreign"] + (0 if bound.removable else verdicts["oversized"])
        if left:
            console.print(f"left: {left} entries gc cannot judge or may not remove (above)", highlight=False)
            raise typer.Exit(1)

    run_or_exit(action)


def _check_all(
    tier: StorageTier, bound: RecordBound | None = None, *, remove: bool, unsigned: list[str] | None = None
) -> Counter[str]:
    """Judge every record (``remove``: and remove the bad ones); ``bound``: none is read past
    its ``read`` (``None``: the tier's own bound alone). ``unsigned`` gets the digests of the
    records kept as ``newer`` or ``incompatible`` whose signature was not checked."""
    bound = bound or RecordBound(UNBOUNDED, UNBOUNDED)
    records: list[StoredRecord] = list(tier.records())  # type: ignore[attr-defined]
    verdicts: Counter[str] = Counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("verifying", total=len(records))
        for record in records:
            check, data = _read_and_check(tier, record, bound)
            verdicts[check.status] += 1
            if unsigned is not None and check.status in ("newer", "incompatible") and not check.signature_checked:
                unsigned.append(record.digest)
            if check.status not in _UNREMARKABLE:
                console.print(f"{check.status}: {record.digest} ({check.reason})", highlight=False, markup=False)
                if remove and _removable(check, bound):
                    verdicts["removed"] += _remove(tier, record.digest, data)
            progress.advance(task)
    # Entries the tier left alone, never verified: links, folders or FIFOs named like records,
    # shard folders this user may not open (logged by the tier, each naming its path).
    foreign = tier.stats().extra.get("foreign", 0)
    verdicts["foreign"] = foreign if isinstance(foreign, int) else 0
    return verdicts


def _read_and_check(tier: StorageTier, record: StoredRecord, bound: RecordBound) -> tuple[RecordCheck, Buffer | None]:
    """The verdict on one record and the bytes judged (``None`` when found bad unread):
    :func:`check_record` of its bytes, ``oversized`` when listed larger than ``bound.read``
    (not read), ``corrupt`` when the tier found it bad unread (its size), ``unreadable`` when
    it is there but could not be read (no permission)."""
    from kvplug.core.records.store import RecordCheck, check_record

    digest = record.digest
    if record.size > bound.read:  # a listed size can be wrong: the tier reads no more than the bound either
        over = (
            "the engine's bound" if bound.removable else "the bound" if bound.engine is None else "--max-record-bytes"
        )
        return RecordCheck("oversized", f"{record.size} bytes, over {over} of {bound.read}: not read"), None
    try:
        data = tier.read_record(digest)  # type: ignore[attr-defined]
    except CorruptChunkError as exc:
        return RecordCheck("corrupt", str(exc)), None
    except RecordUnreadableError as exc:
        return RecordCheck("unreadable", str(exc.__cause__ or exc)), None
    return check_record(digest, data), data


def _removable(check: RecordCheck, bound: RecordBound) -> bool:
    """Whether ``gc`` removes a record of this verdict: one that could not be read is not
    judged, and one over a bound tighter than the engine's may be one an engine serves."""
    if check.status == "oversized":
        return bound.removable
    return check.status in ("corrupt", "incompatible")


def _remove(tier: StorageTier, digest: str, seen: Buffer | None) -> bool:
    """Remove a bad record only if the store still holds the bytes judged: an engine may
    have stored a good one there since. A store that cannot remove conditionally (its
    backend has no ``delete_if_same``) removes it by name."""
    delete_if_same = getattr(tier, "delete_record_if_same", None)
    removed = None if delete_if_same is None else delete_if_same(digest, seen)
    if removed is None:
        # (counted removed: some stores, S3's, cannot tell whether a DELETE found the record)
        tier.delete_record(digest)  # type: ignore[attr-defined]
        return True
    return bool(removed)


def _report(verdicts: Counter[str], *, removed: int) -> None:
    table = Table(title="verification")
    table.add_column("records")
    table.add_column("count", justify="right")
    for status in _VERDICTS:
        table.add_row(status, str(verdicts[status]))
    table.add_row("removed", str(removed))
    print_table(table)


def _describe(check: RecordCheck) -> str:
    if check.status != "ok":
        return f"{check.status}: {check.reason}"
    if check.shape is None:
        return check.reason
    return f"{check.dtype} {list(check.shape)}"


def _budget(value: object) -> str:
    """A tier's ``max_bytes`` as a person reads it: a size with its bytes, or "unbounded"
    (``None``, -1, or :data:`kvplug.UNBOUNDED_BYTES` and above: what an inspection opens with)."""
    from kvplug.core.tier import UNBOUNDED_BYTES

    if value is None or (isinstance(value, int) and (value < 0 or value >= UNBOUNDED_BYTES)):
        return "unbounded (opened for inspection: nothing is evicted)"
    if isinstance(value, int):
        return f"{format_size(value)} ({value} bytes)"
    return str(value)


def _options(items: list[str]) -> dict[str, str]:
    """``-o KEY=VALUE`` items as a mapping; an item without ``=`` is a config error naming it."""
    options: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([ConfigProblem("--option", item, "expected KEY=VALUE")])
        options[key.strip()] = value
    return options


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
