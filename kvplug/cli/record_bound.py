"""How much of one record ``kvplug store`` reads: the engine's bound on records (from the
config's ``max_chunk_bytes`` and serializer, as an engine bounds its tiers before it knows
its model) or ``--max-record-bytes``. A record over it is ``oversized``, never read."""

from __future__ import annotations

import re
from dataclasses import dataclass

import typer
from rich.markup import escape

from kvplug.cli.console import err_console
from kvplug.errors import ConfigError, PluginError

#: No bound of the command's own: what a tier opened without ``max_record_bytes`` reads.
UNBOUNDED = 1 << 62
#: A ``--max-record-bytes`` value: a whole number of bytes, or of a binary or decimal unit.
_SIZE = re.compile(r"(\d{1,15})\s*([kmgt]i?b|b)?", re.IGNORECASE)
_UNITS = (
    {"b": 1}
    | {f"{u}b": 1000 ** (n + 1) for n, u in enumerate("kmgt")}
    | {f"{u}ib": 1 << (10 * (n + 1)) for n, u in enumerate("kmgt")}
)


@dataclass(frozen=True)
class RecordBound:
    """The most bytes a command reads of one record, and the engine's own bound (``None``:
    its config could not be read): a record over ``engine`` is corrupt to every engine of
    this config, one over a tighter ``read`` alone was only not read."""

    read: int
    engine: int | None

    @property
    def removable(self) -> bool:
        """Whether ``gc`` may remove a record over :attr:`read`: only if no engine would read it."""
        return self.engine is not None and self.read >= self.engine


def record_bound(max_record_bytes: str | None) -> RecordBound:
    """``--max-record-bytes`` (or the engine's bound when not given) and the engine's bound:
    that of the largest chunk the config's serializer decodes (``max_chunk_bytes``), as an
    engine bounds its tiers before it knows its model."""
    from kvplug.core.records.frame import RECORD_HEADER_SIZE

    read = None
    if max_record_bytes is not None:
        size = _SIZE.fullmatch(max_record_bytes.strip())
        read = 0 if size is None else int(size[1]) * _UNITS[(size[2] or "B").lower()]
        if read <= RECORD_HEADER_SIZE:
            raise typer.BadParameter(
                f"{max_record_bytes!r}: expected a whole number of bytes, or of a unit (67108864, 64MiB, 1GiB), "
                f"of at least {RECORD_HEADER_SIZE + 1}, a record's header and a byte",
                param_hint="--max-record-bytes",
            )
    engine = _engine_bound()
    if read is None:
        read = engine or _engine_bound(default=True) or UNBOUNDED
        if engine is None:
            _warn(f"records are read up to the default config's bound, {read} bytes; --max-record-bytes sets it")
    return RecordBound(read, engine)


def _warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False)


def _engine_bound(*, default: bool = False) -> int | None:
    """The engine's bound on records under its config (``$KVPLUG_CONFIG`` and ``KVPLUG_*``;
    with ``default``, the default config's). ``None``, said on stderr, when that config cannot
    be read here (it names a plugin not installed on this host): the store is still inspected,
    and ``gc`` removes no record for its size."""
    from kvplug.core.config.loader import load_config
    from kvplug.core.plugins import get_registry
    from kvplug.core.records.frame import RECORD_HEADER_SIZE
    from kvplug.core.serializer_factory import make_serializer

    try:
        config = load_config(env={}).config if default else load_config().config
        serializer = make_serializer(config, config.registry or get_registry())
    except (ConfigError, PluginError) as exc:
        _warn(f"the engine's bound on records is not known: its config cannot be read here: {exc}")
        return None
    try:
        # (as kvplug.core.engine.chunk_store.record_bound, which imports torch)
        return RECORD_HEADER_SIZE + serializer.max_frame_bytes(serializer.max_chunk_bytes)
    finally:
        serializer.close()
