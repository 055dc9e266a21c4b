"""Every exception kvplug raises on purpose.

Callers catch the narrowest class they can handle. The engine-facing paths
(:meth:`kvplug.CacheEngine.lookup`, ``retrieve``, ``store``) never let a
:class:`ChunkError` or :class:`TierError` escape: those become cache misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class KVPlugError(Exception):
    """Base class of every kvplug error."""


# --- plugins -------------------------------------------------------------------------


class PluginError(KVPlugError):
    """A plugin could not be loaded or registered."""


class PluginLoadError(PluginError):
    """An entry point of the ``kvplug`` group failed to import."""

    def __init__(self, plugin: str, distribution: str, cause: BaseException) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.cause = cause
        super().__init__(
            f"plugin {plugin!r} (distribution {distribution}) failed to import: {type(cause).__name__}: {cause}"
        )


class PluginRejectedError(PluginError):
    """A plugin loaded but is not used: a misspelled hook, a hook that raised, or a
    plugin built for another kvplug plugin API."""

    def __init__(self, plugin: str, distribution: str, reason: str) -> None:
        self.plugin = plugin
        self.distribution = distribution
        self.reason = reason
        super().__init__(f"plugin {plugin!r} (distribution {distribution}) is not used: {reason}")


class DuplicateComponentError(PluginError):
    """Two plugins provide a component of the same concern under the same name."""

    def __init__(self, concern: str, name: str, first: str, second: str) -> None:
        self.concern, self.name, self.first, self.second = concern, name, first, second
        super().__init__(
            f"two {concern} components are named {name!r}: one from {first}, "
            f"one from {second}; uninstall one or limit plugins with KVPLUG_PLUGINS"
        )


class InvalidComponentError(PluginError):
    """A hook returned something that is not a usable component class.

    The registry does not raise it: it refuses such a plugin by name
    (:class:`PluginRejectedError` in ``load_errors``), so that one plugin's bad component
    leaves the others loaded. The class stays importable for code that catches it."""


# --- config --------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config: where (dotted path), what value, why.

    Credentials are masked on construction (see :mod:`kvplug.redaction`): neither
    the value nor the message of a problem ever holds a secret, so an error can be
    printed, logged or kept without leaking one.
    """

    path: str
    value: object
    message: str

    def __post_init__(self) -> None:
        from kvplug.redaction import redact, redact_text

        leaf = self.path.rsplit(".", 1)[-1].split("[", 1)[0] if self.path else None
        object.__setattr__(self, "value", redact(self.value, leaf or None))
        object.__setattr__(self, "message", redact_text(self.message))

    def __str__(self) -> str:
        shown = repr(self.value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return f"{self.path or '<root>'}: {self.message} (got {shown})"


class ConfigError(KVPlugError, ValueError):
    """A config is invalid. ``problems`` lists each one with its field path."""

    def __init__(self, problems: Sequence[ConfigProblem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid kvplug config{where}:\n{lines}")


class TierOpenError(ConfigError):
    """A configured tier could not be opened: its constructor raised (a folder that
    cannot be created or written, a store it cannot reach at start-up).

    Names the entry, ``tiers[1] (type disk): <reason>``, so a user knows which line of
    the config to fix; ``cause`` is the tier's own exception. Every adapter gets it,
    since the core opens the tiers (:meth:`kvplug.TierChain.open`).
    """

    def __init__(self, index: int, tier_type: str, cause: BaseException) -> None:
        self.index, self.tier_type, self.cause = index, tier_type, cause
        reason = str(cause) if isinstance(cause, KVPlugError) else f"{type(cause).__name__}: {cause}"
        super().__init__([ConfigProblem(f"tiers[{index}]", tier_type, f"cannot open the tier: {reason}")])
        # The problem's message is redacted (a URL's credentials); the one line names the entry.
        self.args = (f"kvplug config tiers[{index}] (type {tier_type}): {self.problems[0].message}",)


class ExplainInputError(KVPlugError, ValueError):
    """``kvplug explain`` was given a prompt or a fingerprint it cannot use (not token
    ids, an unknown fingerprint field, no manifest matching a digest); the message says which."""


# --- chunks --------------------------------------------------------------------------


class KeyFormatError(KVPlugError, ValueError):
    """A string is not a well-formed store key (``<version>/<fingerprint hex>/<digest hex>``);
    the message names the part that is wrong."""


class ChunkError(KVPlugError):
    """A stored chunk cannot be used. The engine treats it as a miss."""


class CorruptChunkError(ChunkError):
    """The bytes of a chunk fail their checksum, or the header is malformed."""


class IncompatibleChunkError(ChunkError):
    """A well-formed chunk of another format version, dtype or shape."""


class NewerFormatError(IncompatibleChunkError):
    """A well-formed record or chunk in a format this kvplug does not know yet: a newer
    format version, or a dtype a later kvplug added.

    A miss, never misread; ``kvplug store gc`` keeps such records for the newer kvplug
    that wrote them (a store shared during a rolling upgrade), as engines do.
    """


class MissingIntegrityKeyError(IncompatibleChunkError):
    """A record signed with an integrity key, read by a process that has none.

    A miss, never misread; ``kvplug store gc`` keeps such records for the processes
    that hold the key.
    """


# --- storage -------------------------------------------------------------------------


class TierError(KVPlugError):
    """A storage tier failed an operation."""


class TierUnavailableError(TierError):
    """The tier's backing store is down or its circuit breaker is open."""


class BackendAnswerError(TierError):
    """A record tier's backend answered a call with what the call did not ask for: more or
    fewer answers than names, or one name's record in another name's place. A fault of
    the backend, counted towards its circuit breaker; the answer is never taken as news
    about the records (the call is a miss, nothing is forgotten or deleted)."""


class RecordUnreadableError(TierUnavailableError):
    """One stored record is there but could not be read (no permission, an I/O error):
    ``kvplug store verify`` counts it as unreadable, a failure, never as gone."""


class TierClosedError(TierError):
    """An operation on a tier after :meth:`close`."""


class ValueTooLargeError(TierError):
    """A value larger than the tier's whole byte budget."""


# --- connectors ----------------------------------------------------------------------


class ConnectorError(KVPlugError):
    """A KV connector cannot run here, or failed to move a chunk."""


class PinnedPoolExhaustedError(ConnectorError):
    """No pinned staging buffer became free before the deadline (a counted miss)."""


class TransferTimeoutError(ConnectorError):
    """A device copy did not complete before its deadline."""


# --- engine --------------------------------------------------------------------------


class LayoutError(KVPlugError, ValueError):
    """KV cache tensors do not match the layout they were declared with."""


class UnsupportedModelError(LayoutError):
    """An engine's KV cache holds something kvplug cannot key or load correctly (a Mamba/GDN
    state group of a hybrid model): refused at start-up, naming the model, the group and why."""


class EngineClosedError(KVPlugError):
    """The cache engine was used after :meth:`kvplug.CacheEngine.close`."""


class EngineUnavailableError(KVPlugError):
    """An engine an adapter drives cannot start in this environment (say, a package beside it
    built for another torch); the message names the cause and the fix in one line."""


# --- control socket ------------------------------------------------------------------


class UnsafeSocketPathError(KVPlugError):
    """A socket folder or file that another user could control (a link, foreign-owned, open to others)."""


class SocketInUseError(KVPlugError):
    """A socket path another running process serves on: a server does not take it over."""


class ControlError(KVPlugError):
    """A control request to a running engine failed: no engine answers, the socket is gone
    or refused us, the reply was malformed, or the engine said no (the message says which)."""


class ControlProtocolError(ControlError, ValueError):
    """A control message breaks the protocol: too large, not length-prefixed JSON, an
    unknown op, a field of the wrong type or size, or another protocol version."""
