"""The integrity key of persistent records: which process signs and checks them.

A record frame (:mod:`kvplug.core.records.frame`) carries a keyed MAC (version 2) when
this process has an integrity key, checksums only (version 1) when it has none. The key
is process-wide, resolved once from ``KVPLUG_INTEGRITY_KEY`` (the secret) or
``KVPLUG_INTEGRITY_KEY_FILE`` (a file holding it), so the signatures of the record
functions stay as they were; a key given to kvplug is never used raw (blake3 derivation).
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Mapping
from types import EllipsisType

import blake3

from kvplug.core.tier import Buffer
from kvplug.errors import ConfigError, ConfigProblem

#: Environment variables that give the key: the secret itself, or the path of a file holding it.
INTEGRITY_KEY_ENV = "KVPLUG_INTEGRITY_KEY"
INTEGRITY_KEY_FILE_ENV = "KVPLUG_INTEGRITY_KEY_FILE"
MIN_INTEGRITY_KEY_BYTES = 16
#: A key file longer than this is refused, never cut: a prefix would make keys that differ past it equal.
MAX_INTEGRITY_KEY_FILE_BYTES = 4096
#: blake3 key derivation context: a key given to kvplug is never used raw.
_DERIVE_CONTEXT = "kvplug 2026-11 record integrity v2"
#: Bytes of the MAC in a version 2 record header (128 bits).
_MAC_SIZE = 16


class IntegrityKey:
    """A derived 32-byte blake3 key; its repr never shows it."""

    __slots__ = ("_key",)

    def __init__(self, material: bytes) -> None:
        if len(material) < MIN_INTEGRITY_KEY_BYTES:
            raise ValueError(f"an integrity key needs at least {MIN_INTEGRITY_KEY_BYTES} bytes")
        self._key = blake3.blake3(material, derive_key_context=_DERIVE_CONTEXT).digest()

    def mac(self, header: Buffer, value: Buffer) -> bytes:
        hasher = blake3.blake3(key=self._key)
        hasher.update(header)
        hasher.update(value)
        return hasher.digest(length=_MAC_SIZE)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IntegrityKey) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return "IntegrityKey(**********)"


def resolve_integrity_key(env: Mapping[str, str] | None = None) -> IntegrityKey | None:
    """The key from ``KVPLUG_INTEGRITY_KEY`` (the secret) or ``KVPLUG_INTEGRITY_KEY_FILE``.

    Set at most one of them. A variable that is set but empty (or only white space) is
    an error, not "no key": ``export KVPLUG_INTEGRITY_KEY="$(cat /run/secrets/...)"``
    with the secret missing must not quietly turn signing off. A key file must be a
    regular file of at most :data:`MAX_INTEGRITY_KEY_FILE_BYTES` bytes that other users
    cannot read, and not empty or only white space; its content, less a trailing
    newline, is the key. Raises
    :class:`kvplug.errors.ConfigError` (never quoting the key) when the setting is unusable.
    """
    env = os.environ if env is None else env
    where = integrity_key_variable(env)
    if where is None:
        return None
    if where == INTEGRITY_KEY_FILE_ENV:
        material = _read_key_file(env[INTEGRITY_KEY_FILE_ENV])
    else:
        material = env[INTEGRITY_KEY_ENV].encode()
    try:
        return IntegrityKey(material)
    except ValueError as exc:
        raise _key_error(
            where, f"{exc} (got {len(material)}); e.g. 32 random bytes as hex: openssl rand -hex 32"
        ) from None


def integrity_key_variable(env: Mapping[str, str] | None = None) -> str | None:
    """The variable that gives this process's integrity key, or ``None`` when neither is set.

    The one place that decides what counts as set, for :func:`resolve_integrity_key` and
    for ``kvplug config show``: a set-but-empty variable, or both variables set, is a
    :class:`kvplug.errors.ConfigError` naming the variable.
    """
    env = os.environ if env is None else env
    present = [name for name in (INTEGRITY_KEY_ENV, INTEGRITY_KEY_FILE_ENV) if name in env]
    problems = [
        ConfigProblem(
            f"env {name}",
            env[name],
            "is set but empty (or only white space): an empty variable is not 'no key' (a missing secret or file must not turn "
            "signing off); give the key (KVPLUG_INTEGRITY_KEY) or the path of a file holding it "
            "(KVPLUG_INTEGRITY_KEY_FILE), or unset the variable to run without a key",
        )
        for name in present
        if not env[name].strip()
    ]
    if problems:
        raise ConfigError(problems, "environment")
    if len(present) == 2:
        raise _key_error(INTEGRITY_KEY_ENV, "set either KVPLUG_INTEGRITY_KEY or KVPLUG_INTEGRITY_KEY_FILE, not both")
    return present[0] if present else None


def _read_key_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise _key_error(INTEGRITY_KEY_FILE_ENV, f"cannot open the key file {path}: {exc.strerror}", path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _key_error(INTEGRITY_KEY_FILE_ENV, f"the key file {path} is not a regular file", path)
        if info.st_mode & 0o077:
            raise _key_error(
                INTEGRITY_KEY_FILE_ENV,
                f"the key file {path} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it",
                path,
            )
        # One byte past the limit tells an over-long file from one of exactly the limit
        # (st_size alone could change between fstat and read).
        material = b""
        while len(material) <= MAX_INTEGRITY_KEY_FILE_BYTES:
            block = os.read(fd, MAX_INTEGRITY_KEY_FILE_BYTES + 1 - len(material))
            if not block:
                break
            material += block
    finally:
        os.close(fd)
    if len(material) > MAX_INTEGRITY_KEY_FILE_BYTES:
        # Reading a prefix would make two keys that differ past it the same key.
        raise _key_error(
            INTEGRITY_KEY_FILE_ENV,
            f"the key file {path} is longer than {MAX_INTEGRITY_KEY_FILE_BYTES} bytes, the most a key file may "
            f"hold (is it the right file?); a key needs at least {MIN_INTEGRITY_KEY_BYTES} bytes: 32 random bytes as hex, "
            "openssl rand -hex 32, are 64",
            path,
        )
    if not material.strip():
        # The variables' rule, for the file's content: a secret mounted empty must not
        # become a key anyone can guess.
        raise _key_error(
            INTEGRITY_KEY_FILE_ENV,
            f"the key file {path} is empty (or only white space): give it the key (e.g. openssl rand -hex 32), "
            "or unset the variable to run without a key",
            path,
        )
    return material.rstrip(b"\r\n")


def _key_error(variable: str, message: str, shown: str | None = None) -> ConfigError:
    return ConfigError(
        [ConfigProblem(f"env {variable}", shown if shown is not None else "<hidden>", message)], "environment"
    )


_key_lock = threading.Lock()
_key_resolved = False
_process_key: IntegrityKey | None = None


def integrity_key() -> IntegrityKey | None:
    """This process's integrity key, resolved from the environment on first use."""
    global _key_resolved, _process_key
    if _key_resolved:
        return _process_key
    with _key_lock:
        if not _key_resolved:
            _process_key = resolve_integrity_key()
            _key_resolved = True
    return _process_key


def set_integrity_key(key: IntegrityKey | bytes | None | EllipsisType) -> None:
    """Set this process's key (bytes are key material), ``None`` for no key, ``...`` to re-read the environment.

    For tests and embedders; a deployment sets ``KVPLUG_INTEGRITY_KEY(_FILE)`` instead.
    Every process sharing a store must use the same key.
    """
    global _key_resolved, _process_key
    with _key_lock:
        if key is ...:
            _key_resolved, _process_key = False, None
            return
        _process_key = IntegrityKey(key) if isinstance(key, bytes) else key
        _key_resolved = True
