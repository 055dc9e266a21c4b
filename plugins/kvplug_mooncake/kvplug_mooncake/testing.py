"""A real Mooncake Store cluster on 127.0.0.1 for tests: ``mooncake_master`` (with its
built-in HTTP metadata server) and one standalone storage process (``mooncake_client``).

Mooncake's binaries (0.3.13) listen on the wildcard address for part of their
sockets whatever their flags say: the master's HTTP metadata server, and every
client's transfer-engine RPC and TCP data ports (the kvplug process's own client
included). :class:`MooncakeCluster` therefore refuses to start outside a network
namespace whose only interface is loopback, where a wildcard socket cannot be
reached from, or send to, any other address. Run the tests under one::

    unshare --net python -m pytest plugins/kvplug_mooncake/tests

(root, or a user namespace: ``unshare --user --map-root-user --net``). Every flag
that takes an address is still set to 127.0.0.1, and so is ``MC_TCP_BIND_ADDRESS``.

This is kvplug-mooncake's public test kit, like ``kvplug.testing``: shipped in the package
because the tests and benchmarks of other packages start clusters with it; its binaries
come with the ``test`` extra, and no runtime module imports it (tests/test_test_kits.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from kvplug.testing import PortTaken, free_port, free_ports, listening_addresses, ports_in_use, start_on_free_ports

__all__ = [
    "LOOPBACK",
    "NETNS_HINT",
    "LoopbackOnlyError",
    "MooncakeCluster",
    "free_port",
    "mooncake_env",
    "require_loopback_only_network",
]

LOOPBACK = "127.0.0.1"
NETNS_HINT = "unshare --net <command>"


class LoopbackOnlyError(RuntimeError):
    """This process can reach interfaces other than loopback: Mooncake must not run here."""


def require_loopback_only_network() -> None:
    """Raise :class:`LoopbackOnlyError` unless loopback is this process's only network interface
    (and it is up)."""
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:
        raise LoopbackOnlyError(
            f"mooncake's binaries listen on the wildcard address; this network namespace has interfaces {names}. "
            f"Run inside a loopback-only namespace: {NETNS_HINT}"
        )
    _bring_loopback_up()
    with socket.socket() as probe:
        try:
            probe.bind((LOOPBACK, 0))
        except OSError as exc:
            raise LoopbackOnlyError(f"loopback is not up ({exc}); run `ip link set lo up` first") from None


def _bring_loopback_up() -> None:
    """``ip link set lo up`` without iproute2 (a fresh namespace starts with lo down)."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, siocgifflags, request))[1]
        if not flags & iff_up:
            try:
                fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))
            except OSError as exc:
                raise LoopbackOnlyError(f"cannot bring loopback up ({exc}); run `ip link set lo up` first") from None


def _binary(name: str) -> str:
    import mooncake

    path = Path(mooncake.__file__).parent / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pip install mooncake-transfer-engine-non-cuda")
    return found


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, even by a crash,
    so no master or storage process outlives the tests that started it."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def mooncake_env() -> dict[str, str]:
    return dict(os.environ, MC_TCP_BIND_ADDRESS=LOOPBACK)


class MooncakeCluster:
    """``mooncake_master`` + one ``mooncake_client`` storage process on 127.0.0.1.

    ``segment_size`` is the storage process's segment ("256MB" by default); a small
    one makes a full store. ``lease_ttl_ms`` is the master's object lease.
    """

    def __init__(self, workdir: str | Path, *, segment_size: str = "256MB", lease_ttl_ms: int = 1000) -> None:
        self.workdir = Path(workdir)
        self.segment_size = segment_size
        self.lease_ttl_ms = lease_ttl_ms
        self.rpc_port, self.metadata_port, self.metrics_port, self.client_port = free_ports(4)
        #: Ports of our choosing that no one was given yet are chosen again if another process takes
        #: one between choosing and binding it (this machine runs other tests); restarts keep them.
        self._ports_chosen_here = True
        self.master: subprocess.Popen[bytes] | None = None
        self.storage: subprocess.Popen[bytes] | None = None
        self._logs: list[Any] = []

    # --- addresses ------------------------------------------------------------------

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{LOOPBACK}:{self.metadata_port}/metadata"

    @property
    def tier_options(self) -> dict[str, Any]:
        """Options for ``{type: mooncake, ...}`` that reach this cluster."""
        return {"master": self.master_address, "metadata_server": self.metadata_server, "local_hostname": LOOPBACK}

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> MooncakeCluster:
        require_loopback_only_network()
        os.environ["MC_TCP_BIND_ADDRESS"] = LOOPBACK  # the kvplug process's own client
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self._ports_chosen_here:
            start_on_free_ports(self._start_both, self._choose_ports_again)
            self._ports_chosen_here = False
        else:
            self._start_both()
        return self

    def _start_both(self) -> None:
        self.start_master()
        self.start_storage()

    def _choose_ports_again(self) -> None:
        self.kill()
        self.rpc_port, self.metadata_port, self.metrics_port, self.client_port = free_ports(4)

    def start_master(self) -> None:
        command = [
            _binary("mooncake_master"),
            f"--rpc_address={LOOPBACK}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={LOOPBACK}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_host={LOOPBACK}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.lease_ttl_ms}",
            "--client_ttl=3",
            "--rpc_thread_num=2",
            "--logtostderr",
        ]
        self.master = self._spawn("master", command)
        self._wait_for_port(self.rpc_port, self.master, "mooncake_master")
        self._wait_for_port(self.metadata_port, self.master, "mooncake_master (HTTP metadata)")

    def start_storage(self) -> None:
        command = [
            _binary("mooncake_client"),
            f"--host={LOOPBACK}",
            f"--port={self.client_port}",
            f"--master_server_address={self.master_address}",
            f"--metadata_server={self.metadata_server}",
            f"--global_segment_size={self.segment_size}",
            "--protocol=tcp",
            "--logtostderr",
        ]
        self.storage = self._spawn("storage", command)
        self._wait_for_port(self.client_port, self.storage, "mooncake_client")
        self.wait_until_mounted()

    def wait_until_mounted(self, timeout_s: float = 20.0) -> None:
        """Until the master reports storage capacity (the storage process mounted its segment)."""
        deadline = time.monotonic() + timeout_s
        url = f"http://{LOOPBACK}:{self.metrics_port}/metrics"
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    text = response.read().decode(errors="replace")
                for line in text.splitlines():
                    if line.startswith("master_total_capacity_bytes") and float(line.split()[-1]) > 0:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the storage process did not mount its segment within {timeout_s} s")

    def kill(self, *, storage: bool = True) -> None:
        """SIGKILL the master (and the storage process)."""
        for process in (self.master, self.storage if storage else None):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)

    def restart(self) -> None:
        """Kill whatever still runs and start master and storage again on the same ports."""
        self.kill()
        self.start_master()
        self.start_storage()

    def pause(self) -> None:
        """SIGSTOP the master: it accepts connections and never answers."""
        assert self.master is not None
        self.master.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.master is not None
        self.master.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for process in (self.storage, self.master):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.terminate()
                try:
                    process.wait(5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> MooncakeCluster:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    # --- plumbing -------------------------------------------------------------------

    def _spawn(self, role: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{role}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log)
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=mooncake_env(),
            cwd=self.workdir,
            preexec_fn=_die_with_parent,
        )

    def _wait_for_port(self, port: int, process: subprocess.Popen[bytes], what: str, timeout_s: float = 20.0) -> None:
        # Until ``process`` itself listens on ``port``: a connection could reach another process's socket.
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                failure = f"{what} exited with {process.returncode}; see {self.workdir}"
                # mooncake's binaries do not all say a port in use (the HTTP metadata server does not)
                ports = (self.rpc_port, self.metadata_port, self.metrics_port, self.client_port)
                if self._ports_chosen_here and ports_in_use(ports):
                    raise PortTaken(f"{failure}: ports in use {ports_in_use(ports)}")
                raise RuntimeError(failure)
            try:
                if port in {bound for _, bound in listening_addresses(process.pid)}:
                    return
            except OSError:  # (it exited meanwhile: asked again)
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{what} did not listen on {LOOPBACK}:{port} within {timeout_s} s")


if __name__ == "__main__":  # pragma: no cover - a manual check
    with MooncakeCluster(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvplug-mooncake") as cluster:
        print(cluster.tier_options)
