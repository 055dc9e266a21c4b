"""``vllm serve`` (through ``vllm_cli.py``) as a real server process on 127.0.0.1, for the serve tests.

The port is chosen free and let go before the server binds it; on this machine other tests can take
it meanwhile. vLLM binds its socket before it builds the engine, so a taken port ends the process at
once saying "Address already in use": the server starts again on another port (kvplug.testing's
bounded retry), at the cost of an import, not of an engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvplug.testing import PortTaken, free_port, says_address_in_use, start_on_free_ports

VLLM_CLI = Path(__file__).with_name("vllm_cli.py")


@contextmanager
def vllm_serve(
    model: str,
    args: Sequence[str] | Callable[[], Sequence[str]],
    *,
    log_path: Path,
    env: dict[str, str],
    cwd: Path,
    start_timeout_s: float,
    choose_port: Callable[[], int] = free_port,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``vllm serve MODEL --host 127.0.0.1 --port P *args``, healthy: yields its URL and process, and
    SIGKILLs its whole process group at the end. The log (``log_path``) is of the last start.
    ``args`` may be a function, called at each start: one that chooses other ports of its own (a
    worker's metrics port) chooses them anew when a start lost one."""
    started: list[subprocess.Popen[bytes]] = []
    port = [choose_port()]

    def start() -> tuple[str, subprocess.Popen[bytes]]:
        rest = args() if callable(args) else args
        command = [sys.executable, str(VLLM_CLI), "serve", model, "--host", "127.0.0.1", "--port", str(port[0]), *rest]
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=cwd
            )
        started.append(proc)
        url = f"http://127.0.0.1:{port[0]}"
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                output = log_path.read_text(errors="replace")
                failure = f"vllm serve exited with {proc.returncode}:\n{output[-6000:]}"
                raise PortTaken(failure) if says_address_in_use(output) else AssertionError(failure)
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return url, proc
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"vllm serve not healthy after {start_timeout_s}s:\n{log_path.read_text()[-6000:]}"
                )
            time.sleep(1)

    def choose_again() -> None:
        port[0] = choose_port()

    try:
        yield start_on_free_ports(start, choose_again)
    finally:
        for proc in started:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


#: How ``examples/serve_cpu.sh`` refuses a port it finds in use before it starts a server.
_SCRIPT_PORT_IN_USE = "on 127.0.0.1 is in use (another server?)"


def run_serve_script(
    run: Callable[[dict[str, str], Path], subprocess.CompletedProcess[str]],
    work_root: Path,
    choose_port: Callable[[], int] = free_port,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``run(ports, work)`` runs ``examples/serve_cpu.sh`` with ``ports`` (``PORT`` and ``METRICS_PORT``)
    and the work folder ``work``; a run that failed because a port was taken (the script's check, or a
    server that could not bind) runs again on ports chosen anew, in a fresh work folder (a first run's
    disk tier would make the next one's cold request a hit). Returns the last run and its work folder."""
    attempt = [0]

    def start() -> tuple[subprocess.CompletedProcess[str], Path]:
        attempt[0] += 1
        work = work_root / f"work-{attempt[0]}"
        done = run({"PORT": str(choose_port()), "METRICS_PORT": str(choose_port())}, work)
        output = done.stdout + done.stderr + "".join(log.read_text() for log in work.glob("server-*.log"))
        if done.returncode != 0 and (_SCRIPT_PORT_IN_USE in output or says_address_in_use(output)):
            raise PortTaken(f"serve_cpu.sh lost a port (exit {done.returncode}):\n{output[-3000:]}")
        return done, work

    return start_on_free_ports(start, lambda: None)
