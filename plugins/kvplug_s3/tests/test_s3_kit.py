"""The s3 test kit's servers on a machine that runs other tests: a port another process takes
between the kit's choosing it and the bind is never a failed start. The proxy and moto bind
port 0 themselves; SeaweedFS (a child) starts again on ports chosen anew."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import kvplug_s3.fault_proxy as proxy_kit
import kvplug_s3.testing as s3_kit
from kvplug.testing import free_ports, held_port
from kvplug_s3.testing import BUCKET, FaultProxy, MotoS3, SeaweedS3, listening_addresses


@pytest.fixture
def taken_port() -> Iterator[int]:
    with held_port() as port:
        yield port


def probes_hand_out(monkeypatch: pytest.MonkeyPatch, module: object, port: int) -> None:
    """The race cannot be caused on demand: a kit's port probe hands out a port another process holds
    (``raising=False``: a kit that binds port 0 itself has no probe to patch)."""
    monkeypatch.setattr(module, "free_port", lambda: port, raising=False)


def test_the_fault_proxy_binds_a_port_of_its_own(
    moto_s3: MotoS3, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes_hand_out(monkeypatch, proxy_kit, taken_port)
    proxy = FaultProxy(moto_s3.port)
    try:
        assert proxy.port not in (0, taken_port)
        assert BUCKET in {b["Name"] for b in moto_s3.client(proxy.endpoint).list_buckets()["Buckets"]}
        proxy.set_mode("refuse")
        proxy.set_mode("pass")  # listening again: on the port clients know
        assert BUCKET in {b["Name"] for b in moto_s3.client(proxy.endpoint).list_buckets()["Buckets"]}
    finally:
        proxy.close()


def test_moto_binds_a_port_of_its_own_and_restarts_on_it(taken_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    probes_hand_out(monkeypatch, s3_kit, taken_port)
    server = MotoS3()
    server.start()
    try:
        assert server.port not in (0, taken_port)
        server.client().create_bucket(Bucket=BUCKET)
        port = server.port
        server.stop()
        server.start()
        assert server.port == port
        assert BUCKET in {b["Name"] for b in server.client().list_buckets()["Buckets"]}
    finally:
        server.stop()


def test_seaweedfs_chooses_its_ports_again_when_one_was_taken(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed_out: list[list[int]] = []

    def first_has_a_taken_port(count: int) -> list[int]:
        ports = free_ports(count)
        if not handed_out:
            ports[list(s3_kit._PORT_NAMES).index("s3.port")] = taken_port
        handed_out.append(ports)
        return ports

    monkeypatch.setattr(s3_kit, "free_ports", first_has_a_taken_port, raising=False)
    monkeypatch.setattr(s3_kit, "_free_ports", first_has_a_taken_port, raising=False)  # (ee9bb23's name)
    server = SeaweedS3(tmp_path)
    assert server.port == taken_port
    try:
        server.start()
        assert server.port != taken_port and len(handed_out) == 2
        assert server.process is not None
        assert (("127.0.0.1", server.port)) in listening_addresses(server.process.pid)
        ports = dict(server.ports)
        server.stop()
        server.start()  # (its endpoint may be in use: a restart keeps the ports it started on)
        assert server.ports == ports
    finally:
        server.close()
