"""The consoles every ``kvplug`` command prints to, and how a bad config ends one."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from kvplug.errors import ConfigError, EngineUnavailableError, PluginError, TierError

console = Console()
#: Errors are never wrapped by rich (which wraps at 80 columns when stderr is not a
#: terminal): a hint's ``pip install kvplug-s3`` must stay one line for a log or a
#: copy-paste; a terminal wraps long lines itself.
err_console = Console(stderr=True, soft_wrap=True)

T = TypeVar("T")


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
