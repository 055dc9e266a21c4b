"""A scheduler-like process for the exit test: it builds ``KVPlugStorage`` as SGLang's
HiCache controller does, backs pages up to an async disk tier whose writes are slow, and
returns normally without closing the backend (as SGLang's decode-side KV offload manager
builds and leaves one). Prints one
JSON line: the control socket's path and the page keys."""

from __future__ import annotations

import atexit
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from test_sglang_hicache import PAGE, make_backend, make_host, page_keys, random_pages

import kvplug
from kvplug import hookimpl
from kvplug_disk import DiskTier


class SlowDiskTier(DiskTier):
    """A disk tier whose writes take a while: they are still queued when the process returns."""

    name = "slow_disk"

    def put(self, items: Sequence[tuple[str, Any]]) -> None:
        time.sleep(0.3)
        super().put(items)


class SlowDiskPlugin:
    @staticmethod
    @hookimpl
    def kvplug_storage_tiers() -> list[type]:
        return [SlowDiskTier]


def main(path: str, owner: str) -> None:
    """``owner``: ``none`` (nothing closes the backend, as SGLang's decode-side KV offload
    manager), or ``sglang`` (an exit hook registered after SGLang loaded its plugins and
    before the backend was built closes it, as SGLang's HiCache tree does: it must find the
    backend still open, its own storage threads being stopped first)."""
    kvplug.get_registry().register(SlowDiskPlugin, "slow-disk-test")
    if owner == "sglang":
        from kvplug_sglang.plugin import register

        register()  # what SGLang's load_plugins() does first in a scheduler process
        atexit.register(lambda: _owner_closes(backend, path))
    tier = {"type": "slow_disk", "path": path, "queue": {"mode": "async"}}
    host = make_host("layer_first")
    backend = make_backend(host, {"tiers": [tier]})
    keys = page_keys(list(range(4 * PAGE)))
    indices = random_pages(host, len(keys), seed=1)
    for i, key in enumerate(keys):  # one write each: several are queued behind the slow one
        backend.batch_set_v1([key], indices[i * PAGE : (i + 1) * PAGE])
    assert backend.control is not None
    print(json.dumps({"socket": str(backend.control.path), "keys": keys}), flush=True)


def _owner_closes(backend: Any, path: str) -> None:
    Path(path, "owner-found").write_text("open" if backend.control is not None else "closed")
    backend.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
