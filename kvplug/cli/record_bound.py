"""How much of one record ``kvplug store`` reads: the engine's bound on records (from the
config's ``max_chunk_bytes`` and serializer, as an engine bounds its tiers before it knows
its model) or ``--max-record-bytes``. A record over it is ``oversized``, never read."""

from __future__ import annotations

from dataclasses import dataclass

import typer
from rich.markup import escape

from kvplug.cli.console import err_console
from kvplug.errors import ConfigError, PluginError

#: No bound of the command's own: what a tier opened without ``max_record_bytes`` reads.
UNBOUNDED = 1 << 62


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
    from kvplug.core.config_types import parse_byte_size
    from kvplug.core.records.frame import RECORD_HEADER_SIZE

    read = None
    if max_record_bytes is not None:
        try:
            read = parse_byte_size(max_record_bytes)
        except ValueError as exc:
            said = str(exc) if repr(max_record_bytes) in str(exc) else f"{max_record_bytes!r} {exc}"
            raise typer.BadParameter(said, param_hint="--max-record-bytes") from None
        if read <= RECORD_HEADER_SIZE:
            raise typer.BadParameter(
                f"{max_record_bytes!r}: must be at least {RECORD_HEADER_SIZE + 1} bytes, a record's header and a byte",
                param_hint="--max-record-bytes",
            )
    engine = _engine_bound()
    if read is None:
        read = engine or _default_bound()
        if engine is None:
            _warn(f"records are read up to the default config's bound, {read} bytes; --max-record-bytes sets it")
    return RecordBound(read, engine)


def _warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False)


def _engine_bound() -> int | None:
    """The engine's bound on records under its config (``$KVPLUG_CONFIG`` and ``KVPLUG_*``),
    as the engine computes it (:func:`kvplug.core.records.frame.record_bound`). Where that config cannot be loaded here (it names a tier installed only where the
    engine runs, or this host lacks the default ``cpu`` tier), from its ``max_chunk_bytes``
    alone when its serializer frames as :class:`~kvplug.Serializer` does (every shipped one).
    ``None``, said on stderr, when neither can tell: ``gc`` then removes no record for its size."""
    from kvplug.core.config.loader import load_config
    from kvplug.core.plugins import get_registry
    from kvplug.core.records.frame import record_bound
    from kvplug.core.serializer_factory import make_serializer

    try:
        config = load_config().config
        serializer = make_serializer(config, config.registry or get_registry())
    except (ConfigError, PluginError) as exc:
        return _bound_from_settings(exc)
    try:
        return record_bound(serializer, None)
    finally:
        serializer.close()


def _bound_from_settings(failed: Exception) -> int | None:
    """The engine's bound from the ``max_chunk_bytes`` and ``serializer`` settings of the
    config file and ``KVPLUG_*`` variables alone, when the config as a whole did not load."""
    import os

    from kvplug.core.chunk_format import DEFAULT_MAX_CHUNK_BYTES
    from kvplug.core.config.layers import env_layer
    from kvplug.core.config.yaml_layer import read_yaml_layer
    from kvplug.core.config_types import parse_byte_size
    from kvplug.core.plugins import get_registry
    from kvplug.core.serializer import Serializer

    settings: dict[str, object] = {}
    try:
        path = os.environ.get("KVPLUG_CONFIG")
        for layer in ([read_yaml_layer(path)] if path else []) + [env_layer(os.environ)]:
            settings.update({k: v for k, v in layer.items() if k in ("max_chunk_bytes", "serializer")})
        largest = parse_byte_size(settings.get("max_chunk_bytes", DEFAULT_MAX_CHUNK_BYTES))
    except (ConfigError, ValueError) as exc:
        _warn(f"the engine's bound on records is not known: its config cannot be read here: {exc}")
        return None
    spec = settings.get("serializer") or {}
    kind = spec.get("type", "raw") if isinstance(spec, dict) else str(spec)
    framing = getattr(get_registry().serializers().get(kind), "max_frame_bytes", None)
    if framing is not Serializer.max_frame_bytes or not 0 < largest <= 1 << 40:
        _warn(f"the engine's bound on records is not known: its config cannot be read here: {failed}")
        return None
    return _frame_bound(largest)


def _default_bound() -> int:
    """The bound of the default config (``max_chunk_bytes`` 1 GiB)."""
    from kvplug.core.chunk_format import DEFAULT_MAX_CHUNK_BYTES

    return _frame_bound(DEFAULT_MAX_CHUNK_BYTES)


def _frame_bound(largest_chunk: int) -> int:
    """A record of a chunk of ``largest_chunk`` bytes framed as :class:`~kvplug.Serializer` frames."""
    from kvplug.core.records.frame import RECORD_HEADER_SIZE
    from kvplug.core.serializer import Serializer

    return RECORD_HEADER_SIZE + Serializer.max_frame_bytes(None, largest_chunk)  # type: ignore[arg-type]
