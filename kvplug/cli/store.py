"""``kvplug store stats|ls|verify|gc LOCATION``: look into a persistent store.

LOCATION is a folder (tier ``disk``) or a URL (``s3://bucket/prefix`` and other
fsspec URLs: tier ``s3``). The store is opened read-mostly: with an unbounded
budget (nothing is evicted) and nothing written; ``gc`` removes only records that
fail verification or are of another format version.
"""

from __future__ import annotations

import datetime
import os
import re
import stat
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kvplug.cli.console import console, run_or_exit
from kvplug.core.plugins import KNOWN_COMPONENTS, get_registry
from kvplug.core.record_store import RecordCheck, RecordStore, StoredRecord, check_record
from kvplug.core.tier import StorageTier, TierContext
from kvplug.errors import ConfigError, ConfigProblem

store_app = typer.Typer(help="Inspect, verify and clean a disk folder or an S3/fsspec store.", no_args_is_help=True)
#: Opened for inspection: never evict because of a budget.
_UNBOUNDED = 2**62

LocationArg = typer.Argument(..., help="A folder (disk tier) or a URL such as s3://bucket/prefix.")
EndpointOpt = typer.Option(None, "--endpoint-url", help="S3 endpoint, e.g. http://127.0.0.1:9000.")


def tier_type_for(location: str) -> str:
    """``disk`` for a folder path, ``valkey`` for redis/valkey URLs, ``s3`` for any other URL but ``file://``."""
    if location.split("://", 1)[0].lower() in ("redis", "rediss", "valkey", "valkeys", "unix") and "://" in location:
        return "valkey"
    if "://" in location and not location.startswith("file://"):
        return "s3"
    return "disk"


_SHARD_NAME = re.compile(r"[0-9a-f]{2}")


def require_disk_store(path: str, location: str) -> None:
    """Refuse, before anything is opened or created, a folder that no disk tier wrote.

    Opening a disk tier creates its 256 shard folders: pointed at the wrong folder
    (a typo, a home directory) ``kvplug store`` would litter it. A disk store is a
    folder holding shard folders ``00``..``ff`` (links are not followed).
    """

    def refuse(why: str) -> ConfigError:
        return ConfigError([ConfigProblem("location", location, f"not a kvplug store: {why}")])

    try:
        info = os.stat(path)  # a link to the store folder is fine; links inside it are not followed
    except FileNotFoundError:
        raise refuse("no such folder") from None
    except (OSError, ValueError) as exc:
        raise refuse(f"cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise refuse("not a folder")
    try:
        with os.scandir(path) as entries:
            shards = sum(1 for e in entries if _SHARD_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
    except OSError as exc:
        raise refuse(f"cannot list it ({exc.strerror})") from None
    if not shards:
        raise refuse("the folder has no shard folders 00..ff, so no disk tier wrote it; nothing was created")


@contextmanager
def open_store(location: str, endpoint_url: str | None = None) -> Iterator[StorageTier]:
    if tier_type_for(location) == "disk":
        require_disk_store(location.removeprefix("file://"), location)
    tiers = get_registry().storage_tiers()
    # Every tier is asked whether it opens this location (StorageTier.location_config);
    # tiers that do not answer fall back to the folder/URL rule below.
    extra = {"endpoint_url": endpoint_url} if endpoint_url else {}
    tier: StorageTier | None = None
    for kind, cls in tiers.items():
        try:
            config = cls.location_config(location, extra)
        except ValueError as exc:
            raise ConfigError([ConfigProblem("location", location, f"tier {kind!r}: {exc}")]) from None
        if config is not None:
            tier = cls(config, TierContext())
            break
    if tier is None:
        kind = tier_type_for(location)
        if kind not in tiers:
            package = KNOWN_COMPONENTS[("storage_tier", kind)]
            needs = f"a {kind} store needs the {package} package: pip install {package}"
            raise ConfigError([ConfigProblem("location", location, needs)])
        cls = tiers[kind]
        if kind == "disk":
            options = {"path": location.removeprefix("file://"), "max_bytes": _UNBOUNDED}
        else:
            options = {"url": location, "max_bytes": _UNBOUNDED}
            if endpoint_url:
                options["endpoint_url"] = endpoint_url
        tier = cls(cls.Config(**options), TierContext())
    if not isinstance(tier, RecordStore):
        tier.close()
        raise ConfigError([ConfigProblem("location", location, f"tier {kind!r} cannot list its records")])
    try:
        yield tier
    finally:
        tier.close()


@store_app.command("stats")
def stats(location: str = LocationArg, endpoint_url: str | None = EndpointOpt) -> None:
    """How many records and bytes a store holds, and its tier's counters."""

    def action() -> None:
        with open_store(location, endpoint_url) as tier:
            records = list(tier.records())  # type: ignore[attr-defined]
            table = Table(title=f"kvplug store {location}")
            table.add_column("what")
            table.add_column("value", justify="right")
            table.add_row("records", str(len(records)))
            table.add_row("bytes", _size(sum(r.size for r in records)))
            times = [r.modified for r in records if r.modified is not None]
            if times:
                table.add_row("oldest", _when(min(times)))
                table.add_row("newest", _when(max(times)))
            for name, value in tier.stats().extra.items():
                table.add_row(f"tier {name}", str(value))
            console.print(table)

    run_or_exit(action)


@store_app.command("ls")
def ls(
    location: str = LocationArg,
    endpoint_url: str | None = EndpointOpt,
    limit: int = typer.Option(50, help="Show at most this many records, newest first (0: all)."),
) -> None:
    """List records: key digest, size, when written, and the KV chunk each holds."""

    def action() -> None:
        with open_store(location, endpoint_url) as tier:
            records = sorted(tier.records(), key=lambda r: r.modified or 0, reverse=True)  # type: ignore[attr-defined]
            shown = records if limit == 0 else records[:limit]
            table = Table(
                title=f"{len(records)} records in {location}"
                + ("" if len(shown) == len(records) else f" (newest {len(shown)})")
            )
            for column in ("key digest", "size", "written", "chunk"):
                table.add_column(column)
            for record in shown:
                check = check_record(record.digest, tier.read_record(record.digest))  # type: ignore[attr-defined]
                table.add_row(record.digest, _size(record.size), _when(record.modified), _describe(check))
            console.print(table)

    run_or_exit(action)


@store_app.command("verify")
def verify(location: str = LocationArg, endpoint_url: str | None = EndpointOpt) -> None:
    """Read every record and check its checksums; exit 1 when any is corrupt."""

    def action() -> None:
        with open_store(location, endpoint_url) as tier:
            verdicts = _check_all(tier, remove=False)
        _report(verdicts, removed=0)
        if verdicts["corrupt"]:
            raise typer.Exit(1)

    run_or_exit(action)


@store_app.command("gc")
def gc(location: str = LocationArg, endpoint_url: str | None = EndpointOpt) -> None:
    """Verify every record and remove the corrupt and incompatible ones."""

    def action() -> None:
        with open_store(location, endpoint_url) as tier:
            verdicts = _check_all(tier, remove=True)
        _report(verdicts, removed=verdicts["corrupt"] + verdicts["incompatible"])

    run_or_exit(action)


def _check_all(tier: StorageTier, *, remove: bool) -> Counter[str]:
    records: list[StoredRecord] = list(tier.records())  # type: ignore[attr-defined]
    verdicts: Counter[str] = Counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("verifying", total=len(records))
        for record in records:
            check = check_record(record.digest, tier.read_record(record.digest))  # type: ignore[attr-defined]
            verdicts[check.status] += 1
            if check.status in ("corrupt", "incompatible"):
                console.print(f"{check.status}: {record.digest} ({check.reason})", highlight=False)
                if remove:
                    tier.delete_record(record.digest)  # type: ignore[attr-defined]
            progress.advance(task)
    return verdicts


def _report(verdicts: Counter[str], *, removed: int) -> None:
    table = Table(title="verification")
    table.add_column("records")
    table.add_column("count", justify="right")
    for status in ("ok", "corrupt", "incompatible", "unverified", "gone"):
        table.add_row(status, str(verdicts[status]))
    table.add_row("removed", str(removed))
    console.print(table)


def _describe(check: RecordCheck) -> str:
    if check.status != "ok":
        return f"{check.status}: {check.reason}"
    if check.shape is None:
        return check.reason
    return f"{check.dtype} {list(check.shape)}"


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    return str(nbytes)


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
