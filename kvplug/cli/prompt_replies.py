"""How ``kvplug ctl``'s prompt commands (``lookup``, ``explain``, ``pin``, ``unpin``) sum
their ranks' replies into the total ``--json`` prints, and show them."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rich.table import Table
from rich.text import Text

from kvplug.cli.console import console, print_table
from kvplug.cli.prompt import chunk_map
from kvplug.cli.rank_replies import Replies, rank_name, sum_numbers
from kvplug.core.control.client import RankEndpoint

#: How a prompt command sums its ranks' replies (what ``--json`` prints as the total), and
#: how it shows them: ``show(replies, total, per_rank)``.
Total = Callable[[Replies], dict[str, Any]]
Show = Callable[[Replies, dict[str, Any], bool], None]


def lookup_total(replies: Replies) -> dict[str, Any]:
    return {
        "num_tokens": replies[0][1]["num_tokens"],
        "hit_tokens": min(int(reply["hit_tokens"]) for _, reply in replies),
        "chunks_held": sum(len(reply["chunks"]) for _, reply in replies),
    }


def show_lookup(replies: Replies, total: dict[str, Any], per_rank: bool) -> None:
    held = "the prefix every rank holds" if total["hit_tokens"] else "no rank holds its first chunk, or not every rank"
    console.print(
        f"hit: {total['hit_tokens']} of {total['num_tokens']} tokens ({held}); "
        f"{total['chunks_held']} chunks held over {len(replies)} rank(s)",
        highlight=False,
    )
    if per_rank or len({reply["hit_tokens"] for _, reply in replies}) > 1:
        table = Table(title="per rank")
        for column in ("rank", "hit tokens", "chunks by tier"):
            table.add_column(column)
        for rank, reply in replies:
            tiers: dict[str, int] = {}
            for tier, _ in reply["chunks"]:
                tiers[tier] = tiers.get(tier, 0) + 1
            where = ", ".join(f"{name}: {count}" for name, count in tiers.items()) or "-"
            table.add_row(rank_name(rank), str(reply["hit_tokens"]), Text(where))
        print_table(table)


def _least(replies: Replies) -> tuple[RankEndpoint, dict[str, Any]]:
    """The rank holding least of the prompt: what the engine loads."""
    return min(replies, key=lambda item: int(item[1]["hit_tokens"]))


def explain_total(replies: Replies) -> dict[str, Any]:
    worst = _least(replies)[1]
    return {"hit_tokens": worst["hit_tokens"], "num_tokens": worst["num_tokens"], "reason": worst["reason"]}


def show_explain(replies: Replies, total: dict[str, Any], per_rank: bool) -> None:
    worst_rank, worst = _least(replies)
    for rank, reply in replies if per_rank else [(worst_rank, worst)]:
        print_table(chunk_map(reply, f"{rank_name(rank)}: "))
    # (the total, not the rank's own figures: with a rank missing, the engine misses)
    console.print(
        f"hit: {total['hit_tokens']} of {worst['num_tokens']} tokens ({rank_name(worst_rank)}, the "
        f"rank holding least, of {len(replies)})",
        highlight=False,
    )
    console.print(f"why: {total['reason']}", highlight=False, markup=False)


def pin_total(replies: Replies) -> dict[str, Any]:
    total = sum_numbers([reply for _, reply in replies])
    # Each rank counts the prompt's chunks and the tokens they cover: what every rank covers
    # is the least of those, not their sum.
    if any("tokens" in reply for _, reply in replies):
        total["tokens"] = min(reply.get("tokens", 0) for _, reply in replies)
    return total


def show_pin(op: str) -> Show:
    def show(replies: Replies, total: dict[str, Any], per_rank: bool) -> None:
        summary = ", ".join(f"{name} {total.get(name, 0)}" for name in ("chunks", "bytes", "refused", "missing"))
        if "tokens" in total:
            summary += f"; covering {total['tokens']} prompt tokens on every rank"
        if total.get("book_full"):  # why some were refused: the pin book (tenancy.max_pins) is full
            summary += f"; pin book full (tenancy.max_pins): {total['book_full']} not pinned when stored"
        console.print(f"{op}ned over {len(replies)} rank(s): {summary}", highlight=False)
        if per_rank:
            for rank, reply in replies:
                console.print(f"  {rank_name(rank)}: {json.dumps(reply)}", highlight=False, markup=False)

    return show
