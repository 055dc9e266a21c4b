"""How ``kvplug ctl`` sums the replies of an engine's ranks and draws them: counts and
bytes summed over ranks, tier rows grouped by tier, one JSON object for ``--json``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from kvplug.cli.console import format_size
from kvplug.core.control.client import RankEndpoint

#: Each rank's reply to one request, with the rank that sent it.
Replies = list[tuple[RankEndpoint, dict[str, Any]]]


def rank_name(rank: RankEndpoint) -> str:
    return rank.name


def closed_ranks(replies: Replies) -> list[str]:
    """The ranks whose engine is closed while their control server still answers."""
    return [rank_name(rank) for rank, reply in replies if reply.get("closed") is True]


def report_closed(replies: Replies, closed: list[str]) -> None:
    """Say which ranks' engines are closed (their figures are not live); exit 1 when every
    rank's is: the engine serves from none of them."""
    if closed:
        every = " (every rank: the engine is closed)" if len(closed) == len(replies) else ""
        typer.echo(
            f"closed: {', '.join(closed)}{every}: the engine of these ranks is closed while its control server "
            "still answers: it serves nothing, and its figures are not live (closed tiers hold and count nothing)",
            err=True,
        )
    if replies and len(closed) == len(replies):
        raise typer.Exit(1)


def with_missing(total: dict[str, Any], missing: list[str]) -> dict[str, Any]:
    """``total`` with the engine's ranks no request reached (``missing_ranks``, when there are
    any). A lookup's hit is then 0: the engine's own lookup asks every rank and misses without one."""
    if not missing:
        return total
    total = {**total, "missing_ranks": missing}
    if "hit_tokens" in total:
        total["hit_tokens"] = 0
        if "reason" in total:
            total["reason"] = f"ranks {', '.join(missing)} did not answer: the engine's lookup misses without them"
    return total


def report_missing(missing: list[str], what: str, *, changes: bool = False) -> None:
    """Say which of the engine's ranks no request reached (no control socket answered for
    them); exit 2 when the command ``changes`` the engine: it was done on the others only."""
    if not missing:
        return
    effect = f"{what} was done on the other ranks only" if changes else f"the {what} shown leave them out"
    typer.echo(
        f"missing: {', '.join(missing)}: the engine has these ranks, but no control socket of theirs answered "
        f"(stopped, or still starting); {effect}",
        err=True,
    )
    if changes:
        raise typer.Exit(2)


def print_json(replies: Replies, total: dict[str, Any]) -> None:
    ranks = [{"dp_rank": r.rank[0], "pp_rank": r.rank[1], "tp_rank": r.rank[2], **reply} for r, reply in replies]
    engine = replies[0][0].engine_id if replies else None
    typer.echo(json.dumps({"engine": engine, "total": total, "ranks": ranks}, indent=2))


def sum_numbers(dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Numbers summed key by key; other values kept when every dict agrees, else joined."""
    total: dict[str, Any] = {}
    for d in dicts:
        for key, value in d.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
            elif key not in total:
                total[key] = value
            elif total[key] != value and not isinstance(value, (dict, list)):
                total[key] = f"{total[key]}, {value}"
    return total


def sum_tiers(replies: Replies) -> list[dict[str, Any]]:
    by_label: dict[str, list[dict[str, Any]]] = {}
    for _, reply in replies:
        for row in reply.get("tiers", []):
            summed = {k: v for k, v in row.items() if k != "extra"}
            extra = row.get("extra") or {}
            if "pinned_bytes" in extra:  # a tier that keeps pins (GuardedEviction's figures)
                summed["pinned_bytes"] = extra["pinned_bytes"]
            by_label.setdefault(str(row.get("tier")), []).append(summed)
    return [sum_numbers(rows) for rows in by_label.values()]


def tier_table(title: str, rows: Sequence[dict[str, Any]], rank: str | None = None) -> Table:
    table = Table(title=title)
    columns = [
        "tier",
        "medium",
        "used",
        "pinned",
        "budget",
        "items",
        "hits",
        "misses",
        "evictions",
        "errors",
        "breaker",
    ]
    for column in (["rank"] if rank else []) + columns:
        table.add_column(column)
    for row in rows:
        pinned = row.get("pinned_bytes", row.get("extra", {}).get("pinned_bytes"))
        sizes = [format_size(row.get("bytes_used")), format_size(pinned), format_size(row.get("max_bytes"))]
        counts = [
            str(row.get(name, "-")) for name in ("items", "hits", "misses", "evictions", "errors", "breaker_state")
        ]
        cells = [str(row.get("tier")), str(row.get("medium")), *sizes, *counts]
        table.add_row(*(Text(c) for c in ([rank] if rank else []) + cells))
    return table
