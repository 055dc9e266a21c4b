"""The fleet test (issue 12 part 5) for mooncake: three processes, each a CacheEngine
with a cpu tier in front of one shared mooncake tier. Process 1 stores prompts,
processes 2 and 3 retrieve them byte for byte. Then the cluster is killed: all three
keep answering (misses) within the lookup budget; it is restarted: hits come back
without restarting the processes.

It lives with the plugin, not in tests/test_fleet.py, because Mooncake's sockets
need the loopback-only network namespace these tests run in (see kvplug_mooncake.testing).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvplug_mooncake.testing import MooncakeCluster

WORKER = str(Path(__file__).with_name("fleet_worker.py"))
PROMPTS = [0, 1, 2]
TOKENS = 256
#: lookup_timeout_ms in the workers is 200; allow for process scheduling on 2 shared cores.
LOOKUP_BOUND_S = 0.5


class Engine:
    def __init__(self, options: dict) -> None:
        self.process = subprocess.Popen(
            [sys.executable, WORKER, json.dumps(options)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def wait_ready(self) -> None:
        assert self._read() == {"ready": True}

    def _read(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"worker exited with {self.process.poll()}"
        return json.loads(line)

    def ask(self, **command: object) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def quit(self) -> None:
        stdin = self.process.stdin
        if self.process.poll() is None and stdin is not None and not stdin.closed:
            try:
                stdin.write(json.dumps({"op": "quit"}) + "\n")
                stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        self.quit()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


@pytest.fixture
def fleet(tmp_path):
    with MooncakeCluster(tmp_path / "cluster") as cluster:
        options = {
            **cluster.tier_options,
            "request_timeout_s": 0.5,
            "retries": 0,
            "breaker_failures": 2,
            "breaker_cooldown_s": 1.0,
        }
        engines = [Engine(options) for _ in range(3)]  # they start in parallel
        try:
            for engine in engines:
                engine.wait_ready()
            yield cluster, engines
        finally:
            for engine in engines:
                engine.quit()
            for engine in engines:
                engine.close()


def test_three_engines_share_one_mooncake_store_and_survive_its_death(fleet) -> None:
    cluster, (first, second, third) = fleet
    for prompt in PROMPTS:
        assert first.ask(op="store", prompt=prompt)["queued"] == TOKENS
    for engine in (second, third):
        for prompt in PROMPTS:
            assert engine.ask(op="lookup", prompt=prompt)["tokens"] == TOKENS
            answer = engine.ask(op="retrieve", prompt=prompt)
            assert answer["loaded"] == TOKENS and answer["equal"], answer

    cluster.kill()
    # Their cpu tiers still hold what they read; the shared tier is gone.
    for engine in (first, second, third):
        engine.ask(op="drop_cpu", prompts=PROMPTS)
    for _ in range(3):
        for engine in (first, second, third):
            for prompt in PROMPTS:
                answer = engine.ask(op="lookup", prompt=prompt)
                assert answer["tokens"] == 0
                assert answer["seconds"] < LOOKUP_BOUND_S, answer

    cluster.restart()
    # The restarted store is empty: the first engine stores again, the others hit again.
    deadline = time.monotonic() + 30
    while True:
        first.ask(op="drop_cpu", prompts=PROMPTS)
        first.ask(op="store", prompt=PROMPTS[0])
        if second.ask(op="lookup", prompt=PROMPTS[0])["tokens"] == TOKENS:
            break
        assert time.monotonic() < deadline, "hits did not come back after the restart"
        time.sleep(0.5)
    for engine in (second, third):
        answer = engine.ask(op="retrieve", prompt=PROMPTS[0])
        assert answer["loaded"] == TOKENS and answer["equal"], answer
