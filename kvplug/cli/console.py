"""The consoles every ``kvplug`` command prints to, and how a bad config ends one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from kvplug.errors import ConfigError, EngineUnavailableError, PluginError, TierError

console = Console()
#: Errors are never wrapped by rich (which wraps at 80 columns when stderr is not a
#: terminal): a hint's ``pip install kvplug-s3`` must stay one line for a log or a
#: copy-paste; a terminal wraps long lines itself.
err_console = Console(stderr=True, soft_wrap=True)

T = TypeVar("T")


def print_table(table: Table, out: Console | None = None) -> None:
    """``table`` as rich draws it where every cell fits the console's width (80 columns when
    output is piped), and any two-column table (its values wrap); otherwise one block
    per row, ``column: value`` lines under the table's title, so no header or value is cut to
    ``med…`` or folded into 3-letter lines."""
    out = out or console
    # The width the table takes when nothing is wrapped or cut (rich clamps a measure to the options).
    natural = Measurement.get(out, out.options.update(max_width=1 << 20), table).maximum
    # A label and its value wrap readably (a long path folds); more columns squeezed cut
    # headers and fold values into 3-letter lines.
    if natural <= out.width or len(table.columns) <= 2:
        for column in table.columns:
            column.overflow = "fold"  # a word longer than its column breaks, never ends in "…"
        out.print(table)
        return
    if table.title:
        out.print(Text.from_markup(str(table.title)), soft_wrap=True)
    headers = [_plain(column.header) for column in table.columns]
    columns = [list(column.cells) for column in table.columns]
    for row in range(table.row_count):
        first, *rest = (_text(column[row]) for column in columns)
        if len(columns) == 2:  # a label and its value: one line each
            out.print(first + Text(": ") + rest[0], soft_wrap=True)
            continue
        out.print(first, soft_wrap=True)  # the row's name, then its other cells under it
        for header, cell in zip(headers[1:], rest):
            out.print(Text(f"  {header}: ") + cell, soft_wrap=True)


def _text(cell: object) -> Text:
    return cell if isinstance(cell, Text) else Text.from_markup(str(cell))


def _plain(cell: object) -> str:
    return _text(cell).plain


def print_error(message: object) -> None:
    """``error: <message>`` on stderr, the word in red on a terminal; the message is printed as it
    is (an error's text holds brackets, ``tiers[0]``, that must not read as markup)."""
    err_console.print(f"[red]error:[/red] {escape(str(message))}", highlight=False)


def run_or_exit(action: Callable[[], T]) -> T:
    """Run a command's work; a config, plugin or store error is printed and exits with status 2."""
    try:
        return action()
    # a store that is down or refuses us, an engine that cannot start here: say so, no traceback
    except (ConfigError, PluginError, TierError, EngineUnavailableError) as exc:
        print_error(exc)
        raise typer.Exit(2) from None


def format_size(nbytes: object) -> str:
    """A byte count as a person reads it (``1.5 GiB``); ``-`` for anything not a number."""
    if not isinstance(nbytes, (int, float)) or isinstance(nbytes, bool):
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
