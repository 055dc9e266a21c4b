"""``kvplug ctl``: ask a running engine about its cache, pin prompts, clear chunks.

Each rank of a running engine answers on a control socket in this user's private folder
(:mod:`kvplug.core.control.server`). A command finds the engine (``--engine`` ID, a
prefix of it, or its name; needed only when several run), asks every rank, and prints
the sum (counts and bytes summed over ranks; a lookup's hit is the smallest rank's, as
the engine loads only what every rank holds). ``--per-rank`` adds each rank's row;
``--json`` prints one JSON object with the total and each rank's reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.table import Table
from rich.text import Text

from kvplug.cli.console import console, format_size, print_error, print_table
from kvplug.cli.prompt import read_prompt
from kvplug.cli.prompt_replies import (
    Show,
    Total,
    explain_total,
    lookup_total,
    pin_total,
    show_explain,
    show_lookup,
    show_pin,
)
from kvplug.cli.rank_replies import (
    Replies,
    closed_ranks,
    print_json,
    rank_name,
    report_closed,
    report_missing,
    sum_numbers,
    sum_tiers,
    tier_table,
    with_missing,
)
from kvplug.core.control.client import ControlClient, find_ranks, select_engine
from kvplug.core.control.protocol import request_fields
from kvplug.core.control_socket import private_socket_dir
from kvplug.core.keys import ExtraKey, RequestInfo
from kvplug.errors import ControlError, ExplainInputError, UnsafeSocketPathError

ctl_app = typer.Typer(
    help="Control a running engine: stats, lookup, explain, pin, clear.", no_args_is_help=True, add_completion=False
)

T = TypeVar("T")

_ENGINE = typer.Option(
    None, "--engine", "-e", help="The engine's id (or a prefix of it) or name; needed when several run."
)
_DIR = typer.Option(None, "--socket-dir", help="The private socket folder (default: as the engine finds it).")
_JSON = typer.Option(False, "--json", help="Print one JSON object: the total and each rank's reply.")
_PER_RANK = typer.Option(False, "--per-rank", help="Also show each rank's row.")
#: The longest ``--timeout``: a day (a socket's timeout must fit the platform's clock).
_MAX_TIMEOUT_S = 86400.0


def _timeout(value: float) -> float:
    """``--timeout`` when it is a wait a socket can take (``nan``, ``inf`` or below 0 are not)."""
    if not 0 < value <= _MAX_TIMEOUT_S:  # (nan compares false)
        raise typer.BadParameter(f"{value!r}: expected seconds, more than 0 and at most {_MAX_TIMEOUT_S:g}")
    return value


_TIMEOUT = typer.Option(30.0, "--timeout", help="Seconds to wait for each rank's answer.", callback=_timeout)
_PROMPT = typer.Argument(..., help="File of token ids (a JSON list or whitespace-separated ints); '-' reads stdin.")
_TOKENIZER = typer.Option(
    None, "--tokenizer", help="The prompt file is text: encode it with this Hugging Face tokenizer."
)
_SALT = typer.Option(None, "--cache-salt", help="The request's cache_salt.")
_LORA = typer.Option(None, "--lora", help="The request's LoRA id.")
_LORA_PATH = typer.Option(
    None,
    "--lora-path",
    help="Where the engine loaded the LoRA adapter from: keyed by its files' content where readable here, else by the path.",
)


def _run(action: Callable[[], T]) -> T:
    try:
        return action()
    # (UnsafeSocketPathError: the socket folder, $KVPLUG_LOOKUP_DIR, is another user's or open to others)
    except (ControlError, ExplainInputError, UnsafeSocketPathError) as exc:
        print_error(exc)
        raise typer.Exit(2) from None


def _client(engine: str | None, socket_dir: Path | None, timeout: float) -> ControlClient:
    folder = socket_dir or private_socket_dir()
    found = find_ranks(folder, timeout_s=timeout)
    try:
        return ControlClient(select_engine(found.ranks, engine), timeout_s=timeout)
    except ControlError as exc:
        if (
            not found.ranks and not found.unreachable
        ):  # say where it looked: a wrong --socket-dir, another user's engine
            missing = "" if folder.is_dir() else " (no such folder)"
            raise ControlError(f"no engine is running: no control socket in {folder}{missing}") from None
        if not found.unreachable:
            raise
        why = "; ".join(found.unreachable.values())
        raise ControlError(f"{exc}; sockets that did not answer: {why}") from None


def _request(cache_salt: str | None, lora: str | None, lora_path: str | None) -> dict[str, Any]:
    extra_keys = ExtraKey.adapter_keys(lora_path)
    return request_fields(RequestInfo(cache_salt=cache_salt, lora_id=lora, extra_keys=extra_keys))


# --- commands -------------------------------------------------------------------------------


@ctl_app.command("list")
def list_command(socket_dir: Path | None = _DIR, as_json: bool = _JSON, timeout: float = _TIMEOUT) -> None:
    """The engines answering in this user's socket folder, and their ranks."""
    found = _run(lambda: find_ranks(socket_dir, timeout_s=timeout))
    if as_json:
        body = {"ranks": [{"socket": str(r.path), **r.info} for r in found.ranks], "unreachable": found.unreachable}
        typer.echo(json.dumps(body, indent=2))
        return
    if not found.ranks and not found.unreachable:
        where = socket_dir or "this user's socket folder (--socket-dir to look in another)"
        typer.echo(f"no engine is running: no control socket in {where}")
        return
    table = Table(title="running engines")
    for column in ("engine", "name", "adapter", "rank", "pid", "model", "fingerprint", "tiers"):
        table.add_column(column, overflow="fold")
    for rank in found.ranks:
        info = rank.info
        stages = int(info.get("pp_size", 1))
        where = f"{rank_name(rank)} of " + (
            f"{stages} x {info.get('tp_size')}" if stages > 1 else f"{info.get('tp_size')}"
        )
        described = [str(info.get(name)) for name in ("name", "adapter")] + [where, str(info.get("pid"))]
        cells = [rank.engine_id, *described, str(info.get("model")), str(info.get("fingerprint"))[:12]]
        cells.append(", ".join(map(str, info.get("tiers", []))))
        table.add_row(*(Text(c) for c in cells))
    print_table(table)
    for path, why in found.unreachable.items():
        console.print(f"not answering: {path}: {why}", highlight=False, markup=False)


@ctl_app.command("stats")
def stats_command(
    engine: str | None = _ENGINE,
    socket_dir: Path | None = _DIR,
    per_rank: bool = _PER_RANK,
    as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """The engine's counters (stored, loaded, lookups, errors) and its tiers' usage, summed over ranks.

    A rank whose engine is closed (its server still answering) is named; exit 1 when every rank's is."""
    client = _run(lambda: _client(engine, socket_dir, timeout))
    replies = _run(lambda: client.ask_all("stats"))
    metrics = sum_numbers([reply.get("metrics", {}) for _, reply in replies])
    closed = closed_ranks(replies)
    total = with_missing({"metrics": metrics, "tiers": sum_tiers(replies), "closed_ranks": closed}, client.missing)
    if as_json:
        print_json(replies, total)
        report_missing(client.missing, "figures")
        report_closed(replies, closed)
        return
    table = Table(
        title=f"engine {replies[0][0].engine_id}: {len(replies)} rank(s), counters summed{_closed_title(closed)}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in sorted(metrics.items()):
        if value and "_bucket{" not in name:  # histogram buckets: in --json
            table.add_row(Text(name), f"{value:g}")
    print_table(table)
    print_table(tier_table(f"tiers (summed over ranks){_closed_title(closed)}", total["tiers"]))
    _per_rank_tiers(replies, per_rank)
    report_missing(client.missing, "figures")
    report_closed(replies, closed)


def _closed_title(closed: list[str]) -> str:
    return f" (closed: {', '.join(closed)})" if closed else ""


def _per_rank_tiers(replies: Replies, per_rank: bool) -> None:
    for rank, reply in replies if per_rank else []:
        closed = " (engine closed: not live)" if reply.get("closed") is True else ""
        print_table(tier_table(f"tiers of {rank_name(rank)}{closed}", reply.get("tiers", []), rank_name(rank)))


@ctl_app.command("tiers")
def tiers_command(
    engine: str | None = _ENGINE,
    socket_dir: Path | None = _DIR,
    per_rank: bool = _PER_RANK,
    as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """Each tier's usage, budget and circuit-breaker state (a remote tier's), summed over ranks.

    A rank whose engine is closed (its server still answering) is named; exit 1 when every rank's is."""
    client = _run(lambda: _client(engine, socket_dir, timeout))
    replies = _run(lambda: client.ask_all("tiers"))
    closed = closed_ranks(replies)
    total = with_missing({"tiers": sum_tiers(replies), "closed_ranks": closed}, client.missing)
    if as_json:
        print_json(replies, total)
        report_missing(client.missing, "figures")
        report_closed(replies, closed)
        return
    title = f"tiers of engine {replies[0][0].engine_id} (summed over ranks){_closed_title(closed)}"
    print_table(tier_table(title, total["tiers"]))
    _per_rank_tiers(replies, per_rank)
    report_missing(client.missing, "figures")
    report_closed(replies, closed)


def _prompt_command(op: str, doc: str, total: Total, show: Show) -> None:
    """Add ``kvplug ctl OP PROMPT``: ask every rank ``op`` about the prompt (a file, ``-``),
    with the options every prompt command takes."""

    def command(
        prompt: str = _PROMPT,
        tokenizer: str | None = _TOKENIZER,
        cache_salt: str | None = _SALT,
        lora: str | None = _LORA,
        lora_path: str | None = _LORA_PATH,
        engine: str | None = _ENGINE,
        socket_dir: Path | None = _DIR,
        per_rank: bool = _PER_RANK,
        as_json: bool = _JSON,
        timeout: float = _TIMEOUT,
    ) -> None:
        def action() -> tuple[Replies, list[str]]:
            tokens = read_prompt(prompt, tokenizer)
            client = _client(engine, socket_dir, timeout)
            return client.ask_all(op, _request(cache_salt, lora, lora_path), tokens), client.missing

        replies, missing = _run(action)
        summed = with_missing(total(replies), missing)
        if as_json:
            print_json(replies, summed)
        else:
            show(replies, summed, per_rank)
        report_missing(missing, op, changes=op in ("pin", "unpin"))

    command.__doc__ = doc
    ctl_app.command(op)(command)


_prompt_command(
    "lookup",
    "How much of a prompt the engine holds now: the hit it would load, and where each rank holds it.",
    lookup_total,
    show_lookup,
)
_prompt_command(
    "explain",
    "A prompt's chunk map over the live engine's own tiers (its memory tier too) and why it stops there.",
    explain_total,
    show_explain,
)
_prompt_command(
    "pin",
    "Pin a prompt's stored chunks on every rank: never evicted, within the pinned-bytes budget.",
    pin_total,
    show_pin("pin"),
)
_prompt_command(
    "unpin",
    "Unpin a prompt's chunks on every rank: they are evicted like any other again.",
    pin_total,
    show_pin("unpin"),
)


@ctl_app.command("clear")
def clear_command(
    cache_salt: str | None = typer.Option(None, "--salt", help="Remove the chunks of this cache_salt only."),
    no_salt: bool = typer.Option(False, "--no-salt", help="Remove the chunks of requests without a cache_salt."),
    all_salts: bool = typer.Option(False, "--all", help="Remove the chunks of every cache_salt."),
    lora: str | None = typer.Option(None, "--lora", help="With --salt/--no-salt: the chunks of this LoRA id."),
    tier: str | None = typer.Option(
        None, "--tier", help="Only from this tier (its type, index or label: cpu, 0, 0:cpu)."
    ),
    engine: str | None = _ENGINE,
    socket_dir: Path | None = _DIR,
    per_rank: bool = _PER_RANK,
    as_json: bool = _JSON,
    timeout: float = _TIMEOUT,
) -> None:
    """Remove the chunks this engine stored since it started, of one cache_salt or of all.

    Of one cache_salt (--salt S, --no-salt) or of all (--all), from every tier or one (--tier);
    chunks it only loaded go from its private tiers (cpu) alone. Records other engines wrote to a
    tier they may share are left alone (``kvplug store`` handles stores offline)."""
    if sum([cache_salt is not None, no_salt, all_salts]) != 1:
        print_error("say what to clear: exactly one of --salt S, --no-salt, --all")
        raise typer.Exit(2)
    if all_salts and lora is not None:
        print_error("--lora scopes --salt S or --no-salt; --all clears every cache_salt and every LoRA")
        raise typer.Exit(2)
    fields: dict[str, Any] = {"all_salts": True} if all_salts else {"cache_salt": cache_salt, "lora_id": lora}
    if tier is not None:
        fields["tier"] = tier
    client = _run(lambda: _client(engine, socket_dir, timeout))
    replies = _run(lambda: client.ask_all("clear", fields))
    removed = sum_numbers([reply["removed"] for _, reply in replies])
    freed = sum_numbers([reply["bytes_freed"] for _, reply in replies])
    scope = replies[0][1]["scope"]
    known = sum(reply["known_chunks"] for _, reply in replies)
    total = with_missing(
        {"removed": removed, "bytes_freed": freed, "scope": scope, "known_chunks": known}, client.missing
    )
    if as_json:
        print_json(replies, total)
        report_missing(client.missing, "clear", changes=True)
        return
    where = ", ".join(f"{label}: {count} chunks ({format_size(freed.get(label))})" for label, count in removed.items())
    console.print(
        f"cleared the chunks of {scope} that engine {replies[0][0].engine_id} stored (and from its "
        f"private tiers those it loaded), over "
        f"{len(replies)} rank(s): {where or 'no tier matched'}",
        highlight=False,
        markup=False,
    )
    if per_rank:
        for rank, reply in replies:
            console.print(f"  {rank_name(rank)}: {reply['removed']}", highlight=False, markup=False)
    report_missing(client.missing, "clear", changes=True)
