"""A command group that imports a sub-command's module only when that command is used.

Typer builds every command up front, so each ``kvplug`` command would import every
command module (the control client, the store walker, the explain renderer) just to
register them. Click's documented remedy is a group that resolves some names on demand:
:class:`LazyCommands` keeps ``name -> "module:attribute"`` (a ``typer.Typer``) and turns
it into a click command the first time the name is asked for.
"""

from __future__ import annotations

import importlib
from difflib import get_close_matches
from typing import Any, ClassVar

import typer
from typer.core import TyperGroup


class LazyCommands(TyperGroup):
    """A group of the commands registered on it, then those of :attr:`modules` (set by a subclass)."""

    #: Command name -> ``"module:attribute"`` of the ``typer.Typer`` that implements it.
    modules: ClassVar[dict[str, str]] = {}

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *(name for name in self.modules if name not in self.commands)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in self.modules:
            module, attribute = self.modules[cmd_name].split(":")
            sub_app: typer.Typer = getattr(importlib.import_module(module), attribute)
            command = typer.main.get_command(sub_app)
            command.name = cmd_name
            self.commands[cmd_name] = command
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except Exception as exc:
            # Typer suggests among the commands built so far; a lazy command is not one yet.
            message = getattr(exc, "message", None)
            matches = get_close_matches(args[0], self.list_commands(ctx)) if args else []
            if isinstance(message, str) and matches and "Did you mean" not in message:
                exc.message = f"{message.rstrip('.')}. Did you mean {', '.join(map(repr, matches))}?"  # type: ignore[attr-defined]
            raise
