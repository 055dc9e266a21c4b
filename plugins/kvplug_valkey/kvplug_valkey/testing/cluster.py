"""A Valkey Cluster for tests: :class:`~kvplug_valkey.testing.server.ValkeyServer` nodes in
cluster mode on 127.0.0.1, joined by ``valkey-cli --cluster create``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from kvplug_valkey.testing.server import HOST, ValkeyServer


class ValkeyCluster:
    """A Valkey Cluster of ``masters`` nodes (no replicas) on 127.0.0.1, made with
    ``valkey-cli --cluster create``; every node has its files under ``workdir``.

    :meth:`stop`/:meth:`kill`/:meth:`start` act on every node; ``nodes[i]`` gives one.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        masters: int = 3,
        *,
        password: str | None = None,
        maxmemory: int | str | None = None,
        maxmemory_policy: str = "allkeys-lru",
    ) -> None:
        if masters < 3:
            raise ValueError(f"masters={masters}: valkey-cli --cluster create needs at least 3")
        self.workdir = Path(workdir)
        self.password = password
        self.nodes = [
            ValkeyServer(
                self.workdir / f"node{i}",
                password=password,
                maxmemory=maxmemory,
                maxmemory_policy=maxmemory_policy,
                cluster_port=True,
            )
            for i in range(masters)
        ]
        self._created = False

    @property
    def url(self) -> str:
        """The first node's URL; a cluster client discovers the others from it."""
        return self.nodes[0].url

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def tier_options(self, **options: Any) -> dict[str, Any]:
        return self.nodes[0].tier_options(**options)

    def start(self, timeout_s: float = 30.0) -> ValkeyCluster:
        """Start every node; the first time, join them and assign all 16384 slots."""
        for node in self.nodes:
            node.start()
        if not self._created:
            addresses = [f"{HOST}:{node.port}" for node in self.nodes]
            self.nodes[0].cli("--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes")
            self._created = True
        self.wait_ok(timeout_s)
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            while "cluster_state:ok" not in node.cli("cluster", "info"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"cluster node {node.port} not ok within {timeout_s} s")
                time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def restart(self, timeout_s: float = 30.0) -> ValkeyCluster:
        """Stop and start every node; nodes keep their cluster config (``nodes-PORT.conf``)."""
        self.stop()
        return self.start(timeout_s)

    def __enter__(self) -> ValkeyCluster:
        try:
            return self.start()
        except BaseException:
            self.kill()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ValkeyCluster(ports={self.ports})"
