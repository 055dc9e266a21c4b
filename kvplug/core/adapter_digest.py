"""The content digest of a LoRA adapter kvplug can read: its files' names and bytes.

A training loop rewrites an adapter's files at the same path and the engine reloads it;
kvplug's tiers outlive that load (and the process), so an adapter keyed by its path would
be served the old weights' KV. Keyed by its content, a rewrite is another key and two
servers with the same files at any path share.

Hashing an adapter on every request would cost a read of its weights; a digest is kept per
path under a stat signature (size, mtime, ctime, inode of each file, and the folder's own),
so a request costs a few ``stat`` calls until a file changes. A digest is not kept while a
file's mtime is within :data:`RACY_NS` of the time it was read: a write in the same
timestamp tick could leave the signature unchanged (git's "racily clean" entries).
"""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid
from collections import OrderedDict

import blake3

#: A file modified this recently (ns) when it was hashed is hashed again next time: coarse
#: filesystem timestamps (up to 2 s on some) cannot tell a later write in the same tick.
RACY_NS = 2_000_000_000
_READ_SIZE = 1 << 20
#: What :meth:`AdapterDigests._hash` returns for files that changed while it read them.
CHANGED = "changed while read"

# Each file: (name, size, mtime_ns, ctime_ns, inode). The folder's own entry comes first
# (name ""): adding, removing or renaming a file changes it.
_Signature = tuple[tuple[str, int, int, int, int], ...]


def _entry(name: str, st: os.stat_result) -> tuple[str, int, int, int, int]:
    return (name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _signature(path: str) -> _Signature | None:
    """The stat signature of the adapter at ``path``, or ``None`` if it is not a local file
    or folder of files kvplug can stat."""
    try:
        top = os.stat(path)
        if stat.S_ISREG(top.st_mode):
            return (_entry("", top),)
        if not stat.S_ISDIR(top.st_mode):
            return None
        entries = [_entry("", top)]
        # Engines load an adapter from its folder's top level (config, weights, added
        # embeddings): every visible file there, whatever it is called, is part of it.
        with os.scandir(path) as scan:
            for item in scan:
                if item.name.startswith(".") or not item.is_file():
                    continue
                entries.append(_entry(item.name, item.stat()))
    except OSError:
        return None
    if len(entries) == 1:
        return None  # an empty folder is no adapter: keep the path key
    return (entries[0], *sorted(entries[1:]))


class AdapterDigests:
    """Content digests of adapters by path, each kept under its stat signature.

    ``files_read`` counts the files hashed (what a signature that still matches saves).
    Thread-safe; at most ``limit`` paths are kept (least recently used dropped).
    """

    def __init__(self, *, limit: int = 256) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, tuple[_Signature, str]] = OrderedDict()
        self.files_read = 0

    def digest(self, path: str) -> str | None:
        """The hex content digest of the local adapter at ``path``; ``None`` where it is not
        one kvplug can read (a hub id, a URI, a missing or unreadable path); a key of this
        call alone (``unsettled-...``) where its files changed while they were read."""
        if "://" in path:
            return None  # s3://, gs://, ...: the engine fetches it, kvplug cannot read it
        before = _signature(path)
        if before is None:
            return None
        with self._lock:
            kept = self._kept.get(path)
            if kept is not None and kept[0] == before:
                self._kept.move_to_end(path)
                return kept[1]
        started = time.time_ns()
        digest = self._hash(path, before)
        if digest is None:
            return None
        if digest is CHANGED or _signature(path) != before:
            # Read while being written: its bytes may be of neither version, and the engine may
            # have loaded either. A key of this call alone, never the path key: KV computed now
            # (stored under it) is never read back, where two rewrites' requests under the path
            # key would read each other's.
            return "unsettled-" + uuid.uuid4().hex
        if all(started - mtime >= RACY_NS for _, _, mtime, _, _ in before[1:] or before):
            with self._lock:
                self._kept[path] = (before, digest)
                self._kept.move_to_end(path)
                while len(self._kept) > self._limit:
                    self._kept.popitem(last=False)
        return digest

    def _hash(self, path: str, signature: _Signature) -> str | None:
        """The digest of the files ``signature`` names; :data:`CHANGED` if one changed size
        while read; ``None`` if one could not be read."""
        h = blake3.blake3()
        try:
            for name, size, *_ in signature if len(signature) == 1 else signature[1:]:
                # Names and sizes are framed, so no two sets of files hash alike.
                encoded = os.fsencode(name)  # undecodable names come back surrogate-escaped
                h.update(len(encoded).to_bytes(8, "little") + encoded + size.to_bytes(8, "little"))
                read = 0
                with open(os.path.join(path, name) if name else path, "rb") as f:
                    self.files_read += 1
                    while block := f.read(_READ_SIZE):
                        h.update(block)
                        read += len(block)
                if read != size:
                    return CHANGED  # rewritten while read
        except OSError:
            return None
        return h.hexdigest()


#: The digests every :meth:`kvplug.ExtraKey.adapter_source` call of this process shares.
ADAPTER_DIGESTS = AdapterDigests()
