"""kvplug-sglang's test kit: a real ``python -m sglang.launch_server`` process on 127.0.0.1,
and a tiny random Llama to serve.

Shared by the server tests (CPU and GPU) and ``benchmarks/bench_sglang.py --server``:
shipped in the package, like ``kvplug.testing``, so benchmarks import it from an installed
kvplug-sglang; it needs SGLang, torch and transformers, and no runtime module imports it.
On a machine without CUDA the server runs on the test-only CPU platform
(``SGLANG_PLATFORM=kvplug_test_cpu``, package ``tests/sglang_cpu_platform``); on a
GPU it runs on SGLang's own CUDA platform. Prompts go in as token ids
(``--skip-tokenizer-init``), so the model needs no tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

from kvplug.testing import PortTaken, says_address_in_use, start_on_free_ports

ON_GPU = torch.cuda.is_available()
CPU_PLATFORM = "kvplug_test_cpu"  # entry point name of tests/sglang_cpu_platform
# --hicache-io-backend direct --hicache-mem-layout layer_first: the only HiCache host
# transfer the CPU platform provides (see kvplug_sglang_cpu_platform.hicache_shims).
CPU_HICACHE_ARGS = ["--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]


#: Ports the server tests pick from: below Linux's ephemeral range (32768-60999 by
#: default). A port the OS handed out and the test released could be taken by an
#: outgoing connection of the server's own processes before its HTTP server binds it
#: (CI once saw "[Errno 98] address already in use" and a server that never exited).
SERVER_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the ephemeral range (free now only: see
    :meth:`SGLangServer.wait_healthy`)."""
    for _ in range(100):
        port = random.randrange(SERVER_PORTS.start, SERVER_PORTS.stop)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {SERVER_PORTS} after 100 tries")


def write_random_llama(path: Path, *, large: bool = ON_GPU) -> Path:
    """A random-weight Llama in HF format (no tokenizer: the tests send token ids).

    On CPU it is tiny so that a server starts in seconds; weights come from a fixed
    seed, so two servers on the same directory compute the same thing.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if large:
        shape = {
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "vocab_size": 32000,
        }
    else:
        shape = {
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 2048,
        }
    config = LlamaConfig(
        **shape, max_position_embeddings=8192, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16"
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


class SGLangServer:
    """One ``sglang.launch_server`` process group; :meth:`stop` kills it for real."""

    def __init__(
        self,
        model: str,
        extra_args: list[str],
        env: dict[str, str],
        log: Path,
        *,
        startup_timeout: float = 600,
        max_total_tokens: int = 8192,
    ) -> None:
        self.log_path = log
        self._model, self._extra_args, self._env = model, list(extra_args), env
        self._max_total_tokens = max_total_tokens
        self._startup_timeout = startup_timeout
        self.port = free_port()
        #: Another process can take the port between free_port and the HTTP server's bind (this
        #: machine runs other tests): until the server answered once, it starts again on another.
        self._port_chosen_here = True
        self._spawn()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self) -> None:
        args = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self._model,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--skip-tokenizer-init",
            *self.device_args(self._max_total_tokens),
            *self._extra_args,
        ]
        full_env = {**os.environ, **self._env}
        if not ON_GPU:
            full_env["SGLANG_PLATFORM"] = CPU_PLATFORM
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            args, env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @staticmethod
    def device_args(max_total_tokens: int) -> list[str]:
        if ON_GPU:
            return ["--mem-fraction-static", "0.3"]
        # A small KV pool: on CPU SGLang would otherwise size it from the machine's free RAM.
        return [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--max-total-tokens",
            str(max_total_tokens),
            "--max-running-requests",
            "4",
        ]

    def wait_healthy(self) -> SGLangServer:
        """Until the server answers ``/health``; a port of the kit's choosing that another process
        took before the server bound it is chosen again (the server started again on it)."""
        if not self._port_chosen_here:
            return self._wait_healthy_once()
        healthy = start_on_free_ports(self._wait_healthy_once, self._start_on_another_port)
        self._port_chosen_here = False  # (its URL may be in use now)
        return healthy

    def _start_on_another_port(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # the whole group: its leader may have exited first
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self._log.close()
        self.port = free_port()
        self._spawn()

    def _wait_healthy_once(self) -> SGLangServer:
        deadline = time.monotonic() + self._startup_timeout
        while time.monotonic() < deadline:
            exited = self.proc.poll() is not None
            # SGLang's HTTP server may fail to bind and its process stay up: fail now, not at the deadline
            if exited or "error while attempting to bind on address" in self.log_path.read_text(errors="replace"):
                failure = f"server on port {self.port} {'exited' if exited else 'could not bind'}:\n{self.log_tail()}"
                if self._port_chosen_here and says_address_in_use(self.log_path.read_text(errors="replace")):
                    raise PortTaken(failure)
                raise RuntimeError(failure)
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return self
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {self._startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def generate(self, input_ids: list[int], max_new_tokens: int = 8) -> tuple[list[int], float, dict[str, Any]]:
        """Greedy generation; returns (output ids, seconds, meta_info)."""
        body = json.dumps(
            {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        ).encode()
        request = urllib.request.Request(
            self.url + "/generate", data=body, headers={"Content-Type": "application/json"}
        )
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=300) as response:
            result = json.loads(response.read())
        return result["output_ids"], time.perf_counter() - started, result.get("meta_info", {})

    def ttft(self, input_ids: list[int]) -> tuple[list[int], float, dict[str, Any]]:
        """Time to first token: a one-token greedy generation."""
        return self.generate(input_ids, max_new_tokens=1)

    def flush_cache(self) -> None:
        """SGLang's ``/flush_cache``: empties its device (and HiCache host) cache; kvplug's tiers stay."""
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(self.url + "/flush_cache", method="POST"), timeout=60)
                return
            except urllib.error.HTTPError as err:
                # SGLang refuses to flush while a request is still in flight (400); retry briefly.
                if time.monotonic() > deadline:
                    raise RuntimeError(f"/flush_cache kept failing: {err}") from err
                time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s. The SIGTERM ends SGLang's schedulers
        at once (kvplug removes their control sockets; stores still queued are lost): a test
        that needs what a server stored waits for it before stopping the server."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=60)
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the whole process group (no clean shutdown)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)
        self._log.close()


def kvplug_env(tiers: list[dict[str, Any]], chunk_size: int = 256, lookup_budget_s: float = 5.0) -> dict[str, str]:
    """kvplug's config for the radix backend (SGLang has no extra-config field for it).

    The lookup budget is raised from kvplug's 200 ms default: the tests assert hits,
    and a loaded 2-core CI machine can stall a scheduler longer than that.
    """
    return {
        "KVPLUG_CHUNK_SIZE": str(chunk_size),
        "KVPLUG_TIERS": json.dumps(tiers),
        "KVPLUG_LOOKUP_BUDGET_S": str(lookup_budget_s),
    }


def hicache_args(tiers: list[dict[str, Any]], page_size: int = 64) -> list[str]:
    """Flags for HiCache with kvplug's ``KVPlugStorage`` as the L3 storage backend."""
    extra = {
        "backend_name": "kvplug",
        "module_path": "kvplug_sglang.hicache",
        "class_name": "KVPlugStorage",
        "interface_v1": 1,
        "kvplug": {"tiers": tiers, "lookup_budget_s": 5.0},
    }
    args = [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
        "--page-size",
        str(page_size),
        # The tests assert what storage serves, not how fast: SGLang's default ("timeout")
        # gives up on a prefetch that a loaded CI machine makes slow, and recomputes.
        "--hicache-storage-prefetch-policy",
        "wait_complete",
    ]
    return args + ([] if ON_GPU else CPU_HICACHE_ARGS)
