"""The test kit's cluster on a machine that runs other tests: a port another process takes between
the kit's choosing it and a mooncake binary's bind is chosen again, never a failed start (the HTTP
metadata server does not say why it failed: the kit asks the ports)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvplug_mooncake.testing as mooncake_kit
from kvplug.testing import free_ports, held_port
from kvplug_mooncake.testing import MooncakeCluster


@pytest.mark.parametrize("taken", [1, 0, 3], ids=["metadata", "rpc", "storage"])
def test_a_chosen_port_taken_before_the_bind_is_chosen_again(
    tmp_path: Path, taken: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed_out: list[list[int]] = []

    def first_has_a_taken_port(count: int) -> list[int]:
        ports = free_ports(count)
        if not handed_out:
            ports[taken] = held
        handed_out.append(ports)
        return ports

    def one_at_a_time() -> int:  # (ee9bb23's kit chose its ports one by one: the same hand-out)
        if not handed_out or len(handed_out[-1]) == 4:
            handed_out.append([])
        port = held if len(handed_out) == 1 and len(handed_out[0]) == taken else free_ports(1)[0]
        handed_out[-1].append(port)
        return port

    with held_port() as held:
        # The race cannot be caused on demand: the kit's probe hands out a port another process holds.
        monkeypatch.setattr(mooncake_kit, "free_ports", first_has_a_taken_port, raising=False)
        monkeypatch.setattr(mooncake_kit, "free_port", one_at_a_time)
        cluster = MooncakeCluster(tmp_path)
        try:
            cluster.start()
            ports = (cluster.rpc_port, cluster.metadata_port, cluster.metrics_port, cluster.client_port)
            assert held not in ports and len(handed_out) == 2
            cluster.restart()  # (its addresses may be in use: a restart keeps the ports it started on)
            assert (cluster.rpc_port, cluster.metadata_port, cluster.metrics_port, cluster.client_port) == ports
        finally:
            cluster.stop()
